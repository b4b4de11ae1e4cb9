"""Partial rollouts: continue the completions a weight push interrupted, under the new weights.

With ``AsyncSettings(partial_rollouts=True)`` a weight push does not wait for the generation
request in flight: it interrupts it (:class:`~lightning_offpolicy.rollout.engine.InterruptibleEngine`),
loads the new weights, and generation goes on from where each completion stopped, as in AReaL,
slime, SkyRL and prime-rl. A continued completion is the concatenation of its segments: each
token keeps the logprob and the ``policy_version`` of the weights that sampled it, so the
off-policy correction sees exactly which policy produced which token, and the staleness bound
holds for the oldest token of every sequence (its first segment's version, which admission
bounds).

:func:`generate_resumable` is that loop without threads or Lightning: it takes the engine and a
``turn`` (a context manager that grants the engine between two pushes) and returns completions as
``engine.generate`` would, none of them interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

from lightning_offpolicy.rollout.engine import INTERRUPTED, Completion, RolloutEngine, SamplingConfig

__all__ = ["PartialStats", "RolloutStopped", "check_not_stopped", "continuation_seed", "generate_resumable"]


@dataclasses.dataclass
class PartialStats:
    """What the continuations of one :func:`generate_resumable` call cost.

    Attributes:
        interrupted: Completions interrupted at least once.
        interruptions: Interrupted segments in all (a completion interrupted twice counts twice).
        continuation_calls: ``generate`` calls made to continue interrupted completions.
    """

    interrupted: int = 0
    interruptions: int = 0
    continuation_calls: int = 0

    def add(self, other: PartialStats) -> None:
        self.interrupted += other.interrupted
        self.interruptions += other.interruptions
        self.continuation_calls += other.continuation_calls


def continuation_seed(seed: int | None, round_: int, budget: int) -> int | None:
    """The sampler seed of the continuations of round ``round_`` with ``budget`` tokens left."""
    if seed is None:
        return None
    return (seed * 1_000_003 + round_ * 7_919 + budget * 104_729) % (2**31 - 1)


class RolloutStopped(RuntimeError):
    """A rollout was stopped while it generated (a preemption): its completions are not continued."""


def check_not_stopped(stop: Callable[[], bool] | None, what: str = "rollout") -> None:
    """Raise :class:`RolloutStopped` (naming ``what``) when ``stop`` is given and returns ``True``."""
    if stop is not None and stop():
        raise RolloutStopped(f"the {what} was stopped while it generated (a preemption)")


def generate_resumable(
    engine: RolloutEngine,
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    seed: int | None = None,
    turn: Callable[[], AbstractContextManager[object]] | None = None,
    stats: PartialStats | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[Completion]:
    """``engine.generate(prompt_ids, sampling, seed)``, with every interrupted completion continued.

    Each ``generate`` call runs inside ``turn()`` (``None``: no guard). A completion that comes back
    :data:`~lightning_offpolicy.rollout.engine.INTERRUPTED` is generated further from
    ``prompt + its tokens`` with the tokens it has left, one sample per row, in as many rounds as
    interruptions come; rows with the same budget share a call (seeded by
    :func:`continuation_seed`). The result has the order and the ``prompt_index`` of the first call;
    a continued completion has one ``policy_version`` per token. ``stats``, when given, is added to.

    Raises:
        RolloutStopped: ``stop()`` returned ``True`` after a ``generate`` call (a preemption cut it short):
            nothing is continued.
    """
    guard = turn if turn is not None else contextlib.nullcontext
    with guard():
        completions = engine.generate(prompt_ids, sampling, seed=seed)
    check_not_stopped(stop)
    pending = [i for i, c in enumerate(completions) if c.finish_reason == INTERRUPTED]
    counts = PartialStats(interrupted=len(pending), interruptions=len(pending))
    round_ = 0
    while pending:
        round_ += 1
        for budget, rows in _by_budget(completions, pending, sampling.max_new_tokens):
            prefixes = [prompt_ids[completions[i].prompt_index] + completions[i].token_ids for i in rows]
            more_sampling = dataclasses.replace(sampling, samples_per_prompt=1, max_new_tokens=budget)
            with guard():
                continued = engine.generate(prefixes, more_sampling, seed=continuation_seed(seed, round_, budget))
            check_not_stopped(stop)
            counts.continuation_calls += 1
            if len(continued) != len(rows):
                raise RuntimeError(
                    f"{type(engine).__name__}.generate returned {len(continued)} completions for {len(rows)} "
                    "continued prompts (one sample each)."
                )
            for i, more in zip(rows, continued, strict=True):
                completions[i] = _joined(completions[i], more)
        pending = [i for i in pending if completions[i].finish_reason == INTERRUPTED]
        counts.interruptions += len(pending)
    if stats is not None:
        stats.add(counts)
    return completions


def _by_budget(completions: list[Completion], rows: Iterable[int], max_new_tokens: int) -> list[tuple[int, list[int]]]:
    """The rows grouped by the tokens they have left, largest budget first."""
    groups: dict[int, list[int]] = {}
    for i in rows:
        left = max_new_tokens - len(completions[i].token_ids)
        if left < 1:  # an engine that reports a full-length completion as interrupted
            raise RuntimeError(
                f"a completion came back {INTERRUPTED!r} with {len(completions[i].token_ids)} tokens, "
                f"max_new_tokens={max_new_tokens}: nothing is left to generate ('length' was expected)."
            )
        groups.setdefault(left, []).append(i)
    return sorted(groups.items(), reverse=True)


def _joined(first: Completion, more: Completion) -> Completion:
    """``first`` continued by ``more``: tokens, logprobs, per-token versions and kept supports concatenated."""
    logprobs = None if first.logprobs is None or more.logprobs is None else first.logprobs + more.logprobs
    support = None
    if first.sampling_support is not None and more.sampling_support is not None:
        support = first.sampling_support + more.sampling_support
    return Completion(
        prompt_index=first.prompt_index,
        token_ids=first.token_ids + more.token_ids,
        logprobs=logprobs,
        finish_reason=more.finish_reason,
        policy_version=first.token_versions() + more.token_versions(),
        sampling_support=support,
    )
