"""The reward of a multi-turn episode as its environment scored it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["environment_reward"]


def environment_reward(
    prompts: Sequence[Any], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> list[float]:
    """Each episode's ``metadata["environment_reward"]``: the sum of its environment's step rewards.

    Name it as the reward of a run whose environment scores the episodes
    (``rollout.reward_fn: lightning_offpolicy.data.rewards.environment_reward``); docs/multi_turn.md.

    Raises:
        KeyError: A row has no ``environment_reward``: the rollout was not an episode (no
            ``rollout.episodes.environment`` or ``tools``).
    """
    rewards = []
    for row in metadata:
        if "environment_reward" not in row:
            raise KeyError(
                "environment_reward: the row's metadata has no 'environment_reward', so the rollout did not run in "
                "an environment; set rollout.episodes.environment (or tools), or name another reward_fn."
            )
        rewards.append(float(row["environment_reward"]))
    return rewards
