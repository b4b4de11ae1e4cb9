"""The vocabulary of the correction and loss settings (their allowed values) and their eager checks.

Every check raises :class:`CorrectionConfigError` with a message that names the setting, the value
and what is allowed.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from lightning_offpolicy.argcheck import is_number

TISLevel = Literal["token", "sequence"]
Objective = Literal["ppo", "pure_is", "cispo", "reinforce"]
Anchor = Literal["rollout", "prox"]
KLEstimator = Literal["k1", "abs", "k2", "k3", "low_var_kl"]
RejectEstimator = Literal["k1", "k2", "k3"]
RejectLevel = Literal["token", "seq_sum", "seq_mean", "seq_max"]
LossType = Literal["ppo", "gspo", "sapo", "dppo_tv", "dppo_kl"]
DPPO_LOSS_TYPES: tuple[str, ...] = ("dppo_tv", "dppo_kl")
"""The ``loss_type`` values of DPPO's divergence trust region (:mod:`~lightning_offpolicy.correction.dppo`)."""
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class CorrectionConfigError(ValueError):
    """Raised for an invalid correction or loss setting; the message names the setting."""


def check_choice(owner: str, name: str, value: Any, literal: Any, *, optional: bool = False) -> None:
    allowed = get_args(literal)
    if value is None and optional:
        return
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed) + (", None" if optional else "")
        raise CorrectionConfigError(f"{owner}.{name}={value!r} is not a known choice; allowed: {shown}.")


def check_positive(owner: str, name: str, value: float | None, *, optional: bool = False) -> None:
    if value is None:
        if optional:
            return
        raise CorrectionConfigError(f"{owner}.{name} is required here; set it to a positive number.")
    if not is_number(value) or value <= 0:
        raise CorrectionConfigError(f"{owner}.{name}={value!r} must be a positive finite number.")


def check_bounds(owner: str, low_name: str, low: float | None, high_name: str, high: float | None) -> None:
    check_positive(owner, low_name, low, optional=True)
    check_positive(owner, high_name, high, optional=True)
    if low is not None and high is not None and low > high:
        raise CorrectionConfigError(
            f"{owner}.{low_name}={low!r} is greater than {owner}.{high_name}={high!r}; "
            f"the lower bound must not exceed the upper bound."
        )
