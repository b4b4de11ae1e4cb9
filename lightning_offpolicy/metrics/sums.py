"""The functional twins of the metrics: the float64 sums one update with a batch's
:class:`~lightning_offpolicy.correction.CorrectionStats` adds (docs/metrics.md)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_offpolicy.correction.correction import CorrectionStats
from lightning_offpolicy.correction.ratios import safe_exp

F64 = torch.float64
Level = Literal["token", "sequence"]


def check_level(name: str, level: str) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"{name}: level={level!r} is not known; allowed: 'token', 'sequence'.")


def _cached(stats: CorrectionStats, key: str, make: Any) -> torch.Tensor:
    """Compute a derived tensor once per ``stats`` object, shared by every metric of a bundle."""
    cache = stats.__dict__.setdefault("_metric_cache", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _sum64(values: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 sum, optionally over ``where`` only (``torch.where``: no boolean gather, no sync)."""
    if where is not None:
        values = torch.where(where, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return values.sum(dtype=F64)


def _token_count(stats: CorrectionStats) -> torch.Tensor:
    return _cached(stats, "token_count", lambda: stats.response_mask.sum(dtype=F64))


def _token_rho(stats: CorrectionStats) -> torch.Tensor:
    """``rho_t`` on every position (``log_rho`` is 0 at padding, so ``rho`` is 1 there)."""
    return _cached(stats, "rho", lambda: safe_exp(stats.log_rho))


def _sequence_log_values(stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``S_i`` (0 for sequences without a response token) and the number of valid sequences."""
    return stats.seq_log_rho, _cached(stats, "seq_count", lambda: stats.seq_valid.sum(dtype=F64))


# --------------------------------------------------------------------------------------------
# Functional twins: the sums one update adds.
# --------------------------------------------------------------------------------------------
def mismatch_kl_sums(stats: CorrectionStats, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` over response tokens of ``-log rho`` (k1) or ``rho - 1 - log rho`` (k3)."""
    # Both terms are exactly 0 at padding (log_rho = 0, rho = 1): no mask needed.
    if estimator == "k1":
        return -_sum64(stats.log_rho), _token_count(stats)
    return _sum64(_token_rho(stats) - 1.0 - stats.log_rho), _token_count(stats)


def log_ppl_sums(stats: CorrectionStats, exponentiate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i d_i, count)`` with ``d_i = -S_i / n_i`` (or ``exp(d_i)`` for the PPL ratio)."""
    seq_sum, count = _sequence_log_values(stats)
    diff = -seq_sum.to(F64) / stats.seq_tokens.to(F64).clamp(min=1.0)
    return _sum64(safe_exp(diff) if exponentiate else diff, stats.seq_valid), count


def chi2_sums(stats: CorrectionStats, level: Level = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum rho^2, count)`` over response tokens or over sequences (``rho = exp(S_i)``)."""
    if level == "token":
        return _sum64(_token_rho(stats).square(), stats.response_mask), _token_count(stats)
    seq_sum, count = _sequence_log_values(stats)
    return _sum64(safe_exp(seq_sum.to(F64)).square(), stats.seq_valid), count


def ess_sums(stats: CorrectionStats, level: Level = "token") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum rho, sum rho^2, count)`` over response tokens or over sequences."""
    if level == "token":
        rho, where, count = _token_rho(stats), stats.response_mask, _token_count(stats)
    else:
        seq_sum, count = _sequence_log_values(stats)
        rho, where = safe_exp(seq_sum.to(F64)), stats.seq_valid
    return _sum64(rho, where), _sum64(rho.square(), where), count


def rejection_sums(
    stats: CorrectionStats, mask: str = "total", level: Level = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rejected, count)`` of response tokens or valid sequences removed by ``mask``."""
    response = stats.response_mask
    if mask == "total":
        rejected_tokens = response & ~stats.kept
    else:
        rejected_tokens = stats.token_rejected.get(mask, torch.zeros_like(response))
    if level == "token":
        return rejected_tokens.sum(dtype=F64), _token_count(stats)
    valid = stats.seq_valid
    return (valid & rejected_tokens.any(dim=-1)).sum(dtype=F64), valid.sum(dtype=F64)


def weight_sums(stats: CorrectionStats, clipped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the applied IS weights, kept tokens)``, or ``(truncated kept tokens, kept tokens)``."""
    kept_count = stats.kept.sum(dtype=F64)
    if clipped:
        return (stats.weight_clipped & stats.kept).sum(dtype=F64), kept_count
    return _sum64(stats.weights, stats.kept), kept_count


def abs_logprob_diff_sums(stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum |log rho_t|, count)`` over response tokens."""
    return _sum64(stats.log_rho.abs()), _token_count(stats)


def extreme_value(values: torch.Tensor, where: torch.Tensor, reduce: Literal["max", "min"]) -> torch.Tensor:
    """float64 ``max`` / ``min`` of ``values`` where ``where`` is set (-inf / +inf when none is)."""
    fill = torch.tensor(float("-inf") if reduce == "max" else float("inf"), dtype=values.dtype, device=values.device)
    if not values.numel():
        return fill.to(F64)
    chosen = torch.where(where, values, fill)
    return (chosen.amax() if reduce == "max" else chosen.amin()).to(F64)
