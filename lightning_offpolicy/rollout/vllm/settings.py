"""The vLLM engines' settings in groups: how an engine starts, how the weights reach it, how a client talks.

:class:`StartSettings` is what :class:`~lightning_offpolicy.rollout.VLLMEngine` and
:func:`~lightning_offpolicy.rollout.vllm.server.launch_local_server` pass to vLLM at its start;
:class:`WeightSyncSettings` (in-process engine) and :class:`RemoteWeightSyncSettings` (server) say
how a weight sync travels and how it is checked; :class:`ConnectionSettings` is how
:class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine` talks to its server. Each
checks what it can on its own when built; what depends on the engine (the server's host, the
machine's GPUs) is checked by the engine. The weight-sync flow: docs/architecture.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_offpolicy.argcheck import is_int, is_number
from lightning_offpolicy.rollout.vllm.http import CONNECT_TIMEOUT_S
from lightning_offpolicy.rollout.vllm.sync.transfer import GPU_TRANSPORTS

__all__ = [
    "ALLOWED_DTYPES",
    "ConnectionSettings",
    "RemoteWeightSyncSettings",
    "StartSettings",
    "WeightSyncSettings",
    "require_settings",
]

#: vLLM's ``dtype`` values.
ALLOWED_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LORA_SYNC_MODES = ("merged", "adapter")
#: How the weights reach an in-process engine, and a server (files, or vLLM's GPU-to-GPU weight transfer).
IN_PROCESS_TRANSPORTS = ("memory", "file")
REMOTE_TRANSPORTS = ("file", *GPU_TRANSPORTS)


def require_settings(value: Any, settings_type: type, where: str) -> Any:
    """``value`` when it is a ``settings_type``; else a ``TypeError`` naming ``where`` (``"VLLMEngine.start"``)."""
    if not isinstance(value, settings_type):
        raise TypeError(
            f"{where} must be a {settings_type.__name__} (from lightning_offpolicy.rollout.vllm.settings), got "
            f"{type(value).__name__}: build one, e.g. {where.rsplit('.', 1)[-1]}={settings_type.__name__}(...) "
            "(in YAML: the fields as a mapping under the key)."
        )
    return value


def _check_sync_check(who: str, check: Any, tolerance: Any, lora: Any) -> None:
    if not isinstance(check, bool):
        raise ValueError(f"{who}.check={check!r} must be True or False.")
    if tolerance is not None and not (is_number(tolerance) and tolerance > 0):
        raise ValueError(f"{who}.tolerance={tolerance!r} must be > 0 (nats) or None.")
    if lora not in LORA_SYNC_MODES:
        raise ValueError(f"{who}.lora={lora!r} is not known; allowed: {', '.join(map(repr, LORA_SYNC_MODES))}.")


@dataclass(frozen=True)
class StartSettings:
    """What vLLM starts with: precision, context, memory and seed (vLLM's engine arguments of the same names).

    Args:
        dtype: Precision of the engine's weights and activations (vLLM's ``dtype``). ``"auto"``, for
            ``VLLMEngine``: the trainer's, i.e. the dtype of the module passed to the first
            ``update_weights`` (the one that starts the engine; the callback's way), so the engine
            samples the policy being trained; vLLM's own rule when the engine starts without a module
            (``generate`` first, or a state dict) and for a server, which downcasts a float32 checkpoint to
            bfloat16. ``"float32"`` / ``"bfloat16"`` / ``"float16"`` force one: a bfloat16 engine
            against a float32 trainer is faster but samples a different policy: give it a correction
            (docs/troubleshooting.md, "Training looks wrong").
        max_model_len: Longest prompt + completion in tokens. ``None``: the model's own context length
            as vLLM derives it from the checkpoint's config (``max_position_embeddings``), read back
            into the engine's ``max_model_len`` once it has started. A smaller value (the longest
            prompt + ``max_new_tokens``) saves KV-cache memory on long-context models.
        gpu_memory_utilization: Fraction of GPU memory vLLM may use; on CPU, the fraction of host
            memory it reserves (keep it low on CPU: start-up fails when that much is not free).
        kv_cache_space_gib: CPU only: GiB of KV cache (sets ``VLLM_CPU_KVCACHE_SPACE``); ``None``
            leaves the sizing to vLLM. Ignored on GPU (``gpu_memory_utilization`` decides there).
        seed: Seed of the engine's global random state (samples drawn without a per-call seed).

    Raises:
        ValueError: A setting is out of range; the message names it.
    """

    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.3
    kv_cache_space_gib: int | None = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(
                f"StartSettings.dtype={self.dtype!r} is not known; allowed: {', '.join(map(repr, ALLOWED_DTYPES))}."
            )
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(
                f"StartSettings.max_model_len={self.max_model_len!r} must be an int >= 2 or None (the model's own "
                "context)."
            )
        if not is_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"StartSettings.gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1] (on CPU: "
                "the fraction of host memory vLLM reserves)."
            )
        if self.kv_cache_space_gib is not None and (not is_int(self.kv_cache_space_gib) or self.kv_cache_space_gib < 1):
            raise ValueError(
                f"StartSettings.kv_cache_space_gib={self.kv_cache_space_gib!r} must be an int >= 1 (GiB) or None "
                "(vLLM sizes it)."
            )
        if not is_int(self.seed):
            raise ValueError(f"StartSettings.seed={self.seed!r} must be an int.")


@dataclass(frozen=True)
class WeightSyncSettings:
    """How ``VLLMEngine``'s weight syncs travel and are checked (docs/scaling.md, "Weight sync").

    Args:
        transport: How the trainer's weights reach the engine. ``"memory"``: cast to the engine's
            dtype, in buckets through one shared-memory file, each loaded in place by every worker
            with vLLM's layerwise reload (no disk; one bucket held); needs an unquantized engine.
            ``"file"``: written as safetensors and reloaded in place from them (the reference path).
            Both go through the kit's ``worker_extension_cls``, which also processes a tied output
            layer again and reports any parameter that received nothing.
        check: After each ``update_weights`` from a module, check that the engine's logprobs of a
            fixed probe sequence match the module's; raise ``RuntimeError`` if not.
        tolerance: Absolute part (nats) of the per-token |logprob difference| the check accepts.
            ``None``: ``1e-3`` when the engine and the trainer are both float32, else ``1.0``, plus a
            relative part under reduced precision (``sync.check.SyncTolerance``).
        bucket_mb: Size of one in-memory bucket (MiB, in the engine's dtype); the buffer grows to
            hold a decoder layer, or the embedding and output layer together, when one is larger.
        lora: How a peft LoRA model's weights reach the engine. ``"merged"``: at every sync the base
            weights with the active adapters folded in (out of place), reloaded like a full model
            (plain LoRA on any target module). ``"adapter"``: vLLM applies the adapter itself
            (``enable_lora=True``, ``max_loras=1``, ``max_lora_rank`` from the first adapter); the
            base is pushed once, then only the adapter, as a new ``LoRARequest`` per sync: less to
            move, but the base must stay frozen and the adapter be one vLLM supports (no DoRA, no LoRA
            bias). Ignored for a model without adapters; the self-check runs in both modes.

    Raises:
        ValueError: A setting is out of range; the message names it.
    """

    transport: Literal["memory", "file"] = "memory"
    check: bool = True
    tolerance: float | None = None
    bucket_mb: int = 512
    lora: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        if self.transport not in IN_PROCESS_TRANSPORTS:
            raise ValueError(
                f"WeightSyncSettings.transport={self.transport!r} is not known; allowed: "
                f"{', '.join(map(repr, IN_PROCESS_TRANSPORTS))}."
            )
        _check_sync_check("WeightSyncSettings", self.check, self.tolerance, self.lora)
        if not is_int(self.bucket_mb) or self.bucket_mb < 1:
            raise ValueError(f"WeightSyncSettings.bucket_mb={self.bucket_mb!r} must be an int >= 1 (MiB).")


@dataclass(frozen=True)
class RemoteWeightSyncSettings:
    """How ``RemoteVLLMEngine``'s weight syncs reach the server and are checked (docs/remote_vllm.md).

    Args:
        transport: How a full-weight sync reaches the server. ``"file"``: safetensors in
            ``weights_dir``, reloaded by the server (any machine, CPU included). ``"nccl"``: vLLM's
            weight-transfer engine broadcasts the weights from the trainer's GPU to the server's
            workers over NCCL; ``"ipc"``: the server's workers read them from the trainer's GPU
            through CUDA IPC (the same machine). Both need CUDA and vLLM on the trainer's side and a
            server started with ``--weight-transfer-config '{"backend": "nccl"}'`` (or ``"ipc"``), no
            ``weights_dir``, and full weights (not ``lora="adapter"``). The self-check runs after
            every transport.
        weights_dir: Directory that BOTH this trainer and the server can read and write at the same
            path (shared storage such as NFS when they run on different machines; see
            ``server_weights_dir`` when the server mounts it elsewhere). Each sync writes the
            trainer's weights as safetensors into a private subdirectory (``0700``, files ``0600``;
            removed by the engine's ``close``) and asks the server to reload from there. Whoever can
            write there controls the policy the server samples (docs/remote_vllm.md, "Trust model").
            ``None``: no file syncs (``update_weights`` raises under ``transport="file"``).
        server_weights_dir: The path under which the server sees ``weights_dir`` (``None``: the same path).
        check: After each ``update_weights`` from a module, check that the server's logprobs of a
            fixed probe sequence match the module's; raise ``RuntimeError`` if not.
        tolerance: Absolute part (nats) of the per-token |logprob difference| the check accepts.
            ``None``: ``1e-3`` when the server and the trainer's module are both float32, else
            ``1.0``. With a reduced-precision server or trainer a relative part is added,
            ``16 * eps * |trainer logprob|`` (bfloat16: 0.125 |lp|), since the difference grows with
            the logits (``sync.check.SyncTolerance``); a sync that did not arrive is also caught by
            the "server unchanged while the trainer moved" test.
        lora: How a peft LoRA model's weights reach the server. ``"merged"``: at every sync the base
            weights with the active adapter folded in (computed out of place), reloaded like a full
            model; any server. ``"adapter"``: the server applies the adapter itself: the base weights
            are pushed once (see ``push_lora_base``), then each sync writes only the adapter (into its
            own private directory in the sync directory) and loads it under a new name
            (``policy-v{version}-...``), which requests then use as their ``model``; the previous
            adapter is unloaded and its files removed. Needs a server started with ``--enable-lora
            --max-lora-rank R`` (R >= the adapter's rank) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
            (``launch_local_server(enable_lora=True)``), a frozen base, and an adapter vLLM applies
            (plain LoRA: no DoRA, ``lora_bias`` or ``modules_to_save``); checked at the first sync.
            The self-check runs against the adapter in both modes.
        push_lora_base: With ``lora="adapter"``: whether the first sync pushes the peft model's base
            weights (a full-weight reload). ``False``: the server was started from the trainer's base
            checkpoint, so that push is skipped; the self-check of each sync still compares the
            server's adapter with the trainer's peft model, so a server with another base fails it
            (beyond the tolerance).
        share_with_group: Make the sync directory and files readable (never writable) by the group of
            ``weights_dir`` (``0750`` / ``0640``) for a server running as another user of that group.
            ``False``: owner only (``0700`` / ``0600``), whatever the umask.
        master_address: ``transport="nccl"``: an address of the trainer's machine the server's
            workers can reach (the NCCL rendezvous); ``None``: ``127.0.0.1`` for a server on
            loopback, else required.
        master_port: ``transport="nccl"``: the rendezvous port; ``None``: a free one.

    Raises:
        ValueError: A setting is out of range, or ``weights_dir`` names a file; the message names it.
    """

    transport: Literal["file", "nccl", "ipc"] = "file"
    weights_dir: str | None = None
    server_weights_dir: str | None = None
    check: bool = True
    tolerance: float | None = None
    lora: Literal["merged", "adapter"] = "merged"
    push_lora_base: bool = True
    share_with_group: bool = False
    master_address: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        who = "RemoteWeightSyncSettings"
        if self.transport not in REMOTE_TRANSPORTS:
            raise ValueError(
                f"{who}.transport={self.transport!r} is not known; allowed: {', '.join(map(repr, REMOTE_TRANSPORTS))}."
            )
        for name in ("weights_dir", "server_weights_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ValueError(f"{who}.{name}={value!r} must be a directory path (str) or None.")
            if value is not None:
                object.__setattr__(self, name, str(value))  # a Path given in Python: kept as the str YAML gives
        if self.weights_dir is not None and Path(self.weights_dir).exists() and not Path(self.weights_dir).is_dir():
            raise ValueError(
                f"{who}.weights_dir={self.weights_dir!r} exists and is not a directory: give a directory that both "
                "the trainer and the server can read (it is created if missing)."
            )
        if self.server_weights_dir is not None and self.weights_dir is None:
            raise ValueError(f"{who}.server_weights_dir is set but weights_dir is not: set weights_dir too.")
        _check_sync_check(who, self.check, self.tolerance, self.lora)
        for name in ("push_lora_base", "share_with_group"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{who}.{name}={getattr(self, name)!r} must be True or False.")
        if self.master_address is not None and (not isinstance(self.master_address, str) or not self.master_address):
            raise ValueError(f"{who}.master_address={self.master_address!r} must be a host name or address, or None.")
        if self.master_port is not None and (not is_int(self.master_port) or not 0 < self.master_port < 65536):
            raise ValueError(f"{who}.master_port={self.master_port!r} must be a port number (1..65535) or None.")


@dataclass(frozen=True)
class ConnectionSettings:
    """How ``RemoteVLLMEngine`` talks to its server: the key, the connect wait, concurrency and streaming.

    Args:
        api_key: The server's ``--api-key`` (sent as ``Authorization: Bearer``); ``None``: the
            environment variable ``VLLM_API_KEY`` if set. vLLM checks it on ``/v1`` routes only: its
            dev-mode endpoints are unauthenticated, keep the server on a private network. A key sent
            over ``http://`` to a host other than loopback gets a warning. Left out of ``repr``.
        connect_timeout_s: Longest wait for a TCP connection (and TLS handshake) to the server, and
            for its answers to the connect-time checks (``/v1/models``, ``/server_info``), which a
            working server gives at once: a server that accepts the connection but does not answer is
            reported after this, not after the engine's ``request_timeout_s`` (at most that).
        max_concurrent_requests: Requests in flight at once from this client (one request per prompt,
            carrying its ``samples_per_prompt`` samples); the server batches them.
        stream: Whether generation requests stream their tokens, which lets an ``interrupt`` keep the
            tokens sampled so far (streaming costs the server a little per request:
            docs/remote_vllm.md, "What the engine guarantees"). ``None``: from the first ``interrupt``
            on (the call it cuts short, if sent before, keeps no tokens of its unfinished
            completions); ``True``: always (set it for partial rollouts to keep the first interrupted
            call's tokens too); ``False``: never (an interrupted completion always comes back with no
            tokens).
        stream_interval: Tokens the server sends per streamed chunk of a completion (its first and
            last chunks go at once). 1: every token as it is sampled, so an ``interrupt`` keeps them
            all, at a measurable cost to the server (one JSON event per token and sample); larger:
            cheaper streaming, and an interrupt drops up to ``stream_interval - 1`` tokens per
            unfinished completion (sampled again when it is continued). A server started with a
            larger ``--stream-interval`` uses its own.

    Raises:
        ValueError: A setting is out of range; the message names it.
    """

    api_key: str | None = field(default=None, repr=False)
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    max_concurrent_requests: int = 32
    stream: bool | None = None
    stream_interval: int = 8

    def __post_init__(self) -> None:
        who = "ConnectionSettings"
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"{who}.api_key must be a non-empty str or None.")
        if not (is_number(self.connect_timeout_s) and self.connect_timeout_s > 0):
            raise ValueError(
                f"{who}.connect_timeout_s={self.connect_timeout_s!r} must be > 0 (seconds to connect and get the "
                "server's first answers)."
            )
        if not is_int(self.max_concurrent_requests) or self.max_concurrent_requests < 1:
            raise ValueError(f"{who}.max_concurrent_requests={self.max_concurrent_requests!r} must be an int >= 1.")
        if self.stream is not None and not isinstance(self.stream, bool):
            raise ValueError(
                f"{who}.stream={self.stream!r} must be True (always stream), False (never) or None (from the first "
                "interrupt() on)."
            )
        if not is_int(self.stream_interval) or self.stream_interval < 1:
            raise ValueError(
                f"{who}.stream_interval={self.stream_interval!r} must be an int >= 1 (tokens per streamed chunk)."
            )
