"""A loader of the run's train prompts for readers other than the fit loop, through Lightning's public API.

The asynchronous producer reads prompts ahead of the trainer and dynamic sampling draws extra
ones, so neither may iterate the fit loop's own loader (its iterator, and ``set_epoch`` on its
sampler, belong to the loop). Each asks :func:`train_prompt_loader` for a loader of its own.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, DistributedSampler

from lightning_offpolicy.rollout.prompt_source import with_sampler

__all__ = ["train_prompt_loader"]


def train_prompt_loader(trainer: Trainer) -> Any:
    """A new train loader of the fit's prompts, which the fit loop does not iterate.

    The data module's ``train_dataloader()`` when the fit has one, else the module's when it
    defines one: each call builds a new loader with its own sampler, as Lightning's own call does.
    A loader passed to ``trainer.fit`` exists once (``trainer.train_dataloader``): it is used as it
    is, or, when its sampler is a ``DistributedSampler``, copied over the same dataset, batch size,
    collate function and sampler settings, so that ``set_epoch`` on the copy leaves the loop's alone.

    Args:
        trainer: The trainer, from ``on_train_start`` on (its train loader is set up).

    Returns:
        The loader (what the hook returned; :func:`~lightning_offpolicy.rollout.prompt_source.prompt_batches`
        checks that it is a ``DataLoader`` of ``PromptBatch``).
    """
    datamodule = trainer.datamodule
    if datamodule is not None and is_overridden("train_dataloader", datamodule):
        return datamodule.train_dataloader()
    module = trainer.lightning_module
    if is_overridden("train_dataloader", module):
        return module.train_dataloader()
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, DistributedSampler):
        return loader
    sampler = loader.sampler
    own = DistributedSampler(
        loader.dataset,
        num_replicas=sampler.num_replicas,
        rank=sampler.rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
    )
    return with_sampler(loader, own)
