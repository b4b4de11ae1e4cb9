"""The rollout pipeline without Lightning: prompts -> token ids -> completions -> rewards -> advantages.

:class:`Rollouter` turns a :class:`~lightning_offpolicy.batch.PromptBatch` into episodes
(:mod:`~lightning_offpolicy.rollout.episode`; a single-turn rollout is an episode of one turn), and those into the
:class:`~lightning_offpolicy.batch.RolloutBatch` that ``training_step`` trains on (and, for held-out
prompts, into an :class:`~lightning_offpolicy.metrics.evaluation.EvaluationBatch`) with whatever weights the
engine holds. Pushing weights, threads and staleness are the callers' business: the
:class:`~lightning_offpolicy.lightning.callback.RolloutCallback` in a Lightning fit, or any loop of
your own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.data.rewards import DEFAULT_REWARD_TIMEOUT_S, score_completions
from lightning_offpolicy.data.tokenizers import encode_prompt
from lightning_offpolicy.metrics.evaluation import EvaluationBatch, prompt_seed
from lightning_offpolicy.preflight import check_prompt_fits
from lightning_offpolicy.rollout.advantages import compute_advantages
from lightning_offpolicy.rollout.dapo import DAPOSettings, informative_rows, overlong_penalty
from lightning_offpolicy.rollout.engine import Completion, RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.episode import Episode, single_turn_episodes, to_rollout_batch
from lightning_offpolicy.rollout.partial import PartialStats, check_not_stopped, generate_resumable

__all__ = ["Rollouter", "batch_seed"]


def batch_seed(seed: int, index: int, rank: int, refill: int = 0) -> int:
    """The sampler seed of training batch ``index`` on rank ``rank`` (and of its ``refill``-th extra
    generation under dynamic sampling): distinct per batch, per rank and per refill."""
    return (seed * 1_000_003 + index * 9_973 + rank * 7_919 + refill * 104_729) % (2**31 - 1)


@dataclass
class _Samples:
    """The episodes of one or more generation calls, in order (a single-turn rollout: one turn each)."""

    episodes: list[Episode] = field(default_factory=list)

    @property
    def completions(self) -> list[Completion]:
        return [e.completion for e in self.episodes]

    @property
    def groups(self) -> list[int]:
        return [e.group for e in self.episodes]

    def rewards(self) -> torch.Tensor:
        """``[B]`` float32: each episode's reward."""
        return torch.tensor([e.reward for e in self.episodes], dtype=torch.float64).float()

    def informative_groups(self, rewards: torch.Tensor) -> list[int]:
        """The groups whose rewards are not all equal, in order of appearance."""
        keep = informative_rows(rewards, torch.tensor(self.groups)).tolist()
        return list(dict.fromkeys(g for g, k in zip(self.groups, keep, strict=True) if k))


def _partial_stats(partial: PartialStats, generated: int, rollout: RolloutBatch) -> dict[str, float]:
    """A partial rollout's counts: the interrupted fraction, the continuation calls, tokens per version."""
    versions = rollout.policy_version[rollout.response_mask.bool()]
    distinct = int(versions.unique().numel()) if versions.numel() else 1
    return {
        "interrupted_frac": partial.interrupted / max(generated, 1),
        "continuation_calls": float(partial.continuation_calls),
        "tokens_per_version": float(versions.numel()) / distinct,
    }


def _without_unknown_support(rollout: RolloutBatch, unknown: list[list[bool]]) -> RolloutBatch:
    """``rollout`` with the tokens whose kept support the engine could not tell out of the loss.

    Their ratio cannot be renormalized (the trainer does not know the set to renormalize over), so
    they leave ``response_mask`` (and so the loss, the correction and the metrics) instead of
    training with a biased ratio; the batch keeps them as context.
    """
    flags = torch.zeros_like(rollout.response_mask, dtype=torch.bool)
    for row, tokens in enumerate(unknown):
        flags[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.bool)
    keep = (~flags).to(rollout.response_mask.dtype)
    return rollout.with_fields(response_mask=rollout.response_mask * keep, advantages=rollout.advantages * keep)


