"""The rollout pipeline without Lightning: prompts -> token ids -> completions -> rewards -> advantages.

:class:`Rollouter` turns a :class:`~lightning_offpolicy.batch.PromptBatch` into episodes
(:mod:`~lightning_offpolicy.rollout.episode`; a single-turn rollout is an episode of one turn), and those into the
:class:`~lightning_offpolicy.batch.RolloutBatch` that ``training_step`` trains on (and, for held-out
prompts, into an :class:`~lightning_offpolicy.batch.EvaluationBatch`) with whatever weights the
engine holds. Pushing weights, threads and staleness are the callers' business: the
:class:`~lightning_offpolicy.lightning.callback.RolloutCallback` in a Lightning fit, or any loop of
your own.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_offpolicy.batch import EvaluationBatch, PromptBatch, RolloutBatch
from lightning_offpolicy.data.rewards import DEFAULT_REWARD_TIMEOUT_S, score_completions
from lightning_offpolicy.preflight import check_prompt_fits
from lightning_offpolicy.rollout.advantages import compute_advantages
from lightning_offpolicy.rollout.dapo import DAPOSettings, informative_rows, overlong_penalty
from lightning_offpolicy.rollout.engine import Completion, RolloutEngine, SamplingConfig, prompt_seed
from lightning_offpolicy.rollout.episode import Episode, to_rollout_batch
from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings, SingleTurn
from lightning_offpolicy.rollout.partial import PartialStats, check_not_stopped, generate_resumable

__all__ = ["RolloutControls", "Rollouter", "batch_seed"]


def batch_seed(seed: int, index: int, rank: int, refill: int = 0) -> int:
    """The sampler seed of training batch ``index`` on rank ``rank`` (and of its ``refill``-th extra
    generation under dynamic sampling): distinct per batch, per rank and per refill."""
    return (seed * 1_000_003 + index * 9_973 + rank * 7_919 + refill * 104_729) % (2**31 - 1)


@dataclass
class _Samples:
    """The episodes of one or more generation calls, in order (a single-turn rollout: one turn each)."""

    episodes: list[Episode] = field(default_factory=list)

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


@dataclass(frozen=True)
class RolloutControls:
    """How the caller drives a :class:`Rollouter` from outside (each ``None``: not used).

    Attributes:
        more_prompts: Returns the next prompt batch to refill from (dynamic sampling; ``None``: no refill).
        turn: Partial rollouts: a context manager that grants the engine for one ``generate`` call
            between two weight pushes (the producer's ``generation_turn``); completions a push
            interrupts are continued under the new weights
            (:func:`~lightning_offpolicy.rollout.partial.generate_resumable`). ``None``: the caller
            holds the engine for the whole rollout.
        stop: Returns ``True`` once the rollout must stop (a preemption): a ``generate`` call it cut
            short is not continued (nor scored), and :meth:`Rollouter.rollout` and
            :meth:`Rollouter.evaluate` raise :class:`~lightning_offpolicy.rollout.partial.RolloutStopped`.
            ``None``: never.
    """

    more_prompts: Callable[[], PromptBatch] | None = None
    turn: Callable[[], AbstractContextManager[object]] | None = None
    stop: Callable[[], bool] | None = None


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
        reward_timeout_s: Longest one call of the reward function (of each part of a weighted
            reward) may take; past it the call is abandoned and a ``RewardError`` names the row it
            was scoring (:func:`~lightning_offpolicy.data.rewards.score_completions`). ``None``: no limit.
        episodes: Multi-turn episodes (tools or an environment, and their limits;
            :mod:`~lightning_offpolicy.rollout.multi_turn`), or a runner built from them once.
            ``None`` or nothing enabled: one turn each.
        controls: The refill prompts, the engine's turns and the stop the caller drives the rollout
            with (:class:`RolloutControls`; ``None``: none of them).

    After each :meth:`rollout`, :attr:`last_stats` holds its counts (``groups_dropped``,
    ``refill_batches``, ``groups_short``, ``overlong_filtered``; with ``turn``: ``interrupted_frac``,
    ``continuation_calls`` and ``tokens_per_version``; under a sampling mask ``support_unknown_frac``,
    the share of tokens whose kept support the engine could not tell; with ``episodes``
    :func:`~lightning_offpolicy.rollout.multi_turn.episode_stats`; only those of the features in use).
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
        reward_timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
        episodes: EpisodeSettings | EpisodeRunner | None = None,
        controls: RolloutControls | None = None,
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
        self.reward_timeout_s = reward_timeout_s
        controls = controls if controls is not None else RolloutControls()
        self.more_prompts, self.turn, self.stop = controls.more_prompts, controls.turn, controls.stop
        self._partial = PartialStats()
        self.last_stats: dict[str, float] = {}
        # What plays a batch's episodes: several turns, or one (single-turn rollouts are episodes of one turn).
        self.runner: EpisodeRunner | SingleTurn = SingleTurn(tokenizer, sampling.max_new_tokens)
        if isinstance(episodes, EpisodeRunner):
            self.runner = episodes
        elif isinstance(episodes, EpisodeSettings) and episodes.enabled:
            stop_ids = list(getattr(engine, "stop_ids", None) or [])
            if not stop_ids and getattr(tokenizer, "eos_token_id", None) is not None:
                stop_ids = [int(tokenizer.eos_token_id)]
            self.runner = EpisodeRunner(episodes, tokenizer, stop_ids)

    def encode(self, prompts: PromptBatch) -> list[list[int]]:
        """The prompts' token ids by the tokenizer's own rule (bos where it adds one; chat via its template);
        for episodes, through the chat template with the tools."""
        return self.runner.prompt_ids(prompts.prompts)

    def rollout(self, prompts: PromptBatch, index: int, rank: int = 0) -> tuple[RolloutBatch, float]:
        """Training batch ``index``: the scored rollout of ``prompts``, and the seconds generation took."""
        samples, generate_s = _Samples(), 0.0
        self._partial = PartialStats()
        generate_s += self._sample(samples, prompts, batch_seed(self.seed, index, rank), group_offset=0)
        rewards = samples.rewards()
        keep = torch.ones(len(samples.episodes), dtype=torch.bool)
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
        trained = [e for e, k in zip(samples.episodes, keep.tolist(), strict=True) if k]
        if self.sampling.support_needed:
            supports = [turn.completion.sampling_support for e in trained for turn in e.turns]
            unknown = sum(kept is None for support in supports for kept in support)
            single = sum(kept is not None and len(kept) == 1 for support in supports for kept in support)
            tokens = max(sum(e.model_tokens for e in trained), 1)
            stats["support_unknown_frac"] = unknown / tokens
            _warn_about_supports(unknown / tokens, single / tokens, self.sampling)
        stats.update(self.runner.stats(trained))
        if self.dapo.overlong_filter:
            cut = torch.tensor([e.truncated for e in trained])
            stats["overlong_filtered"] = float(cut.sum())
            if bool(cut.any()):
                out = (~cut).float().unsqueeze(-1)
                rollout = rollout.with_fields(
                    response_mask=rollout.response_mask * out, advantages=rollout.advantages * out
                )
        if self.turn is not None:
            stats.update(_partial_stats(self._partial, len(samples.episodes), rollout))
        self.last_stats = stats
        return rollout, generate_s

    def _generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None) -> list[Completion]:
        """One generation call, completions a weight push interrupted continued (partial rollouts)."""
        return generate_resumable(
            self.engine, prompt_ids, sampling, seed=seed, turn=self.turn, stats=self._partial, stop=self.stop
        )

    def _play(
        self,
        prompts: PromptBatch,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        seed: int | None,
        group_offset: int,
        generate: Callable[[list[list[int]], SamplingConfig, int | None], list[Completion]],
    ) -> list[Episode]:
        """The episodes of ``prompts``, unscored; the group of prompt ``i`` is ``group_offset + i``."""
        # An engine that batches concurrent calls itself plays each episode on its own.
        independent = int(getattr(self.engine, "concurrent_calls", 1))
        return self.runner.run(
            prompts.prompts, prompts.metadata, prompt_ids, sampling, generate, seed, group_offset, self.stop,
            concurrent_episodes=independent,
        )  # fmt: skip

    def _sample(self, samples: _Samples, prompts: PromptBatch, seed: int, group_offset: int) -> float:
        """Generate and score ``prompts`` into ``samples``; the seconds generation took."""
        prompt_ids = self.encode(prompts)
        started = time.perf_counter()
        budget, setting = self.runner.budget
        check_prompt_fits(max(map(len, prompt_ids), default=0), budget, self.context_limit, setting=setting)
        episodes = self._play(prompts, prompt_ids, self.sampling, seed, group_offset, self._generate)
        generate_s = time.perf_counter() - started
        scored = self._score(prompts, [e.group - group_offset for e in episodes], episodes)
        components = dict(scored.components or {})
        total = scored.total.to(torch.float64)
        if self.dapo.overlong_buffer > 0:
            lengths = torch.tensor([len(e.response_ids) for e in episodes])
            penalty = overlong_penalty(lengths, budget, self.dapo.overlong_buffer, self.dapo.overlong_penalty_factor)
            components["overlong_penalty"] = penalty
            total = total + penalty
        for i, episode in enumerate(episodes):
            episode.reward = float(total[i])
            episode.components = {name: float(values[i]) for name, values in components.items()}
        samples.episodes += episodes
        return generate_s

    def _build(self, samples: _Samples, rewards: torch.Tensor, keep: torch.Tensor) -> RolloutBatch:
        """The rollout batch of the kept episodes; group ids renumbered 0, 1, ... in their order."""
        rows = keep.nonzero().flatten().tolist()
        episodes = [samples.episodes[i] for i in rows]
        numbering = {g: n for n, g in enumerate(sorted({e.group for e in episodes}))}
        group_ids = torch.tensor([numbering[e.group] for e in episodes], dtype=torch.long)
        supports, unknown = self._supports(episodes)
        advantages = compute_advantages(self.advantage_estimator, rewards[rows], group_ids)
        rollout = to_rollout_batch(episodes, advantages, group_ids, self.tokenizer.pad_token_id, supports)
        if unknown is not None:
            rollout = _without_unknown_support(rollout, unknown)
        return rollout

    def _supports(self, episodes: list[Episode]) -> tuple[list[list[list[int]]] | None, list[list[bool]] | None]:
        """The episodes' kept supports under top-k / top-p (``[]`` at ids the environment appended), and
        which tokens the engine could not tell them for (``None, None`` without a sampling mask).

        Raises:
            ValueError: top-k / top-p is on and the engine did not report what its sampler kept:
                every ratio would then carry the log of the kept mass.
        """
        if not self.sampling.support_needed:
            return None, None
        per_episode = [e.sampling_supports() for e in episodes]
        if any(support is None for support in per_episode):
            raise ValueError(
                f"SamplingConfig(top_k={self.sampling.top_k}, top_p={self.sampling.top_p}) cuts the sampling "
                f"distribution, but {type(self.engine).__name__} did not report which tokens it kept "
                "(Completion.sampling_support), so the trainer cannot renormalize pi_prox / pi_theta over the "
                "same support and every importance ratio would be biased by the mass cut off. Use an engine "
                "that reports it (HFEngine, HFProcessEngine, VLLMEngine, RemoteVLLMEngine), or set top_k=0 and "
                "top_p=1.0 (or sampling_mask=False, for a comparison only)."
            )
        unknown = [[kept is None for kept in support] for support in per_episode]
        supports = [[kept or [] for kept in support] for support in per_episode]
        return supports, unknown

    def evaluate(self, prompts: PromptBatch) -> EvaluationBatch:
        """One greedy and ``samples_per_prompt`` sampled episodes per held-out prompt, scored.

        Each prompt is sampled in its own call, seeded by its text: the same samples at every
        evaluation, whatever the batch size or the number of ranks.
        """
        prompt_ids = self.encode(prompts)
        greedy_sampling = SamplingConfig(max_new_tokens=self.sampling.max_new_tokens, samples_per_prompt=1, greedy=True)

        def direct(ids: list[list[int]], sampling: SamplingConfig, seed: int | None) -> list[Completion]:
            return self.engine.generate(ids, sampling, seed=seed)

        greedy = self._play(prompts, prompt_ids, greedy_sampling, None, 0, direct)
        # Episodes a preemption cut short would be scored as if whole: the evaluation stops instead.
        check_not_stopped(self.stop, "evaluation")
        sampled: list[Episode] = []
        for index, (text, ids) in enumerate(zip(prompts.prompts, prompt_ids, strict=True)):
            one = PromptBatch(prompts=[text], metadata=[prompts.metadata[index]])
            sampled += self._play(one, [ids], self.sampling, prompt_seed(self.seed, text), index, direct)
            check_not_stopped(self.stop, "evaluation")
        k, num = self.sampling.samples_per_prompt, len(prompts)
        episodes = [*greedy, *sampled]
        rewards = self._score(prompts, [e.group for e in episodes], episodes).total.tolist()
        lengths = [e.model_tokens for e in episodes]
        return EvaluationBatch.from_scores(
            greedy_rewards=rewards[:num],
            sampled_rewards=[rewards[num + i * k : num + (i + 1) * k] for i in range(num)],
            greedy_lengths=lengths[:num],
            sampled_lengths=[lengths[num + i * k : num + (i + 1) * k] for i in range(num)],
            success_threshold=self.success_threshold,
        )

    def _score(self, prompts: PromptBatch, owners: Sequence[int], episodes: Sequence[Episode]) -> Any:
        """The reward of each episode: its last turn's text, with what the reward is told about the episode."""
        texts = [self.tokenizer.decode(e.completion.token_ids) for e in episodes]
        metadata = [self.runner.reward_metadata(e, prompts.metadata[i]) for e, i in zip(episodes, owners, strict=True)]
        return score_completions(
            self.reward_fn,
            [prompts.prompts[i] for i in owners],
            texts,
            metadata,
            timeout_s=self.reward_timeout_s,
        )


#: Above this share of sampled tokens with an unknown kept set, a batch's loss misses a part worth a warning.
UNKNOWN_SUPPORT_WARNING = 0.05
_warned: set[str] = set()  # each warning once per process: a fit builds its rollouter again at the train start


def _warn_about_supports(unknown: float, single: float, sampling: SamplingConfig) -> None:
    """Warn once when the sampling mask leaves much of a batch out of the loss, or keeps one token everywhere."""
    if unknown > UNKNOWN_SUPPORT_WARNING and "unknown" not in _warned:
        _warned.add("unknown")
        warnings.warn(
            f"{unknown:.0%} of a batch's sampled tokens have no known kept set under top_k={sampling.top_k}, "
            f"top_p={sampling.top_p} (rollout/support_unknown_frac): the engine's workers do not record the kept "
            "sets (a vLLM server started without the kit's receiver) and its top logprobs showed fewer candidates "
            "than the sampler kept (a nucleus wider than its support_logprobs), so those tokens leave the loss. Start "
            "the server with --worker-extension-cls lightning_offpolicy.rollout.vllm.worker_extension."
            "SharedWeightsReceiver, raise the engine's support_logprobs, use a top_k it can report, or top_p closer "
            "to 1.",
            stacklevel=3,
        )
    if single >= 1.0 and "single" not in _warned:
        _warned.add("single")
        warnings.warn(
            f"Every sampled token of a batch was the only one its sampler kept (top_k={sampling.top_k}, "
            f"top_p={sampling.top_p}): decoding is greedy, and under the sampling mask every kept token's logprob "
            "is 0, so nothing trains (train/grad_norm 0). Raise top_p (or top_k) so that more than one token is kept.",
            stacklevel=3,
        )
