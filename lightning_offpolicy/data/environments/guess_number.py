"""Guess my number: a multi-turn game whose every turn gets feedback ("Higher." / "Lower.").

The smallest environment where a policy must use what the environment said: the prompt is the same
for every secret, so only the replies to earlier guesses tell the model where the number is. A
binary search finds it in at most ``floor(log2(high - low + 1)) + 1`` guesses. The feedback texts are
short and fixed so that a tiny model can be warmed up on them by supervised fine-tuning. Why and
how: docs/environments.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning_offpolicy.data.environments.base import Message, StepResult

__all__ = ["GuessNumber", "bisection_dialogue", "last_integer"]

#: An integer not glued to a digit before it: ``"1-16"`` reads as 1 and 16, not 1 and -16.
_INTEGER = re.compile(r"(?<!\d)-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (a sign counts), or ``None`` when there is none.

    >>> last_integer("Is it 3? No, 12."), last_integer("no idea")
    (12, None)
    """
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def _check_range(owner: str, low: Any, high: Any) -> None:
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{owner}: `{name}` must be an int, got {value!r}.")
    if low > high:
        raise ValueError(f"{owner}: need `low` <= `high`, got low={low}, high={high}.")


class GuessNumber:
    """Guess my number: ``reset`` reads the secret from the row's metadata, ``step`` answers each guess.

    Pair it with the ``guess_number`` task (same ``low`` / ``high``), whose rows carry the secret in
    ``metadata["target"]``. In YAML::

        rollout:
          episodes:
            environment:
              class_path: lightning_offpolicy.data.environments.GuessNumber
              init_args: {low: 1, high: 16}


    The guess is the last integer of the reply. No integer: the user asks for one number; a guess
    below the secret: ``"Higher."``; above: ``"Lower."``; equal: the episode ends with reward 1.
    Every other step has reward 0; the game itself has no turn limit (the runner's ``max_turns``
    ends an episode that never finds the number).

    Args:
        low: The smallest possible secret.
        high: The largest possible secret.

    Raises:
        ValueError: ``low`` or ``high`` is not an int, or ``low > high``.
    """

    def __init__(self, low: int = 1, high: int = 16) -> None:
        _check_range(type(self).__name__, low, high)
        self.low = low
        self.high = high
        self.target: int | None = None
        self.done = False

    def reset(self, prompt: Any, metadata: Mapping[str, Any]) -> None:
        """Start a game whose secret is ``metadata["target"]`` (the prompt is not read).

        Raises:
            ValueError: ``metadata`` has no ``"target"``, or it is not an int in ``[low, high]``.
        """
        if "target" not in metadata:
            raise ValueError(
                f"GuessNumber: the row's metadata has no 'target' (the secret number; keys: {sorted(metadata)}). "
                "Use prompts of the guess_number task, or put metadata['target'] in each row."
            )
        target = metadata["target"]
        if isinstance(target, bool) or not isinstance(target, int) or not self.low <= target <= self.high:
            raise ValueError(
                f"GuessNumber: metadata['target'] must be an int in [low, high] = [{self.low}, {self.high}], got "
                f"{target!r}; make the task's range and the environment's `low` / `high` the same."
            )
        self.target = target
        self.done = False

    def step(self, reply: str) -> StepResult:
        """Answer one guess.

        Args:
            reply: The model's turn, decoded; its last integer is the guess.

        Returns:
            ``done`` with reward 1 when the guess is the secret, else a ``"user"`` message.

        Raises:
            RuntimeError: Called before :meth:`reset` or after the game was won.
        """
        if self.target is None or self.done:
            state = "before reset()" if self.target is None else "after the number was found"
            raise RuntimeError(f"GuessNumber: step() called {state}; call reset(prompt, metadata) to start a game.")
        guess = last_integer(reply)
        if guess == self.target:
            self.done = True
            return StepResult(reward=1.0, done=True)
        if guess is None:
            text = f"Reply with one number between {self.low} and {self.high}."
        else:
            text = "Higher." if guess < self.target else "Lower."
        return StepResult(messages=[{"role": "user", "content": text}])


def bisection_dialogue(target: int, low: int = 1, high: int = 16) -> list[Message]:
    """The turns after the prompt of a game played by binary search, as chat messages.

    Each guess is the middle of the range still possible (rounded down); the environment's real
    answers come in between. The last message is the assistant's right guess. Supervised warm-up
    on these teaches the reply format and how to use the feedback.

    Args:
        target: The secret number.
        low: The smallest possible secret.
        high: The largest possible secret.

    Returns:
        Alternating ``{"role": "assistant", ...}`` and ``{"role": "user", ...}`` messages.

    Raises:
        ValueError: ``target`` is not an int in ``[low, high]``.

    >>> [m["content"] for m in bisection_dialogue(11, 1, 16)]
    ['8', 'Higher.', '12', 'Lower.', '10', 'Higher.', '11']
    """
    env = GuessNumber(low, high)
    env.reset("", {"target": target})
    lo, hi = low, high
    messages: list[Message] = []
    while True:
        guess = (lo + hi) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        result = env.step(str(guess))
        if result.done:
            return messages
        messages.extend(result.messages)
        if result.messages[0]["content"] == "Higher.":
            lo = guess + 1
        else:
            hi = guess - 1