class Rollouter:
    """Generate, score and build the batches of one engine's samples.

    Args:
        engine: Any :class:`~lightning_offpolicy.rollout.engine.RolloutEngine`, with the weights to
            sample from already in it.
        tokenizer: Encodes prompts by its own rule (:func:`~lightning_offpolicy.data.tokenizers.encode_prompt`),
            decodes completions for the reward, and gives ``pad_token_id``.
        reward_fn: ``(prompts, completions, metadata) -> rewards``, one float per completion.
        sampling: How training rollouts are sampled (``samples_per_prompt`` is the advantage group).
        advantage_estimator: One of :data:`~lightning_offpolicy.rollout.advantages.ADVANTAGE_ESTIMATORS`.
        seed: Base seed: training batch ``j`` on rank ``r`` samples with :func:`batch_seed`; each
            held-out prompt with a seed of its text.
        context_limit: ``(tokens, where the limit comes from)`` of the model's context, checked against
            the longest prompt + ``max_new_tokens`` before generating (``None``: not checked).
        success_threshold: Held-out evaluation: the reward a sample needs for its prompt to pass.
        dapo: DAPO's dynamic sampling and overlong handling (:mod:`~lightning_offpolicy.rollout.dapo`).
        more_prompts: Returns the next prompt batch to refill from (dynamic sampling; ``None``: no refill).
        turn: Partial rollouts: a context manager that grants the engine for one ``generate`` call
            between two weight pushes (the producer's ``generation_turn``); completions a push
            interrupts are continued under the new weights
            (:func:`~lightning_offpolicy.rollout.partial.generate_resumable`). ``None``: the caller
            holds the engine for the whole rollout.
        reward_timeout_s: Longest one call of the reward function (of each part of a weighted
            reward) may take; past it the call is abandoned and a ``RewardError`` names the row it
            was scoring (:func:`~lightning_offpolicy.data.rewards.score_completions`). ``None``: no limit.
        stop: Returns ``True`` once the rollout must stop (a preemption): a ``generate`` call it cut
            short is not continued (nor scored), and :meth:`rollout` and :meth:`evaluate` raise
            :class:`~lightning_offpolicy.rollout.partial.RolloutStopped`. ``None``: never.

    After each :meth:`rollout`, :attr:`last_stats` holds its counts (``groups_dropped``,
    ``refill_batches``, ``groups_short``, ``overlong_filtered``; with ``turn``: ``interrupted_frac``,
    ``continuation_calls`` and ``tokens_per_version``; under a sampling mask ``support_unknown_frac``,
    the share of tokens whose kept support the engine could not tell; only those of the features
    in use).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        reward_fn: Callable[..., Any],
        sampling: SamplingConfig,
        advantage_estimator: str = "grpo",
        seed: int = 0,
        context_limit: tuple[int, str] | None = None,
        success_threshold: float = 1.0,
        dapo: DAPOSettings | None = None,
        more_prompts: Callable[[], PromptBatch] | None = None,
        turn: Callable[[], AbstractContextManager[object]] | None = None,
        reward_timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.advantage_estimator = advantage_estimator
        self.seed = seed
        self.context_limit = context_limit
        self.success_threshold = success_threshold
        self.dapo = dapo if dapo is not None else DAPOSettings()
        self.more_prompts = more_prompts
        self.turn = turn
        self.reward_timeout_s = reward_timeout_s
        self.stop = stop
        self._partial = PartialStats()
        self.last_stats: dict[str, float] = {}

    def encode(self, prompts: PromptBatch) -> list[list[int]]:
        """The prompts' token ids by the tokenizer's own rule (bos where it adds one; chat via its template)."""
        return [encode_prompt(self.tokenizer, prompt) for prompt in prompts.prompts]

    def rollout(self, prompts: PromptBatch, index: int, rank: int = 0) -> tuple[RolloutBatch, float]:
        """Training batch ``index``: the scored rollout of ``prompts``, and the seconds generation took."""
        samples, generate_s = _Samples(), 0.0
        self._partial = PartialStats()
        generate_s += self._sample(samples, prompts, batch_seed(self.seed, index, rank), group_offset=0)
        rewards = samples.rewards()
        keep = torch.ones(len(samples.completions), dtype=torch.bool)
        stats: dict[str, float] = {}
        if self.dapo.dynamic_sampling:
            wanted = len(prompts)
            informative = samples.informative_groups(rewards)
            refills = 0
            while (
                self.more_prompts is not None and refills < self.dapo.max_refill_batches and len(informative) < wanted
            ):
                refills += 1
                seed = batch_seed(self.seed, index, rank, refill=refills)
                generate_s += self._sample(samples, self.more_prompts(), seed, group_offset=max(samples.groups) + 1)
                rewards = samples.rewards()
                informative = samples.informative_groups(rewards)
            chosen = set(informative[:wanted])
            if not chosen:  # nothing informative: train the batch's own groups (zero advantage, no signal)
                chosen = set(range(len(prompts)))
            keep = torch.tensor([g in chosen for g in samples.groups], dtype=torch.bool)
            stats = {
                "groups_dropped": float(len(set(samples.groups)) - len(informative)),
                "refill_batches": float(refills),
                "groups_short": float(max(wanted - len(informative), 0)),
            }
        rollout = self._build(samples, rewards, keep)
        if self.sampling.support_needed:
            trained = [c for c, k in zip(samples.completions, keep.tolist(), strict=True) if k]
            unknown = sum(kept is None for c in trained for kept in c.sampling_support)
            stats["support_unknown_frac"] = unknown / max(sum(len(c.token_ids) for c in trained), 1)
        if self.dapo.overlong_filter:
            cut = torch.tensor(
                [c.finish_reason == "length" for c, k in zip(samples.completions, keep.tolist(), strict=True) if k]
            )
            stats["overlong_filtered"] = float(cut.sum())
            if bool(cut.any()):
                out = (~cut).float().unsqueeze(-1)
                rollout = rollout.with_fields(
                    response_mask=rollout.response_mask * out, advantages=rollout.advantages * out
                )
        if self.turn is not None:
            stats.update(_partial_stats(self._partial, len(samples.completions), rollout))
        self.last_stats = stats
        return rollout, generate_s

    def _sample(self, samples: _Samples, prompts: PromptBatch, seed: int, group_offset: int) -> float:
        """Generate and score ``prompts`` into ``samples``; the seconds generation took."""
        prompt_ids = self.encode(prompts)
        started = time.perf_counter()
        check_prompt_fits(max(map(len, prompt_ids), default=0), self.sampling.max_new_tokens, self.context_limit)
        completions = generate_resumable(
            self.engine, prompt_ids, self.sampling, seed=seed, turn=self.turn, stats=self._partial, stop=self.stop
        )
        generate_s = time.perf_counter() - started
        scored = self._score(prompts, [c.prompt_index for c in completions], completions)
        components = dict(scored.components or {})
        if self.dapo.overlong_buffer > 0:
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            penalty = overlong_penalty(
                lengths, self.sampling.max_new_tokens, self.dapo.overlong_buffer, self.dapo.overlong_penalty_factor
            )
            components["overlong_penalty"] = penalty
            scored_total = scored.total.to(torch.float64) + penalty
        else:
            scored_total = scored.total.to(torch.float64)
        samples.episodes += single_turn_episodes(prompt_ids, completions, scored_total, components, group_offset)
        return generate_s

    def _build(self, samples: _Samples, rewards: torch.Tensor, keep: torch.Tensor) -> RolloutBatch:
        """The rollout batch of the kept episodes; group ids renumbered 0, 1, ... in their order."""
        rows = keep.nonzero().flatten().tolist()
        episodes = [samples.episodes[i] for i in rows]
        numbering = {g: n for n, g in enumerate(sorted({e.group for e in episodes}))}
        group_ids = torch.tensor([numbering[e.group] for e in episodes], dtype=torch.long)
        supports, unknown = self._supports([e.completion for e in episodes])
        advantages = compute_advantages(self.advantage_estimator, rewards[rows], group_ids)
        rollout = to_rollout_batch(episodes, advantages, group_ids, self.tokenizer.pad_token_id, supports)
        if unknown is not None:
            rollout = _without_unknown_support(rollout, unknown)
        return rollout

    def _supports(self, completions: list[Completion]) -> tuple[list[list[list[int]]] | None, list[list[bool]] | None]:
        """The completions' kept supports under top-k / top-p, and which tokens the engine could not
        tell them for (``None, None`` without a sampling mask).

        Raises:
            ValueError: top-k / top-p is on and the engine did not report what its sampler kept:
                every ratio would then carry the log of the kept mass.
        """
        if not self.sampling.support_needed:
            return None, None
        if any(c.sampling_support is None for c in completions):
            raise ValueError(
                f"SamplingConfig(top_k={self.sampling.top_k}, top_p={self.sampling.top_p}) cuts the sampling "
                f"distribution, but {type(self.engine).__name__} did not report which tokens it kept "
                "(Completion.sampling_support), so the trainer cannot renormalize pi_prox / pi_theta over the "
                "same support and every importance ratio would be biased by the mass cut off. Use an engine "
                "that reports it (HFEngine, HFProcessEngine, VLLMEngine, RemoteVLLMEngine), or set top_k=0 and "
                "top_p=1.0 (or sampling_mask=False, for a comparison only)."
            )
        unknown = [[kept is None for kept in c.sampling_support] for c in completions]
        supports = [[kept or [] for kept in c.sampling_support] for c in completions]
        return supports, unknown

    def evaluate(self, prompts: PromptBatch) -> EvaluationBatch:
        """One greedy and ``samples_per_prompt`` sampled completions per held-out prompt, scored.

        Each prompt is sampled in its own call, seeded by its text: the same samples at every
        evaluation, whatever the batch size or the number of ranks.
        """
        prompt_ids = self.encode(prompts)
        greedy_sampling = SamplingConfig(max_new_tokens=self.sampling.max_new_tokens, samples_per_prompt=1, greedy=True)
        greedy = self.engine.generate(prompt_ids, greedy_sampling)
        # Completions a preemption cut short would be scored as if whole: the evaluation stops instead.
        check_not_stopped(self.stop, "evaluation")
        sampled: list[Completion] = []
        for text, ids in zip(prompts.prompts, prompt_ids, strict=True):
            sampled += self.engine.generate([ids], self.sampling, seed=prompt_seed(self.seed, text))
            check_not_stopped(self.stop, "evaluation")
        k, num = self.sampling.samples_per_prompt, len(prompts)
        owners = list(range(num)) + [i for i in range(num) for _ in range(k)]
        rewards = self._score(prompts, owners, [*greedy, *sampled]).total.tolist()
        return EvaluationBatch.from_scores(
            greedy_rewards=rewards[:num],
            sampled_rewards=[rewards[num + i * k : num + (i + 1) * k] for i in range(num)],
            greedy_lengths=[len(c.token_ids) for c in greedy],
            sampled_lengths=[[len(c.token_ids) for c in sampled[i * k : (i + 1) * k]] for i in range(num)],
            success_threshold=self.success_threshold,
        )

    def _score(self, prompts: PromptBatch, owners: Sequence[int], completions: Sequence[Completion]) -> Any:
        texts = [self.tokenizer.decode(c.token_ids) for c in completions]
        return score_completions(
            self.reward_fn,
            [prompts.prompts[i] for i in owners],
            texts,
            [prompts.metadata[i] for i in owners],
            timeout_s=self.reward_timeout_s,
        )
