"""Sequence-level advantage estimators for outcome rewards (pure torch, vectorised over groups).

Each estimator (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce``; :func:`compute_advantages` by name)
maps one reward per sequence ``[B]`` to one detached float32 advantage per sequence ``[B]``; a group
is the samples of one prompt (one ``group_id``). Invalid rows get 0 and, by default, stay out of the
baseline; degenerate groups (fewer than two baseline members, equal rewards) give exactly 0, never
NaN. Formulas, references, invalid rows, distributed use and numerics: docs/training.md, "Advantage
estimators".

>>> import torch
>>> r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5]); g = torch.tensor([7, 7, 3, 3, 7, 5])
>>> dr_grpo_advantages(r, g)
tensor([ 0.5000, -0.5000,  0.0000,  0.0000,  0.0000,  0.0000])
>>> rloo_advantages(r, g, valid=torch.tensor([True, True, True, True, False, True]))
tensor([ 1., -1.,  0.,  0.,  0.,  0.])
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from lightning_offpolicy.argcheck import is_number

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "compute_advantages",
    "dr_grpo_advantages",
    "grpo_advantages",
    "reinforce_baseline_advantages",
    "rloo_advantages",
]

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce")


# --------------------------------------------------------------------------------------------
# Validation and group statistics.
# --------------------------------------------------------------------------------------------
def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _check_flag(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{fn}: {name} must be a bool; got {value!r}.")


def _check_rewards_valid(fn: str, rewards: Any, valid: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``rewards`` ``[B]`` float and ``valid`` ``[B]`` bool; return ``valid`` (all True if None)."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"{fn}: rewards must be a torch.Tensor of shape [B]; got {type(rewards).__name__}.")
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: rewards must be 1-D [B] (one reward per sequence); got shape {tuple(rewards.shape)}.")
    if not rewards.is_floating_point():
        raise ValueError(f"{fn}: rewards must have a floating dtype; got {rewards.dtype}.")
    if valid is None:
        return rewards.detach(), torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    if not isinstance(valid, torch.Tensor):
        raise ValueError(f"{fn}: valid must be a bool torch.Tensor of shape [B] or None; got {type(valid).__name__}.")
    if valid.dtype != torch.bool:
        raise ValueError(f"{fn}: valid must have dtype torch.bool; got {valid.dtype}.")
    if valid.shape != rewards.shape:
        raise ValueError(f"{fn}: valid shape {tuple(valid.shape)} != rewards shape {tuple(rewards.shape)}.")
    if valid.device != rewards.device:
        raise ValueError(f"{fn}: valid is on {valid.device} but rewards on {rewards.device}.")
    return rewards.detach(), valid


def _check_group_ids(fn: str, group_ids: Any, rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(group_ids, torch.Tensor):
        raise ValueError(
            f"{fn}: group_ids must be an integer torch.Tensor of shape [B]; got {type(group_ids).__name__}."
        )
    if group_ids.dtype == torch.bool or group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"{fn}: group_ids must have an integer dtype (torch.long); got {group_ids.dtype}.")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"{fn}: group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}.")
    if group_ids.device != rewards.device:
        raise ValueError(f"{fn}: group_ids is on {group_ids.device} but rewards on {rewards.device}.")
    return group_ids


def _check_finite(fn: str, rewards: torch.Tensor, member: torch.Tensor, exclude: bool) -> None:
    bad = member & ~torch.isfinite(rewards)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten()[:8].tolist()
        which = "valid rows" if exclude else "rows (exclude_invalid_from_baseline=False: every row)"
        raise ValueError(
            f"{fn}: rewards holds NaN/inf on {int(bad.sum())} {which} that enter the baseline, "
            f"e.g. rows {rows}; mark them invalid or fix the reward function."
        )


def _baseline_members(valid: torch.Tensor, exclude: bool) -> torch.Tensor:
    return valid if exclude else torch.ones_like(valid)


def _group_centered(
    rewards: torch.Tensor, member: torch.Tensor, inverse: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: ``r - mean_g`` and the group's ``n``, sum of squared deviations and degeneracy.

    ``member`` selects the baseline rows; non-members never enter a sum (``torch.where``, so a NaN
    reward on a non-member cannot leak). Returns float tensors of the work dtype, gathered per row
    ``[B]``: ``centered``, ``count``, ``ssd`` and bool ``degenerate`` (``n < 2`` or all baseline
    rewards of the group equal).
    """
    dtype = _work_dtype(rewards.device)
    r = rewards.to(dtype)
    zeros = torch.zeros(num_groups, dtype=dtype, device=r.device)
    r_in = torch.where(member, r, torch.zeros_like(r))
    count = zeros.index_add(0, inverse, member.to(dtype))
    total = zeros.index_add(0, inverse, r_in)
    mean = total / count.clamp_min(1.0)
    centered = r - mean[inverse]
    ssd = zeros.index_add(0, inverse, torch.where(member, centered * centered, torch.zeros_like(r)))
    # Exact test for constant groups (rounding in the mean would otherwise leave ~1e-17 / eps).
    big = torch.full((num_groups,), math.inf, dtype=dtype, device=r.device)
    gmax = (-big).scatter_reduce(0, inverse, torch.where(member, r, -math.inf), "amax", include_self=True)
    gmin = big.scatter_reduce(0, inverse, torch.where(member, r, math.inf), "amin", include_self=True)
    degenerate = (count < 2) | (gmax <= gmin)
    return centered, count[inverse], ssd[inverse], degenerate[inverse]


