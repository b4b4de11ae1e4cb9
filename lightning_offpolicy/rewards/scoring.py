"""Call a reward function on a batch and check what it returns, naming the function and the row at fault."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_offpolicy.rewards.resolve import reward_name

__all__ = ["RewardError", "ScoredRewards", "score_completions"]

_SNIPPET = 80


class RewardError(RuntimeError):
    """A reward function raised, or returned the wrong number of rewards or a non-finite one."""


@dataclass
class ScoredRewards:
    """``total``: ``[N]`` float64 reward per completion; ``components``: ``name -> [N]`` (weighted rewards only)."""

    total: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)


def score_completions(
    reward_fn: Callable[..., Any], prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]]
) -> ScoredRewards:
    """Score ``completions`` with ``reward_fn`` (a :class:`WeightedReward` part by part) and check the result.

    Raises:
        RewardError: the function raised (the first row that fails on its own is named), returned
            another count than ``len(completions)``, or a value that is not a finite number (the
            row is named: index, prompt and the start of the completion).
    """
    from lightning_offpolicy.rewards.weighted import WeightedReward

    if isinstance(reward_fn, WeightedReward):
        components = {c.name: _checked(c.fn, prompts, completions, metadata) for c in reward_fn.components}
        total = torch.zeros(len(completions), dtype=torch.float64)
        for component in reward_fn.components:
            total += component.weight * components[component.name]
        return ScoredRewards(total=total, components=components)
    return ScoredRewards(total=_checked(reward_fn, prompts, completions, metadata))


def _row(index: int, prompts: list[Any], completions: list[str]) -> str:
    completion = completions[index]
    snippet = completion[:_SNIPPET] + ("..." if len(completion) > _SNIPPET else "")
    return f"row {index} (prompt {str(prompts[index])[:_SNIPPET]!r}, completion {snippet!r})"


def _checked(fn: Callable[..., Any], prompts: list[Any], completions: list[str], metadata: list[dict]) -> torch.Tensor:
    name = reward_name(fn)
    count = len(completions)
    try:
        values = fn(prompts, completions, metadata)
    except Exception as error:
        row = _first_failing_row(fn, prompts, completions, metadata)
        where = f" at {_row(row, prompts, completions)}" if row is not None else f" on a batch of {count} completions"
        raise RewardError(f"reward function {name} raised {type(error).__name__}: {error}{where}.") from error
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward function {name} returned a {type(values).__name__}; it must return one float per completion "
            f"(a list of {count})."
        ) from None
    if len(values) != count:
        raise RewardError(
            f"reward function {name} returned {len(values)} rewards for {count} completions; it must return one "
            "float per completion, in order."
        )
    numbers = []
    for index, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {name} returned {value!r} (a {type(value).__name__}, not a number) at "
                f"{_row(index, prompts, completions)}."
            ) from None
        if not math.isfinite(number):
            raise RewardError(
                f"reward function {name} returned {number} at {_row(index, prompts, completions)}; rewards must be "
                "finite numbers."
            )
        numbers.append(number)
    return torch.tensor(numbers, dtype=torch.float64)


def _first_failing_row(fn: Callable[..., Any], prompts: list, completions: list, metadata: list) -> int | None:
    # A batch function does not say which row broke it: score the rows one at a time to find out.
    for index in range(len(completions)):
        try:
            fn([prompts[index]], [completions[index]], [metadata[index]])
        except Exception:
            return index
    return None
