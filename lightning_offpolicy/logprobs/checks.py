"""Argument checks shared by the logprob functions: temperature, chunk size and target ids."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_offpolicy.argcheck import is_int, is_real

__all__ = ["check_targets", "check_temperature_and_chunk"]


def check_temperature_and_chunk(temperature: Any, chunk_size: Any) -> float:
    """``temperature`` as a float after checking it and ``chunk_size``.

    Raises:
        TypeError: ``temperature`` is not a real number or ``chunk_size`` not an int.
        ValueError: ``temperature`` is not finite and > 0, or ``chunk_size`` is not > 0.
    """
    if not is_real(temperature):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}.")
    temperature = float(temperature)
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")
    if not is_int(chunk_size):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}.")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}.")
    return temperature


def check_targets(targets: Any, shape: tuple[int, ...], device: torch.device, vocab: int, source: str) -> Tensor:
    """``targets`` as a long tensor after checking its type, shape, device and range.

    Args:
        targets: the caller's token ids: one per row (``shape``) or ``K`` per row (``shape + (K,)``).
        shape: the shape of one id per row (``source``'s without its last dimension).
        device: the device they must be on.
        vocab: ids must lie in ``[0, vocab)``.
        source: name of the tensor they go with (``"logits"``, ``"hidden"``), for the messages.

    Raises:
        TypeError: ``targets`` is not an integer tensor.
        ValueError: its shape, device or range does not fit.
    """
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError("targets must be an integer torch.Tensor of token ids.")
    if targets.dtype == torch.bool:
        raise TypeError("targets must be an integer torch.Tensor of token ids, got bool.")
    if tuple(targets.shape) != shape and tuple(targets.shape[:-1]) != shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal {source} shape without its last dimension {shape} "
            f"(one id per row), or that shape plus a last dimension (K ids per row)."
        )
    if targets.device != device:
        raise ValueError(f"targets are on {targets.device} but {source} on {device}.")
    targets = targets.long()
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"targets must lie in [0, {vocab}) (the vocabulary), got values in [{lo}, {hi}]")
    return targets
