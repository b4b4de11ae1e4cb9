"""A resumed run trains the next unseen batch: the prompt order after a resume equals the uninterrupted run's.

Real fits (tiny Llama, HF engine), checkpoints saved mid-epoch by ModelCheckpoint, resumed with
``ckpt_path``; one process, and 2-rank DDP (gloo, forked ranks).
"""

from __future__ import annotations

import json
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_offpolicy.data import DatasetDataModule
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import SamplingConfig
from tests.module_helpers import TOKENIZER, TWO_RANK_STRATEGY, tiny_model


class RecordPrompts(L.Callback):
    """Appends each trained batch's prompts (and weighted-reward parts) to a per-rank JSON-lines file."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        parts = batch.rollout.reward_components or {}
        record = {
            "step": trainer.global_step,
            "prompts": list(batch.prompts),
            "parts": {k: [float(v.sum()), v.numel()] for k, v in parts.items()},
        }
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps(record) + "\n")


def read(path, rank=0):
    with open(f"{path}.rank{rank}") as f:
        return [json.loads(line) for line in f]


def fit(data, root, record, max_steps, ckpt_path=None, every=None, reward_fn=None, **trainer_kwargs):
    module = OffPolicyRLModule(
        model=tiny_model(), tokenizer=TOKENIZER, optimizer=partial(torch.optim.AdamW, lr=1e-3), num_minibatches=1
    )
    callbacks = [
        RolloutCallback(sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=3), seed=1, reward_fn=reward_fn),
        RecordPrompts(record),
    ]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(every),
        **trainer_kwargs,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("stop_at", [2, 3, 4], ids=["mid-epoch", "epoch-end", "second-epoch"])
def test_single_process_resume_continues_at_the_next_unseen_batch(tmp_path, stop_at):
    # 12 prompts, 4 per step: an epoch is 3 batches, so 7 steps cross two epoch boundaries.
    make = lambda: PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=12, seed=5)  # noqa: E731
    fit(make(), tmp_path / "full", tmp_path / "full.jsonl", max_steps=7)
    full = [r["prompts"] for r in read(tmp_path / "full.jsonl")]
    assert len(full) == 7 and full[0] != full[3]  # a new order in the second epoch

    fit(make(), tmp_path / "a", tmp_path / "a.jsonl", max_steps=stop_at, every=stop_at)
    (checkpoint,) = (tmp_path / "a" / "ckpt").glob("*.ckpt")
    fit(make(), tmp_path / "b", tmp_path / "b.jsonl", max_steps=7, ckpt_path=checkpoint)
    first = [r["prompts"] for r in read(tmp_path / "a.jsonl")]
    resumed = [r["prompts"] for r in read(tmp_path / "b.jsonl")]
    assert first == full[:stop_at]
    assert resumed == full[stop_at:]  # before the fix: the epoch's first batches again


def test_dataset_datamodule_resumes_twice_from_checkpoints_saved_after_fit(tmp_path):
    # 10 prompts, 2 per step: 5 batches an epoch. Stop at 3 (mid-epoch), then at 6 (after the
    # epoch boundary), then finish at 8; fit() counts an epoch stopped by max_steps as finished.
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"copy {c}=", "answer": c}) + "\n" for c in "abcdefghij"))
    make = lambda: DatasetDataModule(str(rows), prompts_per_step=2, seed=2)  # noqa: E731
    reward = "tests.reward_fixtures.exact_match"
    fit(make(), tmp_path / "full", tmp_path / "full.jsonl", max_steps=8, reward_fn=reward)
    full = [r["prompts"] for r in read(tmp_path / "full.jsonl")]
    previous = None
    for run, stop in (("a", 3), ("b", 6), ("c", 8)):
        trainer = fit(
            make(), tmp_path / run, tmp_path / f"{run}.jsonl", max_steps=stop, ckpt_path=previous, reward_fn=reward
        )
        trainer.save_checkpoint(tmp_path / f"{run}.ckpt")
        previous = tmp_path / f"{run}.ckpt"
    assert [r["prompts"] for run in "abc" for r in read(tmp_path / f"{run}.jsonl")] == full
    assert [len(read(tmp_path / f"{run}.jsonl")) for run in "abc"] == [3, 3, 2]
    with pytest.raises(
        ValueError, match=r"saved with \(rows, prompts_per_step, processes\) = \(10, 2, 1\); this run has \(10, 3, 1\)"
    ):
        fit(
            DatasetDataModule(str(rows), prompts_per_step=3, seed=2),
            tmp_path / "d",
            tmp_path / "d.jsonl",
            max_steps=9,
            ckpt_path=tmp_path / "a.ckpt",
            reward_fn=reward,
        )


@pytest.mark.slow
@pytest.mark.long("a real 2-process DDP fit stopped and resumed: each rank's data position and reward parts")
def test_two_rank_ddp_resume_and_exact_reward_parts(tmp_path):
    make = lambda: PromptDataModule(task="copy", prompts_per_step=2, num_train_prompts=12, seed=9)  # noqa: E731
    reward = [
        {"fn": "tests.reward_fixtures.exact_match", "name": "acc"},
        {"fn": "tests.reward_fixtures.length_bonus", "weight": 0.5, "name": "len"},
    ]
    ddp = {"devices": 2, "strategy": TWO_RANK_STRATEGY}
    # The full run saves after every 2 steps; the resume starts from its step-2 checkpoint, as after a
    # preemption there.
    full_trainer = fit(
        make(), tmp_path / "full", tmp_path / "full.jsonl", max_steps=5, every=2, reward_fn=reward, **ddp
    )
    (checkpoint,) = (tmp_path / "full" / "ckpt").glob("*-step=2.ckpt")
    fit(make(), tmp_path / "b", tmp_path / "b.jsonl", max_steps=5, ckpt_path=checkpoint, reward_fn=reward, **ddp)
    for rank in (0, 1):
        full = [r["prompts"] for r in read(tmp_path / "full.jsonl", rank)]
        assert len(full) == 5 and [r["prompts"] for r in read(tmp_path / "b.jsonl", rank)] == full[2:]
    # In one epoch (3 batches of 2 per rank) the two ranks train every one of the 12 prompts once.
    epoch = [p for rank in (0, 1) for r in read(tmp_path / "full.jsonl", rank)[:3] for p in r["prompts"]]
    assert sorted(epoch) == sorted(p for p, _ in make().train_dataset.items)
    # reward/<name> of the last step: the mean over both ranks' completions, from the recorded sums.
    last = [read(tmp_path / "full.jsonl", rank)[-1]["parts"] for rank in (0, 1)]
    for name in ("acc", "len"):
        expected = (last[0][name][0] + last[1][name][0]) / (last[0][name][1] + last[1][name][1])
        assert float(full_trainer.callback_metrics[f"reward/{name}"]) == pytest.approx(expected, abs=1e-6)
