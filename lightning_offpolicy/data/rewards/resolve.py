"""A ``reward_fn`` setting turned into a callable: an import path, a callable, or a weighted list of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning_offpolicy.data.rewards.named import resolve_one
from lightning_offpolicy.data.rewards.weighted import RewardComponent, WeightedReward

__all__ = ["RewardSpec", "resolve_reward"]

#: What ``reward_fn`` settings accept: a callable, an import path (``"pkg.mod.fn"`` or
#: ``"pkg.mod:fn"``), a dict ``{"fn": ..., "weight": ..., "name": ..., "init_args": {...}}``, or a
#: list of those (a weighted sum, each part logged as ``reward/<name>``).
RewardSpec = str | dict[str, Any] | list[str | dict[str, Any]] | Callable[..., Any] | None


def resolve_reward(spec: RewardSpec, setting: str = "reward_fn") -> Callable[..., Any] | None:
    """Turn a reward setting into a callable ``(prompts, completions, metadata) -> list[float]``.

    Args:
        spec: ``None``; a callable (returned as is); an import path ``"pkg.mod.fn"`` /
            ``"pkg.mod:fn"`` (a class is instantiated without arguments); a dict
            ``{"fn": path or callable, "init_args": {...}}`` (also ``weight`` / ``name`` in a list);
            or a list of those, which becomes a :class:`~lightning_offpolicy.data.rewards.WeightedReward`
            (the weighted sum; each part logged as ``reward/<name>``).
        setting: the setting's name, for error messages.

    >>> resolve_reward("lightning_offpolicy.data.rewards.math_answer")(["1/2?"], ["0.5"], [{"answer": "1/2"}])
    [1.0]
    """
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError(f"`{setting}` is an empty list; give at least one reward function.")
        return WeightedReward([RewardComponent.from_spec(item, f"{setting}[{i}]") for i, item in enumerate(spec)])
    if isinstance(spec, Mapping):
        extra = set(spec) - {"fn", "init_args"}
        if extra:
            raise ValueError(
                f"`{setting}`: a single reward dict takes only 'fn' and 'init_args' (weights and names belong to a "
                f"list of rewards); got the keys {sorted(extra)}."
            )
        if "fn" not in spec:
            raise ValueError(f"`{setting}`={dict(spec)} has no 'fn' (the reward's import path or callable).")
        return resolve_one(spec["fn"], spec.get("init_args"), setting)
    return resolve_one(spec, None, setting)
