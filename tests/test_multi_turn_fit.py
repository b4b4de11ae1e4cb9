"""Multi-turn episodes through the Lightning fit: synchronous, asynchronous within the staleness bound, DDP.

Real components: the tiny SFT-warmed Llama with its character tokenizer (episodes without a chat
template: the environment's reply follows as plain text), the embedded engine, Lightning's loop.
"""

from __future__ import annotations

import json
from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, SamplingConfig
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings
from tests.engine_contract import Replies
from tests.module_helpers import TWO_RANK_STRATEGY

EPISODE_KEYS = {
    "rollout/turns_per_episode",
    "rollout/tool_calls_per_episode",
    "rollout/tool_errors_per_episode",
    "rollout/tool_s_per_episode",
    "rollout/model_tokens_per_episode",
    "rollout/environment_tokens_per_episode",
    "rollout/truncated_frac",
}


class EpisodeRecorder(L.Callback):
    """Per trained batch: the policy versions, and the counts of model and environment tokens; per rank to a file."""

    def __init__(self, directory=None) -> None:
        self.directory = directory
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rollout = batch.rollout
        trained = rollout.response_mask.bool()
        attended = rollout.attention_mask[:, rollout.prompt_length :].bool()
        self.rows.append(
            {
                "staleness": int(pl_module.policy_version - rollout.policy_version[trained].min()),
                "model_tokens": int(trained.sum()),
                "environment_tokens": int((attended & ~trained).sum()),
                "prompts": list(batch.prompts),
            }
        )

    def on_train_end(self, trainer, pl_module):
        if self.directory is not None:
            (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def episode_fit(
    root, max_batches: int, max_staleness: int = 0, devices: int = 1, recorder=None, ckpt_path=None, **async_kwargs
):
    L.seed_everything(0)
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    callback = RolloutCallback(
        engine=HFEngine(dtype="float32"),
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=8),
        seed=3,
        asynchrony=AsyncSettings(max_staleness=max_staleness, **async_kwargs),
        episodes=EpisodeSettings(environment=partial(Replies, 2), max_turns=2, max_episode_tokens=24),
    )
    recorder = recorder or EpisodeRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=TWO_RANK_STRATEGY if devices > 1 else "auto",
        max_steps=max_batches,
        callbacks=[callback, recorder],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, callback, recorder, trainer


def test_a_synchronous_fit_trains_episodes_and_logs_their_metrics(tmp_path):
    module, _, recorder, trainer = episode_fit(tmp_path, 3)
    assert module.policy_version == 3 and len(recorder.rows) == 3
    assert all(row["staleness"] == 0 for row in recorder.rows)
    # The environment's replies are in the batch as context: attended, never trained.
    assert sum(row["environment_tokens"] for row in recorder.rows) > 0
    metrics = trainer.callback_metrics
    assert EPISODE_KEYS <= set(metrics), sorted(metrics)
    assert 1.0 <= float(metrics["rollout/turns_per_episode"]) <= 2.0
    assert float(metrics["rollout/environment_tokens_per_episode"]) >= 0.0


def test_an_asynchronous_fit_with_partial_rollouts_keeps_episodes_within_the_bound(tmp_path):
    module, callback, recorder, _ = episode_fit(tmp_path, 5, max_staleness=2, partial_rollouts=True)
    staleness = [row["staleness"] for row in recorder.rows]
    assert len(staleness) == 5 and all(0 <= s <= 2 for s in staleness), staleness
    assert sum(row["environment_tokens"] for row in recorder.rows) > 0
    assert callback.producer is None


def test_a_resumed_episode_fit_trains_what_the_uninterrupted_one_does(tmp_path):
    _, _, _, trainer = episode_fit(tmp_path / "first", 2)
    checkpoint = tmp_path / "after2.ckpt"
    trainer.save_checkpoint(checkpoint)
    _, callback, resumed, _ = episode_fit(tmp_path / "resumed", 4, ckpt_path=checkpoint)
    _, _, full, _ = episode_fit(tmp_path / "full", 4)
    assert callback.generated_batches == 4
    # The same prompts, and the same episodes (model and environment tokens), as the run never stopped.
    assert resumed.rows == full.rows[2:]


@pytest.mark.slow
def test_two_rank_ddp_trains_each_ranks_own_episodes(tmp_path):
    episode_fit(tmp_path, 3, max_staleness=1, devices=2, recorder=EpisodeRecorder(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rows in ranks:
        assert len(rows) == 3 and all(row["staleness"] <= 1 for row in rows)
        assert sum(row["environment_tokens"] for row in rows) > 0
    # Each rank trains its own shard of the prompts.
    assert ranks[0][0]["prompts"] != ranks[1][0]["prompts"]
