"""RolloutBatch: padding layout, splits, token-budget micro-batches and the padding micro-batch regression."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_offpolicy.batch import SEQUENCE_FIELDS, SUPPORT_FIELDS, TOKEN_FIELDS, WIDTH_FIELDS, RolloutBatch
from lightning_offpolicy.correction import (
    CorrectionOutput,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)


def small_batch() -> RolloutBatch:
    return RolloutBatch.from_sequences(
        prompt_ids=[[5, 6], [7], [8, 9, 10]],
        response_ids=[[11, 12, 2], [13], [14, 15]],
        rewards=[1.0, 0.0, 0.5],
        advantages=torch.tensor([0.5, -0.5, 0.0]),
        group_ids=[0, 0, 1],
        policy_versions=[3, 3, [2, 3]],
        rollout_logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6]],
        pad_token_id=0,
    )


def test_from_sequences_layout():
    batch = small_batch()
    assert batch.prompt_length == 3 and batch.response_length == 3
    assert batch.input_ids.tolist() == [[0, 5, 6, 11, 12, 2], [0, 0, 7, 13, 0, 0], [8, 9, 10, 14, 15, 0]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch.policy_version.tolist() == [[3, 3, 3], [3, -1, -1], [2, 3, -1]]
    assert batch.advantages.tolist() == [[0.5, 0.5, 0.5], [-0.5, 0, 0], [0, 0, 0]]
    assert batch.num_response_tokens == 6


def test_select_trim_keep_every_field_aligned():
    batch = small_batch().with_fields(prox_logprobs=torch.randn(3, 3), is_weights=torch.rand(3, 3))
    one = batch.select([1]).trim()
    assert one.input_ids.tolist() == [[7, 13]] and one.prompt_length == 1
    for name in TOKEN_FIELDS:
        value = getattr(one, name)
        if value is not None:
            assert value.shape == (1, 1), name
    assert one.prox_logprobs.item() == batch.prox_logprobs[1, 0].item()


def test_micro_batches_respect_the_token_budget_and_cover_every_row():
    batch = small_batch()
    # Row costs: prompt + response = 5, 2, 5. Budget 8: [0] (2 rows would cost 2*5), [1, 2]? 2*(3+2)=10 > 8.
    groups = batch.micro_batch_rows(8)
    assert sorted(i for g in groups for i in g) == [0, 1, 2]
    for rows in groups:
        micro = batch.select(rows).trim()
        assert len(rows) == 1 or micro.input_ids.numel() <= 8
    assert batch.micro_batch_rows(100) == [[0, 1, 2]]
    assert batch.micro_batch_rows(1) == [[0], [1], [2]]


def test_padding_micro_batch_carries_every_per_token_field():
    # Regression for SkyRL #1811: padding micro-batches were built from a hard-coded key set and
    # lost rollout_logprobs, so the rollout KL loss saw None on them and raised.
    batch = small_batch().with_fields(
        prox_logprobs=torch.randn(3, 3),
        ref_logprobs=torch.randn(3, 3),
        is_weights=torch.rand(3, 3),
        correction_mask=torch.ones(3, 3),
        reward_components={"acc": torch.tensor([1.0, 0.0, 1.0])},
        sampling_support=torch.tensor(
            [[[11, 3], [12, -1], [2, 4]], [[13, -1], [-1, -1], [-1, -1]], [[14, 1], [15, -1], [-1, -1]]]
        ),
    )
    micro = batch.micro_batches(max_tokens=100, num_micro_batches=3)
    assert len(micro) == 3
    padding = micro[-1]
    for name in TOKEN_FIELDS + SUPPORT_FIELDS + SEQUENCE_FIELDS + WIDTH_FIELDS:
        assert getattr(padding, name) is not None, f"padding micro-batch lost {name}"
    assert padding.response_mask.sum() == 0 and padding.correction_mask.sum() == 0
    assert padding.reward_components is not None and padding.reward_components["acc"].shape == (1,)
    # Every field of the dataclass is covered by one of the lists (or carried by _map itself).
    fields = TOKEN_FIELDS + SUPPORT_FIELDS + SEQUENCE_FIELDS + WIDTH_FIELDS
    covered = set(fields) | {"prompt_length", "reward_components"}
    assert covered == {f.name for f in dataclasses.fields(RolloutBatch)}

    # The loss with the rollout KL term runs on it, is exactly 0, and gives zero gradients.
    logprobs = padding.rollout_logprobs.clone().requires_grad_(True)
    correction = CorrectionOutput(padding.is_weights, padding.correction_mask, None, OffPolicyCorrectionConfig())
    loss, _ = policy_loss(
        logprobs,
        padding.prox_logprobs,
        padding.rollout_logprobs,
        padding.advantages,
        padding.response_mask,
        PolicyLossConfig(rollout_kl_coef=0.3, ref_kl_coef=0.2),
        correction=correction,
        ref_logprobs=padding.ref_logprobs,
        token_count=6.0,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logprobs.grad) == 0


def test_micro_batched_loss_sums_to_the_full_batch_loss():
    batch = small_batch()
    prox = batch.rollout_logprobs + 0.1
    batch = batch.with_fields(prox_logprobs=prox)
    cfg = OffPolicyCorrectionConfig.token_tis(clip_high=1.05)
    out = compute_correction(prox, batch.rollout_logprobs, batch.response_mask, cfg)
    batch = batch.with_fields(is_weights=out.weights, correction_mask=out.mask)
    logprobs = prox + 0.05
    full, _ = policy_loss(logprobs, prox, batch.rollout_logprobs, batch.advantages, batch.response_mask, correction=out)
    total = 0.0
    for micro in batch.micro_batches(max_tokens=5, num_micro_batches=4):
        micro_out = CorrectionOutput(micro.is_weights, micro.correction_mask, None, cfg)
        part, _ = policy_loss(
            micro.prox_logprobs + 0.05,
            micro.prox_logprobs,
            micro.rollout_logprobs,
            micro.advantages,
            micro.response_mask,
            correction=micro_out,
            token_count=float(batch.num_response_tokens),
        )
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-6, abs=1e-7)


def test_split_into_minibatches():
    batch = small_batch()
    parts = batch.split(2)
    assert [p.num_sequences for p in parts] == [2, 1]
    shuffled = batch.split(3, generator=torch.Generator().manual_seed(0))
    assert sorted(p.rewards.item() for p in shuffled) == sorted(batch.rewards.tolist())
    with pytest.raises(ValueError, match="num_minibatches"):
        batch.split(4)


def test_validation_errors_name_the_field():
    batch = small_batch()
    with pytest.raises(ValueError, match="SamplingParams\\(logprobs=0\\)"):
        batch.with_fields(rollout_logprobs=None).validate()
    batch.with_fields(rollout_logprobs=None).validate(require_rollout_logprobs=False)
    bad = batch.advantages.clone()
    bad[2, 1] = float("inf")
    with pytest.raises(ValueError, match="advantages has 1 NaN"):
        batch.with_fields(advantages=bad).validate()
    # Garbage in padding is fine.
    garbage = batch.rollout_logprobs.clone()
    garbage[1, 2] = float("nan")
    batch.with_fields(rollout_logprobs=garbage).validate()
    with pytest.raises(ValueError, match="rewards"):
        batch.with_fields(rewards=torch.tensor([1.0, float("nan"), 0.0])).validate()
    # A logprob of -inf (a token the policy calls impossible) is accepted: correction/ clamps it.
    impossible = batch.rollout_logprobs.clone()
    impossible[0, 2] = float("-inf")
    batch.with_fields(rollout_logprobs=impossible, prox_logprobs=impossible).validate()
    for value in (float("nan"), float("inf")):
        wrong = impossible.clone()
        wrong[2, 1] = value
        with pytest.raises(ValueError, match="rollout_logprobs has 1 NaN / \\+inf"):
            batch.with_fields(rollout_logprobs=wrong).validate()
    with pytest.raises(ValueError, match="prox_logprobs has shape"):
        batch.with_fields(prox_logprobs=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="input_ids must be torch.long"):
        batch.with_fields(input_ids=batch.input_ids.float()).validate()
    with pytest.raises(ValueError, match="1 response tokens but 2 logprobs"):
        RolloutBatch.from_sequences([[1]], [[2]], [0.0], torch.zeros(1), [0], [0], [[-1.0, -2.0]], 0)
