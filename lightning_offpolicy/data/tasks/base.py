"""The task interface: prompts with metadata, a reward with partial credit, a reference answer."""

from __future__ import annotations

import abc
import random
from typing import Any, Protocol, runtime_checkable

__all__ = ["Task", "RewardFn", "TaskReward", "positional_score"]


class Task(abc.ABC):
    """A prompt distribution with a verifiable answer.

    Subclasses set ``name`` (the registry key) and ``max_new_tokens`` (enough for the longest
    answer plus ``eos``) and implement :meth:`sample`, :meth:`reward` and
    :meth:`reference_completion`.
    """

    name: str = ""
    max_new_tokens: int = 0
    #: Whether a held-out prompt must differ from every training prompt. ``False`` where the prompt
    #: does not identify the problem (a game whose secret is only in the metadata): held-out rows are
    #: then fresh draws of the same distribution, from a seed stream of their own.
    distinct_held_out: bool = True

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        """Draw one ``(prompt, metadata)``; ``metadata["answer"]`` is the expected completion."""

    @abc.abstractmethod
    def reward(self, completion: str, metadata: dict[str, Any]) -> float:
        """Score in ``[0, 1]``: partial credit for partly right answers, ``1.0`` iff exactly right."""

    def reference_completion(self, metadata: dict[str, Any]) -> str:
        """The completion supervised warm-up trains on (without ``eos``)."""
        return str(metadata["answer"])

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


@runtime_checkable
class RewardFn(Protocol):
    """What the rollout side calls to score a batch of completions (one float per completion)."""

    def __call__(self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]: ...


class TaskReward:
    """A :class:`RewardFn` that scores each completion with ``task.reward``.

    >>> from lightning_offpolicy.data.tasks import AdditionTask
    >>> TaskReward(AdditionTask())(["1+2="], ["3"], [{"answer": "3"}])
    [1.0]
    """

    def __init__(self, task: Task) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"TaskReward: expected a Task, got {type(task).__name__}.")
        self.task = task

    def __call__(self, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        if not (len(prompts) == len(completions) == len(metadata)):
            raise ValueError(
                f"TaskReward: {len(prompts)} prompts, {len(completions)} completions and "
                f"{len(metadata)} metadata entries; they must match."
            )
        return [float(self.task.reward(c, m)) for c, m in zip(completions, metadata, strict=True)]

    def __repr__(self) -> str:
        return f"TaskReward({self.task!r})"


def positional_score(completion: str, target: str, align: str = "left") -> float:
    """Fraction of positions where ``completion`` matches ``target``, over the longer length.

    Missing and extra characters count as wrong, so a length mismatch always costs credit and the
    score is ``1.0`` iff the strings are equal. ``align="right"`` compares from the end (digits of
    a number: the units digit of ``"146"`` and ``"46"`` line up).
    """
    if align not in ("left", "right"):
        raise ValueError(f"positional_score: align must be 'left' or 'right', got {align!r}.")
    length = max(len(completion), len(target))
    if length == 0:
        return 1.0
    if align == "right":
        completion, target = completion[::-1], target[::-1]
    matches = sum(a == b for a, b in zip(completion, target, strict=False))
    return matches / length
