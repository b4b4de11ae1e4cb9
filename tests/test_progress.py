"""RLProgressBar: the training bar counts batches when a batch takes several optimizer steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_offpolicy.cli import OffPolicyCLI
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.progress import RLProgressBar, remaining_batches

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("epoch_batches", "max_steps", "global_step", "per_batch", "expected"),
    [
        (128, 600, 0, 2, 128),  # the quickstart's first epoch: the epoch is shorter than 300 batches
        (128, 600, 512, 2, 44),  # its third epoch: 88 optimizer steps = 44 batches left
        (1000, 600, 0, 2, 300),
        (1000, 7, 0, 2, 4),  # a last batch that overshoots max_steps still runs
        (math.inf, 600, 100, 4, 125),
        (10, -1, 0, 2, 10),  # no step limit: the epoch
    ],
)
def test_remaining_batches(epoch_batches, max_steps, global_step, per_batch, expected):
    assert remaining_batches(epoch_batches, max_steps, global_step, per_batch) == expected


def _fit(tmp_path: Path, *extra: str) -> OffPolicyCLI:
    return OffPolicyCLI(
        OffPolicyRLModule,
        PromptDataModule,
        subclass_mode_data=True,
        args=[
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_steps=6",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.init_args.prompts_per_step=2",
            "--data.init_args.num_train_prompts=40",
            "--rollout.sampling.samples_per_prompt=2",
            "--rollout.sampling.max_new_tokens=4",
            *extra,
        ],
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


@pytest.mark.slow
def test_cli_bar_total_is_batches_on_a_real_fit(tmp_path):
    """max_steps=6 at 2 optimizer steps per batch: 3 batches; Lightning's own bar promised 6."""
    cli = _fit(tmp_path)
    trainer, bar = cli.trainer, cli.trainer.progress_bar_callback
    assert type(bar) is RLProgressBar
    batches_run = trainer.fit_loop.epoch_loop.batch_progress.total.completed
    assert trainer.global_step == 6 and batches_run == 3 and trainer.num_training_batches == 20
    assert bar.train_progress_bar.total == batches_run == bar.train_progress_bar.n
    assert bar.train_progress_bar.postfix is not None and "opt_step=6/6" in bar.train_progress_bar.postfix
    # Lightning's formula for the same fit: min(batches per epoch, max_steps - global_step) at the start.
    assert min(trainer.num_training_batches, trainer.max_steps - 0) == 6 != batches_run


@pytest.mark.slow
def test_cli_keeps_a_progress_bar_the_config_names(tmp_path):
    cli = _fit(tmp_path, "--trainer.max_steps=2", "--trainer.callbacks+=TQDMProgressBar")
    assert type(cli.trainer.progress_bar_callback) is TQDMProgressBar


class _Linear(LightningModule):
    """One optimizer step per batch (automatic optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_fit_ended_by_max_steps_labels_its_epochs_without_a_negative_total(tmp_path):
    """max_steps ends the fit, so Lightning sets max_epochs to -1: Lightning's RichProgressBar said "Epoch 1/-2"."""
    bar = RLProgressBar()
    trainer = Trainer(
        max_steps=6,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Linear(), torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=1))
    assert trainer.max_epochs == -1 and trainer.global_step == 6  # 4 batches, then 2 of the second epoch
    assert bar.train_progress_bar.desc.strip(": ") == "Epoch 1"
    assert bar.train_progress_bar.total == 2  # the second epoch's batches left: max_steps, one step per batch
