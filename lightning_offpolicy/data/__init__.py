"""Prompts from your own data: files, ``datasets`` objects and reasoning-gym tasks, with a resumable order.

>>> from lightning_offpolicy.data import DatasetDataModule
>>> data = DatasetDataModule("reasoning_gym:basic_arithmetic", reasoning_gym_size=8, prompts_per_step=4)
>>> batch = next(iter(data.train_dataloader()))
>>> len(batch.prompts), sorted(batch.metadata[0])
(4, ['answer', 'metadata'])

The names below load on first use (PEP 562), so that ``lightning_offpolicy.data.tokenizers`` and
``lightning_offpolicy.data.rewards`` can be imported without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_offpolicy._lazy import lazy_exports

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "REASONING_GYM_PREFIX": "lightning_offpolicy.data.sources",
    "DatasetDataModule": "lightning_offpolicy.data.datamodule",
    "PromptRows": "lightning_offpolicy.data.datamodule",
    "ResumableDataLoader": "lightning_offpolicy.data.sampler",
    "ResumableSampler": "lightning_offpolicy.data.sampler",
    "ResumableTrainLoader": "lightning_offpolicy.data.sampler",
    "collate_rows": "lightning_offpolicy.data.datamodule",
    "load_source": "lightning_offpolicy.data.sources",
    "reasoning_gym_rows": "lightning_offpolicy.data.sources",
    "trained_position": "lightning_offpolicy.data.sampler",
}

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


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from lightning_offpolicy.data.datamodule import DatasetDataModule, PromptRows, collate_rows
    from lightning_offpolicy.data.sampler import (
        ResumableDataLoader,
        ResumableSampler,
        ResumableTrainLoader,
        trained_position,
    )
    from lightning_offpolicy.data.sources import REASONING_GYM_PREFIX, load_source, reasoning_gym_rows
