"""Rollouts from a ``vllm serve`` server over HTTP (vLLM's OpenAI-compatible API), so rollout scales past one machine.

:class:`RemoteVLLMEngine` is a :class:`~lightning_offpolicy.rollout.engine.RolloutEngine` that
talks to a vLLM server started elsewhere (``docs/remote_vllm.md`` has the command line);
:func:`~lightning_offpolicy.rollout.vllm.server.launch_local_server` starts one on this machine
(tests, single-host runs). This module imports neither vLLM nor an HTTP library: the client is
the standard library's ``http.client``, so a trainer host needs no vLLM at all.

Same guarantees as the in-process :class:`~lightning_offpolicy.rollout.VLLMEngine` (logprobs of the
distribution sampled from, token ids in and out, in-place weight sync with a self-check, no hangs),
and interruptible (partial rollouts, streamed requests): how each is kept over HTTP, and when
requests stream, is in docs/remote_vllm.md, "What the engine guarantees".
Connecting is :class:`~lightning_offpolicy.rollout.vllm.remote_connect.ServerCheck`, the requests
:class:`~lightning_offpolicy.rollout.vllm.remote_requests.RemoteRequests`, the weight
sync :class:`~lightning_offpolicy.rollout.vllm.sync.remote.RemoteWeightSync` (full weights) and
:class:`~lightning_offpolicy.rollout.vllm.sync.remote_lora.RemoteAdapterSync` (a peft model's adapter).

Start-up, connect and sync times measured on a CPU machine: ``docs/remote_vllm.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.rollout.engine import (
    Completion,
    SamplingConfig,
)
from lightning_offpolicy.rollout.shared_lock import SharedLock
from lightning_offpolicy.rollout.vllm.base import SUPPORT_LOGPROBS, RawSample, VLLMEngineBase
from lightning_offpolicy.rollout.vllm.errors import DEV_MODE_HINT
from lightning_offpolicy.rollout.vllm.http import (
    HTTPClient,
    StreamInterrupt,
    host_for_url,
    is_loopback,
    parse_base_url,
)
from lightning_offpolicy.rollout.vllm.remote_connect import ServerCheck
from lightning_offpolicy.rollout.vllm.remote_requests import RemoteRequests
from lightning_offpolicy.rollout.vllm.settings import ConnectionSettings, RemoteWeightSyncSettings, require_settings
from lightning_offpolicy.rollout.vllm.sync.remote import RemoteWeightSync
from lightning_offpolicy.rollout.vllm.sync.remote_lora import RemoteAdapterSync
from lightning_offpolicy.rollout.vllm.sync.transfer import VLLMWeightTransfer, check_transport_settings

__all__ = ["RemoteVLLMEngine"]

log = logging.getLogger(__name__)

_WHO = "RemoteVLLMEngine"


class RemoteVLLMEngine(ServerCheck, RemoteRequests, RemoteAdapterSync, RemoteWeightSync, VLLMEngineBase):
    """Sample from a vLLM server (``vllm serve``) over its OpenAI-compatible HTTP API.

    The server must run with ``--logprobs-mode processed_logprobs`` and, for weight syncs, with
    ``VLLM_SERVER_DEV_MODE=1``; both are checked at connect time (the first ``generate`` /
    ``update_weights``, or :meth:`connect`). One trainer per server: a weight sync changes the
    weights for every client of the server.

    Args:
        base_url: The server's address, e.g. ``"http://10.0.0.5:8000"`` (a trailing ``/v1`` is
            accepted and dropped).
        model: Served model name (``--served-model-name``, by default the path the server was
            started with); ``None``: ask the server (``/v1/models``), which must serve exactly one.
        request_timeout_s: Longest one HTTP request (a generation of one prompt's samples, a
            weight reload) may take before a ``RuntimeError`` is raised.
        weight_sync: How a sync reaches the server and how it is checked
            (:class:`~lightning_offpolicy.rollout.vllm.settings.RemoteWeightSyncSettings`: ``transport``
            ``"file"`` by default through ``weights_dir``, ``check``, ``tolerance``, ``lora``, ...).
            Without a ``weights_dir`` (and ``transport="file"``) the engine samples but cannot sync.
        connection: How the engine talks to the server
            (:class:`~lightning_offpolicy.rollout.vllm.settings.ConnectionSettings`: ``api_key``,
            ``connect_timeout_s``, ``max_concurrent_requests``, ``stream``, ``stream_interval``).
        eos_token_id: Stop token id; ``None``: set by the ``RolloutCallback`` from the module's
            tokenizer (:meth:`set_special_tokens`).
        stop_token_ids: More ids that end a completion besides ``eos_token_id``; ``None``: the eos
            ids the model's generation config lists (set by the ``RolloutCallback``); ``[]``: none.
        pad_token_id: Not needed by the server; accepted for symmetry with :class:`HFEngine`.
        support_logprobs: Under top-k / top-p, used only with a server whose workers do not record
            the tokens the sampler kept (one started without the kit's receiver; the servers of
            :func:`launch_local_server` record them): top logprobs asked for per generated token,
            from which they are read (``top_k`` of them when ``top_k`` is at most this); a token
            whose nucleus is wider leaves the loss (``rollout/support_unknown_frac``). The server
            must allow it (``--max-logprobs``, default 20).

    Attributes:
        version: Policy version of the weights in the server (stamped on every completion).
        model_name: The served model name in use (known after :meth:`connect`).
        max_model_len: The server's context length (known after :meth:`connect`).
        connect_time_s: Seconds the connect-time checks took.
        last_sync_time_s: Seconds of the last weight sync (write + reload + cache reset).
        last_write_time_s: Seconds the last sync spent writing the safetensors file.
        last_reload_time_s: Seconds the server took to reload the weights in the last sync
            (``weight_sync.lora="adapter"``: to load the adapter, plus the base reload at the first sync).
        last_sync_bytes: Bytes the last sync wrote into ``weights_dir`` (the safetensors file;
            ``weight_sync.lora="adapter"``: the adapter's files, plus the base weights at the first sync).
        adapter_name: With ``weight_sync.lora="adapter"``: the name the server serves the current adapter
            under, which every request uses (``None`` before the first sync).
        server_lora_config: The server's LoRA settings from ``/server_info`` (``max_lora_rank``,
            ``max_loras``, ...; ``None``: LoRA not enabled; known after :meth:`connect`).
        last_generate_tokens_per_s: Generated tokens per second of the last ``generate``.
    """

    _who = _WHO
    _backend = "the server"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        request_timeout_s: float = 600.0,
        weight_sync: RemoteWeightSyncSettings = RemoteWeightSyncSettings(),  # noqa: B008 (frozen)
        connection: ConnectionSettings = ConnectionSettings(),  # noqa: B008 (frozen)
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        support_logprobs: int = SUPPORT_LOGPROBS,
    ) -> None:
        scheme, host, port, prefix = parse_base_url(base_url)
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(
                f"RemoteVLLMEngine.model={model!r} must be the served model name (a non-empty str) or None "
                "(ask the server)."
            )
        weight_sync = require_settings(weight_sync, RemoteWeightSyncSettings, "RemoteVLLMEngine.weight_sync")
        connection = require_settings(connection, ConnectionSettings, "RemoteVLLMEngine.connection")
        check_transport_settings(weight_sync, host)
        api_key = connection.api_key or os.environ.get("VLLM_API_KEY") or None
        if api_key and scheme == "http" and not is_loopback(host):
            warnings.warn(
                f"RemoteVLLMEngine: the API key goes to {host} over plain http://: anyone on the network path can read "
                "it (and the prompts, completions and weight paths). Use https:// (a TLS proxy in front of the "
                "server), an SSH tunnel, or a private network.",
                RuntimeWarning,
                stacklevel=2,
            )
        self.base_url = f"{scheme}://{host_for_url(host)}:{port}{prefix}"
        self.model = model
        self.weights_dir = weight_sync.weights_dir
        self.server_weights_dir = weight_sync.server_weights_dir
        self._init_common(weight_sync, request_timeout_s, pad_token_id, eos_token_id, stop_token_ids, support_logprobs)
        self.max_concurrent_requests = int(connection.max_concurrent_requests)
        self.stream = connection.stream
        self.stream_interval = int(connection.stream_interval)
        self._streaming = connection.stream is True  # stream=None: turned on by the first interrupt()
        self.model_name: str | None = None
        self.max_model_len: int | None = None
        self.dev_mode: bool | None = None
        self.server_dtype: str | None = None
        self.connect_time_s: float | None = None
        self.last_write_time_s: float | None = None
        self.last_reload_time_s: float | None = None
        self.last_sync_bytes: int | None = None
        self.lora_sync = weight_sync.lora
        self.push_lora_base = weight_sync.push_lora_base
        # Read from /server_info at connect time: the LoRA settings (None: LoRA off) and whether the
        # runtime adapter routes are on (None: not said, e.g. another vLLM version).
        self.server_lora_config: dict[str, Any] | None = None
        self.server_runtime_lora: bool | None = None
        self._init_adapter_state()

        self.share_weights_with_group = weight_sync.share_with_group
        self.connect_timeout_s = float(connection.connect_timeout_s)
        self._http = HTTPClient(scheme, host, port, prefix, api_key, self.base_url, self.connect_timeout_s)
        self.weight_transport = weight_sync.transport
        self._transfer: VLLMWeightTransfer | None = None
        if weight_sync.transport != "file":
            self._transfer = VLLMWeightTransfer(
                self.base_url,
                weight_sync.transport,
                weight_sync.master_address or "127.0.0.1",
                weight_sync.master_port,
                self.request_timeout_s,
                lambda: int(
                    self._http.request("GET", "/get_world_size", timeout=self.request_timeout_s, what="get_world_size")[
                        "world_size"
                    ]
                ),
            )
        self._lock = SharedLock()  # calls sample side by side (the server batches them); a sync holds it alone
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # The model's vocabulary size, learned from the first update_weights: vLLM 0.32 started
        # without a tokenizer does not check prompt token ids, and an out-of-range id kills its engine.
        self._vocab_size: int | None = None
        self._sync_dir: Path | None = None
        # Each call keeps the interrupt it started with in _call (per thread: the base class's
        # generate calls _sample); the interrupts are StreamInterrupts (_new_interrupt), which wake a
        # blocked read.
        self._call = threading.local()

    # ------------------------------------------------------------------ public API

    def interrupt(self) -> None:
        """Cut the ``generate`` call in flight short, or the next one when none is (thread-safe; returns at once).

        The call returns as soon as its requests are cut (their connections are shut down, which
        makes the server abort them; requests not yet sent are not sent): each completion not
        finished comes back :data:`~lightning_offpolicy.rollout.engine.INTERRUPTED` with the tokens
        and logprobs received so far (possibly none; none at all for a request that did not
        stream, see ``stream``), stamped with the version of the weights that sampled them;
        finished ones keep ``"stop"`` / ``"length"``. The call consumes the interrupt: the one
        after it runs normally.
        """
        if self.stream is None:
            self._streaming = True  # interrupts are in use: keep the tokens of the next ones
        super().interrupt()

    def generate_seeded(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seeds: list[int | None]
    ) -> list[Completion]:
        """``sampling.samples_per_prompt`` completions per prompt, grouped by prompt in order, prompt
        ``i`` sampled with seed ``seeds[i]`` (``None``: the server's random state); :meth:`generate`
        draws the seeds from one. :meth:`interrupt` cuts the call short (every call, even one that
        fails, consumes it).
        """
        with self._interrupt_of_call() as interrupt:
            self._call.interrupt = interrupt
            try:
                return super().generate_seeded(prompt_ids, sampling, seeds)
            finally:
                self._call.interrupt = None

    @property
    def concurrent_calls(self) -> int:
        """``generate`` calls from other threads served side by side (the server batches them continuously)."""
        return self.max_concurrent_requests

    def _new_interrupt(self) -> StreamInterrupt:
        return StreamInterrupt()  # set, it shuts down the sockets of the streams reading under it

    @property
    def connected(self) -> bool:
        """Whether the connect-time checks have run (and passed)."""
        return self.model_name is not None

    @property
    def request_model(self) -> str | None:
        """What requests name as their ``model``: the current adapter (``weight_sync.lora="adapter"``), else the
        model."""
        return self.adapter_name or self.model_name

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the server computes in, from its ``/server_info`` (``None``: not known)."""
        # /server_info spells it "torch.bfloat16"; anything unknown counts as reduced precision.
        dtype = getattr(torch, (self.server_dtype or "").removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _backend_stats(self) -> dict[str, float | None]:
        return {
            "vllm/connect_s": self.connect_time_s,
            "vllm/sync_write_s": self.last_write_time_s,
            "vllm/sync_reload_s": self.last_reload_time_s,
            "vllm/sync_bytes": self.last_sync_bytes,
        }

    def _prepare_generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> None:
        top = max(max(p) for p in prompts)
        if self._vocab_size is not None and top >= self._vocab_size:
            raise ValueError(
                f"RemoteVLLMEngine.generate: token id {top} is outside the model's vocabulary ({self._vocab_size} "
                "tokens); not sent: a vLLM server without a tokenizer does not check ids, and such a prompt kills it."
            )
        self.connect()
        self._check_length(
            max(len(p) for p in prompts),
            sampling.max_new_tokens,
            "restart the server with a larger --max-model-len or generate fewer tokens",
        )

    def _sample(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int | None]
    ) -> tuple[list[list[RawSample]], int]:
        bodies, tags = self._completion_bodies(prompts, sampling, seeds)
        interrupt = self._call.interrupt
        n = sampling.samples_per_prompt
        with self._lock.shared():  # no weight sync while sampling: every token comes from the weights of `version`
            self._check_usable()
            version = self.version
            for body in bodies:  # named under the lock: a sync swaps the adapter (and unloads the old one)
                body["model"] = self.request_model
            samples = self._map(lambda body: self._stream_completion(body, n, interrupt), bodies)
            if tags is not None:
                self._attach_kept_sets(samples, tags, self._take_kept_sets(tags))
        return samples, version

    def _engine_vocab_size(self) -> int | None:
        return self._vocab_size  # known once a module was pushed

    def _prepare_sync(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool) -> None:
        if self.lora_sync == "adapter":
            self._check_adapter_source(source, is_module)
        if self.weights_dir is None and self.weight_transport == "file":
            raise RuntimeError(
                "RemoteVLLMEngine.update_weights needs weights_dir: a directory both this trainer and the server can "
                "read (shared storage across machines). Set RemoteVLLMEngine's weight_sync.weights_dir."
            )
        self.connect()
        if not self.dev_mode:
            raise RuntimeError(
                f"RemoteVLLMEngine.update_weights: the server at {self.base_url} is not in dev mode, so it cannot "
                f"reload weights: {DEV_MODE_HINT}."
            )
        if self.lora_sync == "adapter":
            self._check_adapter_server(source)

    def _push(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool, version: int) -> None:
        self._vocab_size = _vocab_size(source) or self._vocab_size
        if self.lora_sync == "adapter":
            self._sync_adapter(source, version)
        else:
            self._sync(source)

    def close(self) -> None:
        """Stop using the server: wake a request in flight, remove the sync files. The server keeps running.

        A ``generate`` running in another thread (a background rollout) raises ``RuntimeError``.
        With ``weight_sync.lora="adapter"`` the adapter in use is unloaded first (best effort, when no
        call is in flight). Idempotent.
        """
        if not self._closed and self.adapter_name is not None and self._lock.acquire(blocking=False):
            try:
                self._close_adapter()
            finally:
                self._lock.release()
        self._closed = True
        self._http.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        acquired = self._lock.acquire(timeout=self.request_timeout_s)  # a sync in flight is woken above
        try:
            if self._sync_dir is not None:
                shutil.rmtree(self._sync_dir, ignore_errors=True)
                self._sync_dir = None
            if self._transfer is not None:
                self._transfer.close()
        finally:
            if acquired:
                self._lock.release()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.connected else "not connected")
        return (
            f"RemoteVLLMEngine(base_url={self.base_url!r}, model={self.model_name or self.model!r}, "
            f"lora_sync={self.lora_sync!r}, {state})"
        )


def _vocab_size(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> int | None:
    """Rows of the input embedding of a causal LM or its state dict (``None`` when not found)."""
    if isinstance(source, torch.nn.Module):
        with contextlib.suppress(AttributeError, NotImplementedError):
            return int(source.get_input_embeddings().num_embeddings)
        return None
    for name, tensor in source.items():
        if name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")) and tensor.dim() == 2:
            return int(tensor.shape[0])
    return None