def _grouped(
    fn: str, rewards: Any, group_ids: Any, valid: Any, exclude: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Validate a group estimator's inputs; ``(valid, centered, n, ssd, degenerate)`` per row, or
    ``None`` for an empty batch."""
    rewards, valid = _check_rewards_valid(fn, rewards, valid)
    group_ids = _check_group_ids(fn, group_ids, rewards)
    _check_flag(fn, "exclude_invalid_from_baseline", exclude)
    member = _baseline_members(valid, exclude)
    _check_finite(fn, rewards, member, exclude)
    if rewards.numel() == 0:
        return None
    inverse, num_groups = _compact_ids(group_ids)
    return (valid, *_group_centered(rewards, member, inverse, num_groups))


def _compact_ids(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse.reshape(-1), int(uniq.numel())


def _finish(adv: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    # Saturating cast: a difference of two rewards near the float32 limit stays finite.
    big = torch.finfo(torch.float32).max
    return torch.where(keep, adv, torch.zeros_like(adv)).clamp(-big, big).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Estimators.
# --------------------------------------------------------------------------------------------
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    exclude_invalid_from_baseline: bool = True,
    unbiased_std: bool = False,
) -> torch.Tensor:
    """GRPO group-normalised advantages ``(r_i - mean_g) / (std_g + eps)``.

    Args:
        rewards: ``[B]`` float, one reward per sequence.
        group_ids: ``[B]`` integer (long), equal for the samples of one prompt; any values, any
            order.
        valid: optional ``[B]`` bool; ``False`` rows (rejected, padding) get advantage 0.
        scale_by_std: divide by ``std_g + eps``; ``False`` gives Dr. GRPO's ``r_i - mean_g``.
        eps: added to the std (>= 0).
        exclude_invalid_from_baseline: ``True``: invalid rows are left out of ``mean_g`` /
            ``std_g``; ``False``: they count in them (and must hold finite rewards).
        unbiased_std: Bessel-corrected std (``n - 1``); default is the population std (``n``).

    Returns:
        ``[B]`` float32, detached. 0 on invalid rows and in degenerate groups (fewer than two
        baseline members, or constant baseline rewards).

    Raises:
        ValueError: wrong shape / dtype / device, negative or non-finite ``eps``, non-finite
            ``rewards`` on a baseline row.
    """
    fn = "grpo_advantages"
    _check_flag(fn, "scale_by_std", scale_by_std)
    _check_flag(fn, "unbiased_std", unbiased_std)
    if not is_number(eps) or eps < 0:
        raise ValueError(f"{fn}: eps must be a finite number >= 0; got {eps!r}.")
    grouped = _grouped(fn, rewards, group_ids, valid, exclude_invalid_from_baseline)
    if grouped is None:
        return torch.zeros(0, dtype=torch.float32, device=torch.as_tensor(rewards).device)
    valid, centered, count, ssd, degenerate = grouped
    adv = centered
    if scale_by_std:
        dof = (count - 1.0) if unbiased_std else count
        std = torch.sqrt(ssd / dof.clamp_min(1.0))
        denom = std + eps
        # Non-degenerate groups have std > 0, so denom > 0 even with eps = 0.
        adv = centered / torch.where(degenerate | (denom <= 0), torch.ones_like(denom), denom)
    return _finish(adv, valid & ~degenerate)


def dr_grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    exclude_invalid_from_baseline: bool = True,
) -> torch.Tensor:
    """Dr. GRPO advantages ``r_i - mean_g``: :func:`grpo_advantages` with ``scale_by_std=False``."""
    return grpo_advantages(
        rewards,
        group_ids,
        valid,
        scale_by_std=False,
        exclude_invalid_from_baseline=exclude_invalid_from_baseline,
    )


def rloo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    exclude_invalid_from_baseline: bool = True,
) -> torch.Tensor:
    """RLOO advantages ``r_i - mean_{j in M_g, j != i} r_j`` (leave-one-out group baseline).

    Computed as ``n / (n - 1) * (r_i - mean_g)`` (identical, better conditioned). With
    ``exclude_invalid_from_baseline=True`` the "others" are the other *valid* members; with
    ``False`` every other row of the group. Returns ``[B]`` float32, detached; 0 on invalid rows
    and for groups with fewer than two baseline members or constant baseline rewards.
    """
    grouped = _grouped("rloo_advantages", rewards, group_ids, valid, exclude_invalid_from_baseline)
    if grouped is None:
        return torch.zeros(0, dtype=torch.float32, device=torch.as_tensor(rewards).device)
    valid, centered, count, _, degenerate = grouped
    factor = count / (count - 1.0).clamp_min(1.0)
    return _finish(factor * centered, valid & ~degenerate)


def reinforce_baseline_advantages(
    rewards: torch.Tensor,
    valid: torch.Tensor | None = None,
    exclude_invalid_from_baseline: bool = True,
) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline: ``r_i - mean(r)`` over the local batch.

    The mean runs over the valid rows (``exclude_invalid_from_baseline=True``) or over every row
    (``False``), on this rank only (no cross-rank reduction). Returns ``[B]`` float32, detached;
    0 on invalid rows, and everywhere when fewer than two rows enter the baseline or their
    rewards are all equal.
    """
    fn = "reinforce_baseline_advantages"
    rewards, valid = _check_rewards_valid(fn, rewards, valid)
    _check_flag(fn, "exclude_invalid_from_baseline", exclude_invalid_from_baseline)
    member = _baseline_members(valid, exclude_invalid_from_baseline)
    _check_finite(fn, rewards, member, exclude_invalid_from_baseline)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    inverse = torch.zeros(rewards.shape, dtype=torch.long, device=rewards.device)
    centered, _, _, degenerate = _group_centered(rewards, member, inverse, 1)
    return _finish(centered, valid & ~degenerate)


def compute_advantages(
    estimator: AdvantageEstimator,
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None,
    valid: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Dispatch to an estimator by name (one of :data:`ADVANTAGE_ESTIMATORS`).

    ``kwargs`` go to the estimator unchanged (``grpo``: ``scale_by_std``, ``eps``,
    ``unbiased_std``; all: ``exclude_invalid_from_baseline``); an argument the estimator does not
    take raises ``TypeError``. ``group_ids`` is required for the group estimators; ``reinforce``
    ignores it (checked for shape when given).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"compute_advantages: estimator={estimator!r} is not known; allowed: {', '.join(ADVANTAGE_ESTIMATORS)}."
        )
    if estimator == "reinforce":
        if group_ids is not None:
            _check_rewards_valid("compute_advantages", rewards, None)
            _check_group_ids("compute_advantages", group_ids, rewards)
        return reinforce_baseline_advantages(rewards, valid, **kwargs)
    if group_ids is None:
        raise ValueError(f"compute_advantages: estimator={estimator!r} needs group_ids ([B] long, one id per prompt).")
    if estimator == "grpo":
        return grpo_advantages(rewards, group_ids, valid, **kwargs)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards, group_ids, valid, **kwargs)
    return rloo_advantages(rewards, group_ids, valid, **kwargs)
