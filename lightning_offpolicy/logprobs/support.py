"""Logprobs and entropy under a sampling mask: the distribution renormalized over the ids an engine kept.

An engine that samples with top-k / top-p draws from ``softmax(z / T)`` renormalized over the kept
set ``S``; :func:`over_support` turns the full-vocabulary logprobs of ``[sampled, *S]`` into the
logprob and entropy of that distribution (docs/off_policy_correction.md, "Sampling masks").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_support", "over_support"]


def check_support(support: Any, response_shape: tuple[int, int]) -> None:
    """``sampling_support`` must be a ``[B, T, K]`` integer tensor of ids >= -1 (the targets' check bounds V)."""
    if not isinstance(support, Tensor) or support.is_floating_point() or support.dtype == torch.bool:
        raise TypeError("sampling_support must be an integer torch.Tensor of token ids (-1: padding).")
    if support.dim() != 3 or tuple(support.shape[:2]) != response_shape:
        raise ValueError(
            f"sampling_support must have shape {response_shape} + (K,) (the response columns), "
            f"got {tuple(support.shape)}."
        )
    if support.numel() and int(support.min()) < -1:
        raise ValueError("sampling_support holds ids below -1; -1 is the only padding value.")


def over_support(
    result: Tensor | tuple[Tensor, Tensor], support: Tensor | None, return_entropy: bool, full_entropy: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """The sampled token's logprob (and entropy) under the distribution renormalized over ``support``.

    ``result`` holds the full-vocabulary logprobs of ``[sampled, *support]`` per position
    (``[B, T, 1 + K]``), and the full entropy when ``full_entropy``. Where a position kept a set,
    ``log p_S(t) = log p(t) - logsumexp_{v in S} log p(v)`` and ``H_S = -sum_{v in S} p_S(v) log p_S(v)``;
    where it kept everything (all -1), the full values. Built from ``where`` / ``masked_fill`` so that
    no ``-inf`` of a padding slot reaches a gradient as NaN.
    """
    if support is None:
        return result
    columns, entropy = result if full_entropy else (result, None)
    sampled = columns[..., 0]
    kept = support >= 0
    if kept.shape[-1] == 0:  # no position was cut
        if not return_entropy:
            return sampled
        return sampled, entropy if entropy is not None else torch.zeros_like(sampled)
    cut = kept.any(-1)
    candidates = columns[..., 1:].masked_fill(~kept, float("-inf"))
    # An uncut position sums one 0 (log 1): its kept mass is the whole distribution.
    first_slot = torch.zeros_like(kept)
    first_slot[..., 0] = True
    candidates = candidates.masked_fill(~cut.unsqueeze(-1) & first_slot, 0.0)
    log_mass = torch.logsumexp(candidates, dim=-1)
    logprobs = sampled - log_mass
    if not return_entropy:
        return logprobs
    log_p = torch.where(kept, candidates - log_mass.unsqueeze(-1), torch.zeros_like(candidates))
    truncated = -(torch.exp(log_p) * kept * log_p).sum(-1)
    if entropy is None:
        return logprobs, truncated
    return logprobs, torch.where(cut, truncated, entropy)
