"""Real 2-process Lightning DDP on CPU (gloo): two ranks on half batches == one process on the whole.

The loss is normalised by the global token count of each mini-batch, so the all-reduced gradient
equals the single-process gradient exactly, even when the ranks hold different numbers of tokens
and need different numbers of micro-batches (the short rank runs padding micro-batches).
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from tests.module_helpers import TOKENIZER, TWO_RANK_STRATEGY, fit_on, make_rollout, tiny_model


def make_module(model) -> OffPolicyRLModule:
    return OffPolicyRLModule(
        model=model,
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=0.002),
        correction=OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.8, high=1.25, clip_high=1.5),
        loss=PolicyLossConfig(rollout_kl_coef=0.1, aggregation="seq-mean-token-mean"),
        num_minibatches=2,
        max_tokens_per_microbatch=14,
        gradient_clip_val=None,
        shuffle_minibatches=False,
    )


@pytest.mark.slow
def test_two_rank_ddp_step_equals_single_process_step():
    model = tiny_model()
    full = make_rollout(model, seed=3, rows=8)
    # Rank 0 gets rows 0-3 and rank 1 rows 4-7; each splits its half into 2 mini-batches, so the
    # global mini-batches are {0,1,4,5} and {2,3,6,7}: the single process sees them in that order.
    halves = [full.select([0, 1, 2, 3]), full.select([4, 5, 6, 7])]
    single_order = [full.select([0, 1, 4, 5, 2, 3, 6, 7])]

    single = make_module(copy.deepcopy(model))
    single_trainer = fit_on(single, single_order, max_steps=2)

    ddp = make_module(copy.deepcopy(model))
    ddp_trainer = fit_on(ddp, halves, max_steps=2, devices=2, strategy=TWO_RANK_STRATEGY)

    start = tiny_model()
    moved = max((a - b).abs().max().item() for a, b in zip(start.parameters(), single.policy.parameters(), strict=True))
    assert moved > 1e-4
    for a, b in zip(single.policy.parameters(), ddp.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Metric sums are exact across ranks; what remains is float32 noise of the forward passes,
    # whose padding differs between the two layouts (amplified by exp(2 S) in chi2_seq).
    for key in (
        "rollout_corr/kl",
        "rollout_corr/chi2_seq",
        "rollout_corr/geo_mask_seq_reject_rate",
        "ppo/clip_frac",
        "train/reward",
    ):
        assert float(ddp_trainer.callback_metrics[key]) == pytest.approx(
            float(single_trainer.callback_metrics[key]), rel=1e-5, abs=1e-7
        ), key
