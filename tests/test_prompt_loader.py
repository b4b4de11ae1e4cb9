"""``train_prompt_loader``: a loader of the fit's train prompts that is not the fit loop's, from public hooks."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_offpolicy.lightning.prompt_loader import train_prompt_loader

ROWS = list(range(40))


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.float()[:, None]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _ModuleWithLoader(_Module):
    def train_dataloader(self):
        return DataLoader(ROWS, batch_size=4, shuffle=False)


class _DataModule(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(ROWS, batch_size=5, shuffle=False)


class _Capture(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.fit_loader = trainer.train_dataloader
        self.own = train_prompt_loader(trainer)


def _fit(module, **data) -> _Capture:
    capture = _Capture()
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[capture],
    )  # fmt: skip
    trainer.fit(module, **data)
    return capture


@pytest.mark.parametrize("source", ["datamodule", "module"])
def test_a_hook_is_asked_for_a_new_loader(source):
    if source == "datamodule":
        capture, batch_size = _fit(_Module(), datamodule=_DataModule()), 5
    else:
        capture, batch_size = _fit(_ModuleWithLoader()), 4
    assert capture.own is not capture.fit_loader and capture.own.batch_size == batch_size
    assert [b.tolist() for b in capture.own] == [ROWS[i : i + batch_size] for i in range(0, 40, batch_size)]


def test_a_loader_passed_to_fit_is_used_as_it_is():
    loader = DataLoader(ROWS, batch_size=8, shuffle=False)
    capture = _fit(_Module(), train_dataloaders=loader)
    assert capture.own is capture.fit_loader


def test_a_distributed_sampler_of_a_passed_loader_is_copied_with_its_settings():
    sampler = DistributedSampler(ROWS, num_replicas=2, rank=1, shuffle=True, seed=7)
    capture = _fit(_Module(), train_dataloaders=DataLoader(ROWS, batch_size=4, sampler=sampler))
    own = capture.own
    assert own is not capture.fit_loader and own.sampler is not capture.fit_loader.sampler
    for epoch in (0, 3):
        own.sampler.set_epoch(epoch)
        reference = DistributedSampler(ROWS, num_replicas=2, rank=1, shuffle=True, seed=7)
        reference.set_epoch(epoch)
        expected = list(reference)
        assert [row for b in own for row in b.tolist()] == expected
    assert capture.fit_loader.sampler.epoch != 3, "set_epoch on the copy moved the fit loop's sampler"
