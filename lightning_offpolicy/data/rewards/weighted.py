"""Several reward functions with weights: the total is their weighted sum, each part logged by name."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_int, is_number
from lightning_offpolicy.data.rewards.named import resolve_one
from lightning_offpolicy.data.rewards.scoring import (
    MAX_ABS_REWARD,
    Limits,
    RewardError,
    ScoredRewards,
    describe_row,
    score_completions,
    score_one,
)

__all__ = ["RewardComponent", "WeightedReward"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class RewardComponent:
    """One part of a :class:`WeightedReward`.

    Attributes:
        fn: ``(prompts, completions, metadata) -> list[float]``.
        weight: its factor in the total.
        name: the log key suffix: ``reward/<name>``.
    """

    fn: Callable[..., Any]
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not is_number(self.weight):
            raise ValueError(f"RewardComponent {self.name!r}: `weight` must be a finite number, got {self.weight!r}.")
        if not self.name or not _NAME.match(self.name):
            raise ValueError(
                f"RewardComponent: `name`={self.name!r} must be non-empty letters, digits, '_', '-' or '.' "
                "(it becomes the log key reward/<name>)."
            )

    @classmethod
    def from_spec(cls, spec: Any, setting: str = "reward_fn") -> RewardComponent:
        """From an import path, a callable, or ``{"fn", "weight", "name", "init_args"}``."""
        if isinstance(spec, RewardComponent):
            return spec
        if isinstance(spec, Mapping):
            extra = set(spec) - {"fn", "weight", "name", "init_args"}
            if extra or "fn" not in spec:
                raise ValueError(
                    f"`{setting}`={dict(spec)}: a reward entry takes 'fn' (required), 'weight', 'name' and "
                    f"'init_args'" + (f"; unknown keys {sorted(extra)}." if extra else "; 'fn' is missing.")
                )
            fn, weight, name = spec["fn"], spec.get("weight", 1.0), spec.get("name")
            built = resolve_one(fn, spec.get("init_args"), setting)
        else:
            fn, weight, name = spec, 1.0, None
            built = resolve_one(fn, None, setting)
        return cls(
            fn=built,
            weight=float(weight) if is_int(weight) else weight,
            name=name or _default_name(fn, built),
        )


def _default_name(spec: Any, fn: Any) -> str:
    if isinstance(spec, str):
        return re.split(r"[.:]", spec.strip())[-1]
    return getattr(fn, "__name__", None) or type(fn).__name__


class WeightedReward:
    """The weighted sum of several reward functions; RolloutCallback logs each as ``reward/<name>``.

    >>> from lightning_offpolicy.data.rewards import RegexFormatReward
    >>> reward = WeightedReward([
    ...     {"fn": "lightning_offpolicy.data.rewards.math_answer", "weight": 1.0, "name": "acc"},
    ...     {"fn": RegexFormatReward(r"\\d"), "weight": 0.5, "name": "digit"},
    ... ])
    >>> reward(["1+1="], ["2"], [{"answer": "2"}]), reward(["1+1="], ["two"], [{"answer": "2"}])
    ([1.5], [0.0])

    Args:
        components: :class:`RewardComponent` s, or their specs (an import path, a callable, or a
            dict ``{"fn", "weight", "name", "init_args"}``; the name defaults to the function's).
    """

    def __init__(self, components: list[Any]) -> None:
        if not components:
            raise ValueError("WeightedReward: give at least one reward component.")
        self.components = [RewardComponent.from_spec(c, f"reward_fn[{i}]") for i, c in enumerate(components)]
        names = [c.name for c in self.components]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"WeightedReward: the reward names {duplicates} appear more than once; give each entry its own 'name' "
                "(the log key reward/<name>)."
            )
        if all(c.weight == 0 for c in self.components):
            weights = ", ".join(f"{c.name}={c.weight:g}" for c in self.components)
            raise ValueError(
                f"WeightedReward: every reward weight is 0 ({weights}), so every completion's reward would be 0 and "
                "every advantage 0: nothing would be trained. Give at least one entry a non-zero 'weight' (an "
                "entry of weight 0 is only logged, as reward/<name>)."
            )

    def __call__(self, prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return score_completions(self, prompts, completions, metadata).total.tolist()

    def score_parts(
        self, prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]], limits: Limits
    ) -> ScoredRewards:
        """Each part scored and checked (:func:`~lightning_offpolicy.data.rewards.scoring.score_one`), and their
        weighted sum, itself within ``MAX_ABS_REWARD``.

        Raises:
            RewardError: a part failed its call or its check, or the weighted sum is out of range.
        """
        components = {c.name: score_one(c.fn, prompts, completions, metadata, limits) for c in self.components}
        total = torch.zeros(len(completions), dtype=torch.float64)
        for component in self.components:
            total += component.weight * components[component.name]
        _check_total(self, components, total, prompts, completions)
        return ScoredRewards(total=total, components=components)

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.name}={c.weight:g}" for c in self.components)
        return f"WeightedReward({parts})"


def _check_total(
    reward_fn: WeightedReward,
    components: dict[str, torch.Tensor],
    total: torch.Tensor,
    prompts: list[Any],
    completions: list[str],
) -> None:
    """The weighted sum within ``MAX_ABS_REWARD`` too (large weights times in-range parts)."""
    over = (total.abs() > MAX_ABS_REWARD).nonzero().flatten()
    if not over.numel():
        return
    index = int(over[0])
    parts = ", ".join(
        f"{c.name}={float(components[c.name][index]):g} x weight {c.weight:g}" for c in reward_fn.components
    )
    raise RewardError(
        f"the weighted reward {reward_fn!r} sums to {float(total[index]):g} at "
        f"{describe_row(index, prompts, completions)} ({parts}); rewards must lie within +-{MAX_ABS_REWARD:g} "
        "(float32 rewards and advantages in the trainer). Lower the weights."
    )
