"""Rejection masks: which tokens and which sequences leave the policy-gradient numerator.

Every comparison is made in log space (``log low <= log_rho <= log high``), so bounds far outside
the clamp range of :func:`~lightning_offpolicy.correction.ratios.safe_exp` stay exact.
All functions return boolean ``keep`` tensors; they only ever remove, never add, tokens.
"""

from __future__ import annotations

import math

import torch

from lightning_offpolicy.correction.kl import kl_of_log_ratio
from lightning_offpolicy.correction.ratios import (
    log_ratio,
    masked,
    sequence_count,
    sequence_max,
    sequence_mean,
    sequence_sum,
)
from lightning_offpolicy.correction.validation import RejectEstimator, RejectLevel


def within(log_values: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """``low <= exp(log_values) <= high``, decided in log space; a ``None`` bound is open."""
    keep = torch.ones_like(log_values, dtype=torch.bool)
    if low is not None:
        keep &= log_values >= math.log(low)
    if high is not None:
        keep &= log_values <= math.log(high)
    return keep


def token_ratio_mask(log_rho: torch.Tensor, valid: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """IcePop token mask: keep valid tokens with ``low <= rho_t <= high``."""
    return valid & within(log_rho, low, high)


def m2po_mask(log_rho: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's second-moment mask (AReaL's ``_apply_m2po_masking``): the valid tokens it keeps.

    Over every valid token of the batch, ``m2_t = log_rho_t^2`` is ranked from the largest down; the
    ``k`` largest are rejected, ``k`` the smallest count for which the mean ``m2`` of the remaining
    ``n - k`` tokens is below ``threshold``, or ``n - 1`` when no count gets there (one token stays).
    Equal values keep their row-major order (a stable sort), so the result is deterministic.

    Args:
        log_rho: ``[B, T]`` log ratios, 0 outside the response.
        valid: ``[B, T]`` bool response mask.
        threshold: The bound on the mean second moment of the kept tokens.

    Returns:
        ``[B, T]`` bool: the valid tokens kept. No host sync, so the fused step compiles it.
    """
    # float64: the suffix means decide the cut, and they sum up to every response token of the batch.
    m2 = torch.where(valid, log_rho.double().square(), torch.full((), -1.0, dtype=torch.float64, device=valid.device))
    flat = m2.reshape(-1)
    ranked, order = torch.sort(flat, descending=True, stable=True)  # padding (-1) sorts last
    count = valid.sum()
    # Sum and count of the tokens from rank r to the last valid one: the rest if the first r are rejected.
    suffix = torch.flip(torch.cumsum(torch.flip(ranked.clamp(min=0.0), [0]), 0), [0])
    rank = torch.arange(flat.numel(), device=flat.device)
    remaining = (count - rank).clamp(min=1)
    below = (rank < count) & (suffix / remaining < threshold)
    first = torch.where(below, rank, flat.numel()).min()
    rejected_count = torch.where(first < flat.numel(), first, (count - 1).clamp(min=0))
    rejected = torch.zeros_like(flat, dtype=torch.bool).scatter(0, order, rank < rejected_count)
    return valid & ~rejected.view_as(valid)


def geometric_mask(seq_log_rho: torch.Tensor, seq_tokens: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Keep sequences whose geometric-mean ratio ``exp(S_i / max(n_i, 1))`` is in ``[low, high]``."""
    return within(seq_log_rho / seq_tokens.clamp(min=1.0), low, high)


def product_mask(seq_log_rho: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Keep sequences whose product ratio ``exp(S_i)`` is in ``[low, high]``."""
    return within(seq_log_rho, low, high)


def outlier_veto_mask(log_rho: torch.Tensor, valid: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Keep a sequence unless one of its ``valid`` tokens has ``rho_t < low`` or ``rho_t > high``."""
    outlier = valid & ~within(log_rho, low, high)
    return ~outlier.any(dim=-1)


def kl_statistic(log_rho: torch.Tensor, estimator: RejectEstimator) -> torch.Tensor:
    """Per-token divergence of ``pi_rollout`` from ``pi_prox`` on rollout samples.

    ``k1 = -log_rho`` (compared in absolute value), ``k2 = log_rho^2 / 2``,
    ``k3 = rho - 1 - log_rho`` (non-negative).
    """
    # KL(pi_rollout || pi_prox) on rollout samples: d = log pi_rollout - log pi_prox = -log_rho.
    return kl_of_log_ratio(-log_rho, "abs" if estimator == "k1" else estimator)


def kl_reject_token_mask(
    log_rho: torch.Tensor, valid: torch.Tensor, estimator: RejectEstimator, threshold: float
) -> torch.Tensor:
    """Keep valid tokens whose statistic is at most ``threshold``."""
    return valid & (kl_statistic(log_rho, estimator) <= threshold)


def kl_reject_sequence_mask(
    log_rho: torch.Tensor,
    valid: torch.Tensor,
    estimator: RejectEstimator,
    level: RejectLevel,
    threshold: float,
) -> torch.Tensor:
    """Keep sequences whose ``seq_sum`` / ``seq_mean`` / ``seq_max`` statistic is at most ``threshold``."""
    stat = masked(kl_statistic(log_rho, estimator), valid)
    if level == "seq_sum":
        per_seq = sequence_sum(stat, valid)
    elif level == "seq_mean":
        per_seq = sequence_sum(stat, valid) / sequence_count(valid).clamp(min=1.0)
    elif level == "seq_max":
        per_seq = sequence_max(stat, valid).clamp(min=0.0)  # a row with no token: -inf -> 0, kept
    else:
        raise ValueError(f"kl_reject_level={level!r} is not a sequence level.")
    return per_seq <= threshold


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """OPSM (DeepSeek-V3.2's off-policy sequence masking): the response tokens the loss keeps.

    Token ``t`` of sequence ``i`` is dropped iff ``A_{i,t} < 0`` and
    ``KL_i = mean_{s in response}(log pi_reference(y_s) - log pi_theta(y_s)) > threshold``: a sequence
    the update is pushing down, sampled from a policy far from the current one. The mean runs over
    every response token, as slime's ``compute_opsm_mask`` and TRL's ``get_off_policy_mask`` take it,
    not over the survivors of the correction's masks.

    Args:
        logprobs: ``[B, T]`` ``pi_theta`` logprobs (read detached).
        reference_logprobs: ``[B, T]`` logprobs of the reference policy (``pi_rollout`` or ``pi_prox``).
        advantages: ``[B, T]`` advantages (per-sequence advantages broadcast over the tokens).
        valid: ``[B, T]`` bool response mask.
        threshold: The bound on ``KL_i`` (DeepSeek-V3.2's ``delta``).

    Returns:
        ``[B, T]`` bool: the valid tokens OPSM keeps.
    """
    kl = sequence_mean(log_ratio(reference_logprobs, logprobs.detach(), valid), valid)
    return valid & ~((advantages < 0) & (kl > threshold).unsqueeze(-1))
