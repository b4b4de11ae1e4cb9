"""The asynchronous producer's own stream of the run's prompt batches.

Background generation must read prompts ahead of the trainer, which Lightning's train loader
iterator does not allow (it belongs to the fit loop). The producer therefore iterates its own copy
of the train dataloader: the same dataset, batch size, collate function and shuffling, sharded
across ranks like Lightning shards it (a ``DistributedSampler`` per rank), epoch after epoch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_offpolicy.batch import PromptBatch

__all__ = ["prompt_batches", "with_sampler"]


def prompt_batches(loader: DataLoader, rank: int, world_size: int, skip: int, seed: int) -> Iterator[PromptBatch]:
    """Endless iterator over ``loader``'s batches for ``rank``, starting after ``skip`` batches.

    Args:
        loader: The run's train dataloader (yielding :class:`PromptBatch`).
        rank: This process's global rank.
        world_size: Number of training processes; > 1 shards a map-style dataset with a
            ``DistributedSampler`` (seeded with ``seed``, reshuffled each epoch).
        skip: Batches already trained (a resumed run continues after them).
        seed: Seed of the per-rank sharding.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"RolloutCallback(asynchrony.max_staleness>0) reads the train prompts ahead of the trainer and needs a "
            f"torch DataLoader of PromptBatch from train_dataloader(); got {type(loader).__name__}."
        )
    sampler: DistributedSampler | None = None
    if world_size > 1 and not isinstance(loader.sampler, DistributedSampler):
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError(
                "RolloutCallback(asynchrony.max_staleness>0) with several processes cannot shard an IterableDataset of "
                "prompts; use a map-style dataset, or shard it per rank yourself and use a DistributedSampler."
            )
        sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        loader = with_sampler(loader, sampler)
    elif isinstance(loader.sampler, DistributedSampler):
        sampler = loader.sampler

    def endless() -> Iterator[Any]:
        for epoch in itertools.count():
            if sampler is not None:
                sampler.set_epoch(epoch)
            empty = True
            for batch in loader:
                empty = False
                if not isinstance(batch, PromptBatch):
                    raise TypeError(
                        "RolloutCallback expects the train dataloader to yield PromptBatch; "
                        f"got {type(batch).__name__}."
                    )
                yield batch
            if empty:
                raise ValueError("RolloutCallback: the train dataloader yields no batch.")

    return itertools.islice(endless(), skip, None)


def with_sampler(loader: DataLoader, sampler: DistributedSampler) -> DataLoader:
    """A new loader of ``loader``'s dataset, batch size, collate function and ``drop_last``, in ``sampler``'s order."""
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        num_workers=0,
    )
