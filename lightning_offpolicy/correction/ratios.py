"""Log-space ratio primitives shared by the correction, the losses and the metrics.

Every ratio is formed in log space and exponentiated through :func:`safe_exp`, so log ratios of
+-1000 (a token the engine nearly never samples) give finite numbers. Padded positions (mask 0)
are replaced by 0 before any arithmetic, so NaN or inf there never reaches a result or a gradient.
A logprob of -inf at a response token (one policy calls the token impossible) is replaced by
``-INFINITE_LOG_RATIO`` (:func:`finite_logprobs`), so log ratios, sums, means and metrics stay
finite (NaN at a response token is refused, by :mod:`~lightning_offpolicy.correction.checks`).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
"""Log ratios are clamped to [-20, 20] before ``exp`` (``exp(20) ~ 4.9e8``)."""

INFINITE_LOG_RATIO = 1e6
"""The magnitude that stands for an infinite logprob (and so an infinite log ratio): beyond every
clamp and mask bound (even averaged over 10^4 tokens it exceeds ``LOG_RATIO_CLAMP``), yet finite,
and small enough that float32 sums over any realistic number of tokens stay finite."""


def safe_exp(log_ratio: torch.Tensor, clamp: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """``exp(clamp(x, -clamp, clamp))`` in at least float32."""
    if log_ratio.dtype in (torch.float16, torch.bfloat16):
        log_ratio = log_ratio.float()
    return torch.exp(torch.clamp(log_ratio, -clamp, clamp))


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is set, 0 elsewhere (NaN / inf at masked-out positions vanish)."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def log_ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``numerator - denominator`` over valid tokens, exactly 0 at padding.

    Both inputs are cleaned before the subtraction, so a NaN / inf in a padded position of either
    one cannot produce a NaN (not even a NaN gradient through ``torch.where``).
    """
    valid = mask.bool()
    dtype = torch.promote_types(numerator.dtype, denominator.dtype)
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    return masked(numerator.to(dtype), valid) - masked(denominator.to(dtype), valid)


def finite_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs`` with +-inf replaced by +-``INFINITE_LOG_RATIO`` (NaN, allowed only in padding, by 0).

    Applied by ``compute_correction`` / ``policy_loss`` only when a response token holds an
    infinity, so the common path pays nothing. A -inf logprob thus gives a log ratio of about
    +-1e6 (two -inf ones: 0), and no gradient flows through the replaced entries.
    """
    return torch.nan_to_num(logprobs, nan=0.0, posinf=INFINITE_LOG_RATIO, neginf=-INFINITE_LOG_RATIO)


def sequence_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence ``sum_t mask_t * values_t`` (``[B, T] -> [B]``)."""
    return masked(values, mask).sum(dim=-1)


def sequence_count(mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence number of valid tokens, in the float dtype of the statistics."""
    return mask.to(torch.float32).sum(dim=-1)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over valid tokens; 0 for a row with no valid token (never NaN)."""
    return sequence_sum(values, mask) / sequence_count(mask).clamp(min=1.0)


def sequence_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence max over valid tokens; ``-inf`` for a row with no valid token."""
    fill = torch.full((), float("-inf"), dtype=values.dtype, device=values.device)
    return torch.where(mask.bool(), values, fill).amax(dim=-1)


def truncate(ratio: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Clamp ``ratio`` to ``[low, high]`` where a bound is given."""
    return torch.clamp(ratio, min=low, max=high)
