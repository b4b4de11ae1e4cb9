"""Small built-in tasks a tiny character-level model can learn with RL on CPU in minutes.

Every prompt ends in ``=``; the answer follows directly. Completions are compared after
stripping surrounding whitespace (BPE tokenizers often decode a leading space).
"""

from __future__ import annotations

import random
import string
from typing import Any

from lightning_offpolicy.data.tasks.base import Task, positional_score

__all__ = ["ReverseTask", "CopyTask", "AdditionTask"]


class _LetterStringTask(Task):
    """Shared setup of tasks over random strings of ``min_len..max_len`` letters."""

    prefix = ""

    def __init__(self, letters: str = "abcde", min_len: int = 3, max_len: int = 6) -> None:
        cls = type(self).__name__
        if not letters or any(c not in string.ascii_lowercase for c in letters) or len(set(letters)) != len(letters):
            raise ValueError(f"{cls}: `letters` must be distinct lowercase letters, got {letters!r}.")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"{cls}: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}.")
        self.letters = letters
        self.min_len = min_len
        self.max_len = max_len
        self.max_new_tokens = max_len + 1  # answer + eos

    def _answer(self, text: str) -> str:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        length = rng.randint(self.min_len, self.max_len)
        text = "".join(rng.choice(self.letters) for _ in range(length))
        return f"{self.prefix} {text}=", {"input": text, "answer": self._answer(text)}

    def reward(self, completion: str, metadata: dict[str, Any]) -> float:
        return positional_score(completion.strip(), str(metadata["answer"]))


class ReverseTask(_LetterStringTask):
    """Reverse a string: ``"rev abcd="`` -> ``"dcba"``.

    Reward: fraction of positions right over the longer of answer and completion (a length
    mismatch costs credit), ``1.0`` iff exact.

    Args:
        letters: the alphabet the strings are drawn from.
        min_len: shortest string.
        max_len: longest string.
    """

    name = "reverse"
    prefix = "rev"

    def _answer(self, text: str) -> str:
        return text[::-1]


class CopyTask(_LetterStringTask):
    """Copy a string: ``"copy abcd="`` -> ``"abcd"`` (the easiest task; a smoke test for RL).

    Reward as in :class:`ReverseTask`.
    """

    name = "copy"
    prefix = "copy"

    def _answer(self, text: str) -> str:
        return text


class AdditionTask(Task):
    """Add two numbers: ``"12+34="`` -> ``"46"``.

    Reward: fraction of digits right, aligned from the units digit, over the longer of answer and
    completion (extra or missing digits cost credit), ``1.0`` iff exact.

    Args:
        max_operand: operands are drawn uniformly from ``0..max_operand``.
    """

    name = "addition"

    def __init__(self, max_operand: int = 99) -> None:
        if max_operand < 1:
            raise ValueError(f"AdditionTask: `max_operand` must be >= 1, got {max_operand}.")
        self.max_operand = max_operand
        self.max_new_tokens = len(str(2 * max_operand)) + 1  # answer + eos

    def sample(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        a = rng.randint(0, self.max_operand)
        b = rng.randint(0, self.max_operand)
        return f"{a}+{b}=", {"a": a, "b": b, "answer": str(a + b)}

    def reward(self, completion: str, metadata: dict[str, Any]) -> float:
        return positional_score(completion.strip(), str(metadata["answer"]), align="right")
