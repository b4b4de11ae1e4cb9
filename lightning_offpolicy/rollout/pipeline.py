"""The rollout pipeline without Lightning: prompts -> token ids -> completions -> rewards -> advantages.

:class:`Rollouter` turns a :class:`~lightning_offpolicy.batch.PromptBatch` into the
:class:`~lightning_offpolicy.batch.RolloutBatch` that ``training_step`` trains on (and, for held-out
prompts, into an :class:`~lightning_offpolicy.evaluation.EvaluationBatch`) with whatever weights the
engine holds. Pushing weights, threads and staleness are the callers' business: the
:class:`~lightning_offpolicy.rollout.callback.RolloutCallback` in a Lightning fit, or any loop of
your own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_offpolicy.advantages import compute_advantages
from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.evaluation import EvaluationBatch, prompt_seed
from lightning_offpolicy.preflight import check_prompt_fits
from lightning_offpolicy.rewards import score_completions
from lightning_offpolicy.rollout.engine import Completion, RolloutEngine, SamplingConfig
from lightning_offpolicy.tokenizers import encode_prompt

__all__ = ["Rollouter", "batch_seed"]


def batch_seed(seed: int, index: int, rank: int) -> int:
    """The sampler seed of training batch ``index`` on rank ``rank``: distinct per batch and per rank."""
    return (seed * 1_000_003 + index * 9_973 + rank * 7_919) % (2**31 - 1)


class Rollouter:
    """Generate, score and build the batches of one engine's samples.

    Args:
        engine: Any :class:`~lightning_offpolicy.rollout.engine.RolloutEngine`, with the weights to
            sample from already in it.
        tokenizer: Encodes prompts by its own rule (:func:`~lightning_offpolicy.tokenizers.encode_prompt`),
            decodes completions for the reward, and gives ``pad_token_id``.
        reward_fn: ``(prompts, completions, metadata) -> rewards``, one float per completion.
        sampling: How training rollouts are sampled (``samples_per_prompt`` is the advantage group).
        advantage_estimator: One of :data:`~lightning_offpolicy.advantages.ADVANTAGE_ESTIMATORS`.
        seed: Base seed: training batch ``j`` on rank ``r`` samples with :func:`batch_seed`; each
            held-out prompt with a seed of its text.
        context_limit: ``(tokens, where the limit comes from)`` of the model's context, checked against
            the longest prompt + ``max_new_tokens`` before generating (``None``: not checked).
        success_threshold: Held-out evaluation: the reward a sample needs for its prompt to pass.
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
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.advantage_estimator = advantage_estimator
        self.seed = seed
        self.context_limit = context_limit
        self.success_threshold = success_threshold

    def encode(self, prompts: PromptBatch) -> list[list[int]]:
        """The prompts' token ids by the tokenizer's own rule (bos where it adds one; chat via its template)."""
        return [encode_prompt(self.tokenizer, prompt) for prompt in prompts.prompts]

    def rollout(self, prompts: PromptBatch, index: int, rank: int = 0) -> tuple[RolloutBatch, float]:
        """Training batch ``index``: the scored rollout of ``prompts``, and the seconds generation took."""
        prompt_ids = self.encode(prompts)
        started = time.perf_counter()
        check_prompt_fits(max(map(len, prompt_ids), default=0), self.sampling.max_new_tokens, self.context_limit)
        completions = self.engine.generate(prompt_ids, self.sampling, seed=batch_seed(self.seed, index, rank))
        generate_s = time.perf_counter() - started
        owners = [c.prompt_index for c in completions]
        scored = self._score(prompts, owners, completions)
        rewards = scored.total.float()
        group_ids = torch.tensor(owners, dtype=torch.long)
        rollout = RolloutBatch.from_sequences(
            prompt_ids=[prompt_ids[i] for i in owners],
            response_ids=[c.token_ids for c in completions],
            rewards=rewards,
            advantages=compute_advantages(self.advantage_estimator, rewards, group_ids),
            group_ids=group_ids,
            policy_versions=[c.policy_version for c in completions],
            rollout_logprobs=None
            if any(c.logprobs is None for c in completions)
            else [c.logprobs for c in completions],
            pad_token_id=self.tokenizer.pad_token_id,
        )
        if scored.components:
            rollout = rollout.with_fields(reward_components={k: v.float() for k, v in scored.components.items()})
        return rollout, generate_s

    def evaluate(self, prompts: PromptBatch) -> EvaluationBatch:
        """One greedy and ``samples_per_prompt`` sampled completions per held-out prompt, scored.

        Each prompt is sampled in its own call, seeded by its text: the same samples at every
        evaluation, whatever the batch size or the number of ranks.
        """
        prompt_ids = self.encode(prompts)
        greedy_sampling = SamplingConfig(max_new_tokens=self.sampling.max_new_tokens, samples_per_prompt=1, greedy=True)
        greedy = self.engine.generate(prompt_ids, greedy_sampling)
        sampled: list[Completion] = []
        for text, ids in zip(prompts.prompts, prompt_ids, strict=True):
            sampled += self.engine.generate([ids], self.sampling, seed=prompt_seed(self.seed, text))
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
            self.reward_fn, [prompts.prompts[i] for i in owners], texts, [prompts.metadata[i] for i in owners]
        )
