"""Prompts from your own data: files, ``datasets`` objects and reasoning-gym tasks, with a resumable order.

>>> from lightning_offpolicy.data import DatasetDataModule
>>> data = DatasetDataModule("reasoning_gym:basic_arithmetic", reasoning_gym_size=8, prompts_per_step=4)
>>> batch = next(iter(data.train_dataloader()))
>>> len(batch.prompts), sorted(batch.metadata[0])
(4, ['answer', 'metadata'])
"""

from lightning_offpolicy.data.datamodule import DatasetDataModule, PromptRows, collate_rows
from lightning_offpolicy.data.sampler import (
    ResumableDataLoader,
    ResumableSampler,
    ResumableTrainLoader,
    trained_position,
)
from lightning_offpolicy.data.sources import REASONING_GYM_PREFIX, load_source, reasoning_gym_rows

__all__ = [
    "REASONING_GYM_PREFIX",
    "DatasetDataModule",
    "PromptRows",
    "ResumableDataLoader",
    "ResumableSampler",
    "ResumableTrainLoader",
    "collate_rows",
    "load_source",
    "reasoning_gym_rows",
    "trained_position",
]
