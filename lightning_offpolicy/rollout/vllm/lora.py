"""vLLM's LoRA support as the in-process engine uses it: the adapter rank vLLM accepts, and a base
checkpoint written from a peft model for an engine that starts from the trainer's module."""

from __future__ import annotations

import typing
from pathlib import Path

import torch

from lightning_offpolicy.rollout.vllm.export import write_safetensors

__all__ = ["vllm_lora_rank", "write_base_checkpoint"]

#: LoRA ranks vLLM 0.32 accepts as ``max_lora_rank`` (used when the installed vLLM cannot be asked).
VLLM_LORA_RANKS_0_32 = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that fits an adapter of rank ``rank``."""
    try:
        from vllm.config.lora import MaxLoRARanks

        allowed = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    except Exception:  # noqa: BLE001 - another vLLM layout: the 0.32 list
        allowed = list(VLLM_LORA_RANKS_0_32)
    for candidate in allowed:
        if candidate >= rank:
            return candidate
    raise ValueError(
        f"VLLMEngine(lora_sync='adapter'): the adapter's rank {rank} exceeds the largest max_lora_rank vLLM "
        f"accepts ({allowed[-1]}); use lora_sync='merged'."
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
