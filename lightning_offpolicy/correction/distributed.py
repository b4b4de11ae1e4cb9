"""Exact cross-rank sums with plain ``torch.distributed`` (no Lightning), for batch statistics."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether a default process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks (itself when not distributed).

    A collective: every rank must call it, in the same order, with the same shape.
    """
    if not is_distributed():
        return tensor
    reduced = tensor.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced
