"""Batches that flow from the prompt DataModule through the RolloutCallback into training_step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

_F64 = torch.float64


@dataclass
class EvaluationBatch:
    """The scored held-out evaluation completions of one batch of ``P`` prompts
    (:class:`~lightning_offpolicy.metrics.evaluation.EvaluationMetrics` accumulates them).

    Attributes:
        greedy_rewards: ``[P]`` reward of each prompt's greedy completion.
        sampled_rewards: ``[P, k]`` rewards of the ``k`` sampled completions of each prompt.
        passed: ``[P]`` whether some sample reached the success threshold (pass@k).
        greedy_lengths: ``[P]`` greedy completion lengths in tokens.
        sampled_lengths: ``[P, k]`` sampled completion lengths in tokens.
    """

    greedy_rewards: torch.Tensor
    sampled_rewards: torch.Tensor
    passed: torch.Tensor
    greedy_lengths: torch.Tensor
    sampled_lengths: torch.Tensor

    @classmethod
    def from_scores(
        cls,
        greedy_rewards: list[float],
        sampled_rewards: list[list[float]],
        greedy_lengths: list[int],
        sampled_lengths: list[list[int]],
        success_threshold: float,
    ) -> EvaluationBatch:
        """Build the batch; a prompt passes when any of its samples has reward ``>= success_threshold``."""
        sampled = torch.tensor(sampled_rewards, dtype=_F64)
        return cls(
            greedy_rewards=torch.tensor(greedy_rewards, dtype=_F64),
            sampled_rewards=sampled,
            passed=(sampled >= success_threshold).any(dim=-1),
            greedy_lengths=torch.tensor(greedy_lengths, dtype=_F64),
            sampled_lengths=torch.tensor(sampled_lengths, dtype=_F64),
        )


@dataclass
class PromptBatch:
    """One step's prompts, as the prompt DataLoader yields them.

    The :class:`~lightning_offpolicy.lightning.callback.RolloutCallback` attaches the generated, scored
    :class:`RolloutBatch` to ``rollout`` in ``on_train_batch_start``, with the weights of that
    very step, before ``training_step`` receives the batch.

    Attributes:
        prompts: prompt texts, or chat ``messages`` lists (``[{"role": ..., "content": ...}, ...]``,
            rendered by the tokenizer's chat template; see
            :meth:`~lightning_offpolicy.data.tokenizers.HFTokenizer.encode_prompt`).
        metadata: one dict per prompt for the reward function (e.g. the expected answer).
        rollout: the rollouts of these prompts, filled in by the callback.
        evaluation: in a validation batch, the scored greedy and sampled completions
            (:class:`EvaluationBatch`), filled in by the callback.
    """

    prompts: list[str | list[dict[str, Any]]]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    rollout: RolloutBatch | None = None
    evaluation: EvaluationBatch | None = None

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"PromptBatch: {len(self.prompts)} prompts but {len(self.metadata)} metadata entries.")

    def __len__(self) -> int:
        return len(self.prompts)


# Per-token fields: [B, T] over the response columns; all of them travel with every split.
TOKEN_FIELDS = (
    "response_mask",
    "advantages",
    "rollout_logprobs",
    "prox_logprobs",
    "ref_logprobs",
    "policy_version",
    "is_weights",
    "correction_mask",
)
# Per-token sets: [B, T, K] over the response columns, K ids per token (-1: none); split like the
# per-token fields.
SUPPORT_FIELDS = ("sampling_support",)
# Per-sequence fields: [B].
SEQUENCE_FIELDS = ("rewards", "group_ids")
# Full-width fields: [B, L] over prompt and response.
WIDTH_FIELDS = ("input_ids", "attention_mask")


@dataclass
class RolloutBatch:
    """Scored rollouts ready for a training step.

    Layout: ``input_ids[:, :prompt_length]`` is the prompt, left-padded;
    ``input_ids[:, prompt_length:]`` is the response (``T`` columns), right-padded. Per-token fields
    are ``[B, T]`` over the response columns; padding is wherever ``response_mask == 0``.

    Attributes:
        input_ids: ``[B, L]`` token ids, ``L = prompt_length + T``.
        attention_mask: ``[B, L]`` 1 on real tokens (prompt and response).
        response_mask: ``[B, T]`` 1 on response tokens the loss may use.
        prompt_length: ``P``, the column where the response starts.
        rewards: ``[B]`` scalar reward per sequence.
        advantages: ``[B, T]`` per-token advantages.
        group_ids: ``[B]`` samples of the same prompt share an id.
        policy_version: ``[B, T]`` version of the weights that generated each token (-1 at padding).
        rollout_logprobs: ``[B, T]`` engine logprobs of the sampled tokens (``pi_rollout``).
        prox_logprobs: ``[B, T]`` trainer logprobs at the start of the step (``pi_prox``).
        ref_logprobs: ``[B, T]`` reference-policy logprobs.
        is_weights: ``[B, T]`` IS weights of the correction (set by the module).
        correction_mask: ``[B, T]`` response mask times every rejection mask (set by the module).
        reward_components: ``name -> [B]`` reward of each part of a weighted reward (for the
            ``reward/<name>`` logs); None for a single reward function.
        sampling_support: ``[B, T, K]`` under top-k / top-p sampling, the ids of the tokens the
            engine's sampler kept at each response position, left-packed and padded with -1 (a
            position with none stands for the whole vocabulary); the trainer renormalizes
            ``pi_prox``, ``pi_theta`` and the reference over it (docs/off_policy_correction.md,
            "Sampling masks"). ``None``: nothing was cut.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    rewards: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    policy_version: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    prox_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    correction_mask: torch.Tensor | None = None
    reward_components: dict[str, torch.Tensor] | None = None
    sampling_support: torch.Tensor | None = None

    def __post_init__(self) -> None:
        batch, width = self.input_ids.shape
        response = width - self.prompt_length
        if not 0 < self.prompt_length < width and not (self.prompt_length == 0 and width > 0):
            raise ValueError(f"RolloutBatch: prompt_length={self.prompt_length} outside the width {width}.")
        expected = {name: (batch, response) for name in TOKEN_FIELDS}
        expected.update({name: (batch,) for name in SEQUENCE_FIELDS})
        expected.update({name: (batch, width) for name in WIDTH_FIELDS})
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(value.shape)}; expected {shape}.")
        support = self.sampling_support
        if support is not None and (support.dim() != 3 or tuple(support.shape[:2]) != (batch, response)):
            raise ValueError(
                f"RolloutBatch.sampling_support has shape {tuple(support.shape)}; expected {(batch, response)} + (K,)."
            )
        for name, value in (self.reward_components or {}).items():
            if tuple(value.shape) != (batch,):
                raise ValueError(
                    f"RolloutBatch.reward_components[{name!r}] has shape {tuple(value.shape)}; expected {(batch,)}."
                )

    # ------------------------------------------------------------------------------ properties
    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.input_ids.shape[1] - self.prompt_length

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    # ------------------------------------------------------------------------------ transforms
    def _map(self, fn_token, fn_sequence, fn_width, **changes: Any) -> RolloutBatch:
        values: dict[str, Any] = {}
        for name in TOKEN_FIELDS + SUPPORT_FIELDS + SEQUENCE_FIELDS + WIDTH_FIELDS:
            value = getattr(self, name)
            per_token = name in TOKEN_FIELDS or name in SUPPORT_FIELDS
            fn = fn_token if per_token else fn_sequence if name in SEQUENCE_FIELDS else fn_width
            values[name] = None if value is None else fn(value)
        values["prompt_length"] = self.prompt_length
        if self.reward_components is not None:
            values["reward_components"] = {k: fn_sequence(v) for k, v in self.reward_components.items()}
        values.update(changes)
        return RolloutBatch(**values)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        move = lambda t: t.to(device)  # noqa: E731
        return self._map(move, move, move)

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """The given rows, every field included."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        take = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        return self._map(take, take, take)

    def trim(self) -> RolloutBatch:
        """Drop prompt columns that are padding in every row and trailing all-padding response columns."""
        prompt_real = self.attention_mask[:, : self.prompt_length].bool().any(dim=0)
        first = int(prompt_real.float().argmax()) if bool(prompt_real.any()) else self.prompt_length - 1
        first = min(first, max(self.prompt_length - 1, 0))
        response_real = self.response_mask.bool().any(dim=0)
        keep = int(response_real.nonzero().max()) + 1 if bool(response_real.any()) else 1
        cut_token = lambda t: t[:, :keep]  # noqa: E731
        cut_width = lambda t: t[:, first : self.prompt_length + keep]  # noqa: E731
        trimmed = self._map(cut_token, lambda t: t, cut_width, prompt_length=self.prompt_length - first)
        if trimmed.sampling_support is not None:  # left-packed: the widest kept set bounds K
            widest = int((trimmed.sampling_support >= 0).sum(-1).max()) if trimmed.sampling_support.numel() else 0
            trimmed = replace(trimmed, sampling_support=trimmed.sampling_support[..., :widest])
        return trimmed

    def as_padding(self) -> RolloutBatch:
        """A copy that carries every field but contributes nothing: ``response_mask`` all 0.

        Padding micro-batches are built from real rows so that no optional per-token field can be
        missing on them (SkyRL #1811: a hard-coded key set dropped ``rollout_logprobs``).
        """
        zeros = torch.zeros_like(self.response_mask)
        correction_mask = None if self.correction_mask is None else torch.zeros_like(self.correction_mask)
        return replace(self, response_mask=zeros, correction_mask=correction_mask)

    def with_fields(self, **changes: Any) -> RolloutBatch:
        """A validated copy with ``changes`` applied (e.g. ``prox_logprobs=...``)."""
        return replace(self, **changes)

    # ------------------------------------------------------------------------------ splitting
    def split(self, num_parts: int, generator: torch.Generator | None = None) -> list[RolloutBatch]:
        """``num_parts`` mini-batches of (nearly) equal row counts, rows shuffled when ``generator`` is given."""
        if num_parts < 1 or num_parts > self.num_sequences:
            raise ValueError(
                f"cannot split {self.num_sequences} sequences into num_parts={num_parts} mini-batches; "
                "lower num_minibatches or raise the number of rollouts per step."
            )
        order = (
            torch.randperm(self.num_sequences, generator=generator)
            if generator is not None
            else torch.arange(self.num_sequences)
        )
        return [self.select(part) for part in torch.tensor_split(order, num_parts)]

    def micro_batch_rows(self, max_tokens: int, packed: bool = False) -> list[list[int]]:
        """Row indices of each micro-batch of at most ``max_tokens`` tokens.

        Rows are grouped greedily in order. A padded micro-batch costs ``rows x (longest prompt +
        longest response)`` of its rows; a ``packed`` one (its rows concatenated, no padding: see
        :mod:`lightning_offpolicy.logprobs.packed`) costs the sum of its rows' real tokens. A single
        row longer than the budget forms its own micro-batch.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1.")
        if packed:
            return _greedy_groups(self.attention_mask.sum(dim=-1).tolist(), max_tokens)
        prompt_lengths = self.attention_mask[:, : self.prompt_length].sum(dim=-1).tolist()
        response_lengths = _last_true_plus_one(self.response_mask).tolist()
        groups: list[list[int]] = []
        longest_prompt = longest_response = 0
        for row, (p_len, r_len) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
            new_prompt, new_response = max(longest_prompt, p_len), max(longest_response, r_len)
            if groups and (len(groups[-1]) + 1) * (new_prompt + new_response) <= max_tokens:
                groups[-1].append(row)
                longest_prompt, longest_response = new_prompt, new_response
            else:
                groups.append([row])
                longest_prompt, longest_response = p_len, r_len
        return groups

    def micro_batches(
        self,
        max_tokens: int,
        num_micro_batches: int | None = None,
        rows: list[list[int]] | None = None,
        packed: bool = False,
    ) -> list[RolloutBatch]:
        """Split rows into micro-batches of at most ``max_tokens`` tokens each (see :meth:`micro_batch_rows`).

        With ``num_micro_batches`` (e.g. the maximum over DDP ranks, so every rank runs the same
        number of forward/backward passes) the list is completed with padding micro-batches
        (:meth:`as_padding`), which carry every per-token field and change nothing. ``rows`` passes
        a grouping already computed by :meth:`micro_batch_rows`; ``packed`` budgets real tokens
        (the micro-batches keep the padded layout: the forward packs them).
        """
        groups = rows if rows is not None else self.micro_batch_rows(max_tokens, packed=packed)
        micro = [self.select(group).trim() for group in groups]
        if num_micro_batches is not None:
            if num_micro_batches < len(micro):
                raise ValueError(
                    f"num_micro_batches={num_micro_batches} is less than the {len(micro)} this batch needs."
                )
            micro += [self.select([0]).trim().as_padding() for _ in range(num_micro_batches - len(micro))]
        return micro

    # ------------------------------------------------------------------------------ validation
    def validate(self, require_rollout_logprobs: bool = True) -> None:
        """Fail fast, on the driver, with the setting to change; never deep inside a loss."""
        if require_rollout_logprobs and self.rollout_logprobs is None:
            raise ValueError(
                "RolloutBatch has no rollout_logprobs, but the off-policy correction needs the engine's "
                "per-token logprobs. Turn on logprob return in the rollout engine (HFEngine returns them "
                "always; VLLMEngine: SamplingParams(logprobs=0))."
            )
        if self.input_ids.dtype != torch.long:
            raise ValueError(f"RolloutBatch.input_ids must be torch.long; got {self.input_ids.dtype}.")
        real = self.response_mask.bool()
        for name in ("rollout_logprobs", "prox_logprobs", "ref_logprobs", "advantages"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value.is_floating_point():
                raise ValueError(f"RolloutBatch.{name} must be a floating tensor; got {value.dtype}.")
            if name == "advantages":
                bad = int((~torch.isfinite(value) & real).sum())
                what = "NaN / inf"
            else:
                # A logprob of -inf is a token that policy calls impossible (vLLM returns it under
                # top-k / top-p): correction/ clamps it and its masks reject the token. NaN and +inf
                # are never a logprob.
                bad = int(((torch.isnan(value) | (value == float("inf"))) & real).sum())
                what = "NaN / +inf"
            if bad:
                raise ValueError(f"RolloutBatch.{name} has {bad} {what} value(s) at response tokens.")
        if self.sampling_support is not None:
            support = self.sampling_support
            if support.dtype != torch.long:
                raise ValueError(f"RolloutBatch.sampling_support must be torch.long; got {support.dtype}.")
            sampled = self.input_ids[:, self.prompt_length :, None]
            cut = (support >= 0).any(-1)
            missing = int((cut & ~(support == sampled).any(-1) & real).sum())
            if missing:
                raise ValueError(
                    f"RolloutBatch.sampling_support misses the sampled token at {missing} response position(s): "
                    "the engine's kept support and its tokens disagree."
                )
            ordered = support.sort(dim=-1).values
            repeated = int((((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1) & real).sum())
            if repeated:
                raise ValueError(
                    f"RolloutBatch.sampling_support lists a token twice at {repeated} response position(s): its "
                    "mass would count twice in the renormalization."
                )
        bad_rewards = int((~torch.isfinite(self.rewards)).sum())
        if bad_rewards:
            raise ValueError(f"RolloutBatch.rewards has {bad_rewards} NaN / inf value(s); check the reward function.")

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_sequences(
        cls,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        rewards: list[float] | torch.Tensor,
        advantages: torch.Tensor,
        group_ids: list[int] | torch.Tensor,
        policy_versions: list[list[int]] | list[int],
        rollout_logprobs: list[list[float]] | None,
        pad_token_id: int,
        sampling_supports: list[list[list[int]]] | None = None,
        response_masks: list[list[float]] | None = None,
    ) -> RolloutBatch:
        """Pad ragged prompts (left) and responses (right) into a batch.

        ``advantages`` is ``[B]`` (broadcast over each response) or ``[B, T]``;
        ``policy_versions`` is one version per sequence or one per token; ``sampling_supports``,
        under top-k / top-p, the kept ids of each response token (``[]``: the whole vocabulary),
        become the ``[B, T, K]`` ``sampling_support``. ``response_masks``: one 0 / 1 per response
        token (0: context the model did not sample, e.g. a tool's result in an episode); ``None``:
        every response token is trained.
        """
        batch = len(prompt_ids)
        if not (len(response_ids) == batch and len(group_ids) == batch and len(rewards) == batch):
            raise ValueError("from_sequences: prompt_ids, response_ids, rewards and group_ids differ in length.")
        prompt_length = max(1, max((len(p) for p in prompt_ids), default=1))
        response_length = max(1, max((len(r) for r in response_ids), default=1))
        input_ids = torch.full((batch, prompt_length + response_length), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        response_mask = torch.zeros(batch, response_length)
        versions = torch.full((batch, response_length), -1, dtype=torch.long)
        logprobs = None if rollout_logprobs is None else torch.zeros(batch, response_length)
        for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            start = prompt_length - len(prompt)
            input_ids[i, start:prompt_length] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, start:prompt_length] = 1
            n = len(response)
            if n:
                input_ids[i, prompt_length : prompt_length + n] = torch.tensor(response, dtype=torch.long)
                attention_mask[i, prompt_length : prompt_length + n] = 1
                if response_masks is None:
                    response_mask[i, :n] = 1
                else:
                    if len(response_masks[i]) != n:
                        raise ValueError(
                            f"from_sequences: row {i} has {n} response tokens but {len(response_masks[i])} mask values."
                        )
                    response_mask[i, :n] = torch.tensor(response_masks[i], dtype=response_mask.dtype)
                version = policy_versions[i]
                versions[i, :n] = torch.as_tensor(version, dtype=torch.long)
                if logprobs is not None:
                    if len(rollout_logprobs[i]) != n:
                        raise ValueError(
                            f"from_sequences: row {i} has {n} response tokens but {len(rollout_logprobs[i])} logprobs."
                        )
                    logprobs[i, :n] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        support = (
            None if sampling_supports is None else _packed_support(sampling_supports, response_ids, response_length)
        )
        advantages = torch.as_tensor(advantages, dtype=torch.float32)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1).expand(batch, response_length).clone()
        advantages = advantages * response_mask
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            prompt_length=prompt_length,
            rewards=torch.as_tensor(rewards, dtype=torch.float32),
            advantages=advantages,
            group_ids=torch.as_tensor(group_ids, dtype=torch.long),
            policy_version=versions,
            rollout_logprobs=logprobs,
            sampling_support=support,
        )


def _packed_support(
    supports: list[list[list[int]]], response_ids: list[list[int]], response_length: int
) -> torch.Tensor:
    """``[B, T, K]`` kept ids per response token, left-packed, -1 elsewhere (``K``: the widest kept set)."""
    if len(supports) != len(response_ids):
        raise ValueError(f"from_sequences: {len(response_ids)} responses but {len(supports)} sampling supports.")
    for i, (row, response) in enumerate(zip(supports, response_ids, strict=True)):
        if len(row) != len(response):
            raise ValueError(f"from_sequences: row {i} has {len(response)} response tokens but {len(row)} supports.")
    widest = max((len(kept) for row in supports for kept in row), default=0)
    out = torch.full((len(supports), response_length, widest), -1, dtype=torch.long)
    rows, columns, slots, ids = [], [], [], []
    for i, row in enumerate(supports):
        for t, kept in enumerate(row):
            rows += [i] * len(kept)
            columns += [t] * len(kept)
            slots += range(len(kept))
            ids += kept
    out[rows, columns, slots] = torch.tensor(ids, dtype=torch.long)
    return out


def _last_true_plus_one(mask: torch.Tensor) -> torch.Tensor:
    """Per row, one past the last non-zero column (0 for an empty row)."""
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (mask.bool() * columns).amax(dim=-1)


def _greedy_groups(costs: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices grouped while their costs sum to at most ``budget`` (one index at least per group)."""
    groups: list[list[int]] = []
    total = 0
    for index, cost in enumerate(costs):
        if groups and total + cost <= budget:
            groups[-1].append(index)
            total += cost
        else:
            groups.append([index])
            total = cost
    return groups
