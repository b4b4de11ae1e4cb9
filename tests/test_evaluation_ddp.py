"""Real 2-process Lightning DDP on CPU (gloo): the val/* metrics of two ranks equal those of one process.

Each rank evaluates half of the held-out prompts (Lightning's DistributedSampler); the metric
states are float64 sums summed across ranks, and each prompt's samples are seeded by its text, so
the two layouts must report the same values.
"""

from __future__ import annotations

import lightning as L
import pytest

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import SamplingConfig
from tests.module_helpers import TWO_RANK_STRATEGY


def validate(devices: int) -> dict[str, float]:
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=TWO_RANK_STRATEGY if devices > 1 else "auto",
        callbacks=[
            RolloutCallback(
                sampling=SamplingConfig(samples_per_prompt=3, max_new_tokens=7), seed=5, success_threshold=0.5
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # 8 prompts: 4 per rank (no DistributedSampler padding), in batches of 2.
    data = PromptDataModule(
        task="reverse", prompts_per_step=4, num_train_prompts=16, num_val_prompts=8, val_prompts_per_step=2
    )
    trainer.validate(OffPolicyRLModule(model="tiny:reverse"), data)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


@pytest.mark.slow
def test_two_rank_val_metrics_equal_single_process():
    single = validate(devices=1)
    assert set(single) == {"val/reward_greedy", "val/reward_sampled", "val/pass@k", "val/length", "val/length_greedy"}
    # Not a degenerate case where every layout gives the same number: the prompts' rewards differ.
    assert 0 < single["val/reward_sampled"] < 1
    assert validate(devices=2) == pytest.approx(single, rel=1e-6)
