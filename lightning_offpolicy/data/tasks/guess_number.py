"""The prompts of guess my number, played with :class:`~lightning_offpolicy.data.environments.GuessNumber`.

Every prompt is the same text; the secret is only in the row's metadata, where the environment reads
it. The task is multi-turn: the reward of an episode is the environment's (1 when the number was
found), which the runner passes in ``metadata["environment_reward"]``. See docs/environments.md.
"""

from __future__ import annotations

import random
from typing import Any

from lightning_offpolicy.data.environments.guess_number import last_integer
from lightning_offpolicy.data.tasks.base import Task

__all__ = ["GuessNumberTask"]


class GuessNumberTask(Task):
    """Guess a secret number in ``[low, high]`` from "Higher." / "Lower." feedback.

    ``sample`` gives the prompt ``"Guess my number between {low} and {high}."`` and
    ``{"target": t}``, ``t`` uniform in ``[low, high]``. Played by the ``GuessNumber`` environment
    with the same ``low`` / ``high``.

    Reward: ``metadata["environment_reward"]`` when the episode ran in an environment; otherwise
    (a single turn) ``1.0`` iff the completion's last integer is the target, else ``0.0``.

    Args:
        low: The smallest possible secret.
        high: The largest possible secret.

    Raises:
        ValueError: ``low`` or ``high`` is not an int, or ``low > high``.
    """

    name = "guess_number"
    # Every prompt is the same text: held-out games differ by their secret, drawn from their own stream.
    distinct_held_out = False

    def __init__(self, low: int = 1, high: int = 16) -> None:
        if isinstance(low, bool) or isinstance(high, bool) or not isinstance(low, int) or not isinstance(high, int):
            raise ValueError(f"GuessNumberTask: `low` and `high` must be ints, got low={low!r}, high={high!r}.")
        if low > high:
            raise ValueError(f"GuessNumberTask: need `low` <= `high`, got low={low}, high={high}.")
        self.low = low
        self.high = high
        # One guess per turn: the longest number (its sign included), a leading space and eos.
        self.max_new_tokens = max(len(str(low)), len(str(high))) + 2

    def sample(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        return f"Guess my number between {self.low} and {self.high}.", {"target": rng.randint(self.low, self.high)}

    def reward(self, completion: str, metadata: dict[str, Any]) -> float:
        if "environment_reward" in metadata:
            return float(metadata["environment_reward"])
        return 1.0 if last_integer(completion) == metadata["target"] else 0.0

    def reference_completion(self, metadata: dict[str, Any]) -> str:
        """The right guess, the last turn of a won game (the whole game: ``bisection_dialogue``)."""
        return str(metadata["target"])
