"""A seeded prompt order that a resumed run continues at the next unseen batch.

Lightning restarts the train loader from the top of the epoch when a run resumes mid-epoch, so a
run resumed at step 8 would train the epoch's first batches again. :class:`ResumableSampler`
fixes the order of every epoch by ``(seed, epoch)`` alone, shards it across ranks, and can start
one epoch part-way (:meth:`ResumableSampler.resume_at`). :func:`trained_position` reads, at
checkpoint time, how far the fit loop has trained; the data modules save it in their
``state_dict`` and hand it to the sampler of the resumed run.

It subclasses ``DistributedSampler`` so that Lightning keeps it under DDP instead of replacing it
with its own (Lightning only replaces samplers that are not ``DistributedSampler``), and so that
the asynchronous producer (:func:`~lightning_offpolicy.rollout.prompt_source.prompt_batches`)
iterates the very same per-rank order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["ResumableSampler", "ResumableTrainLoader", "trained_position"]


class ResumableSampler(DistributedSampler):
    """Epoch ``e`` visits ``randperm(num_rows, seed + e)`` (or ``0..num_rows-1`` unshuffled), rank ``r`` every
    ``num_replicas``-th index from ``r``; the tail that does not split evenly across ranks is dropped.

    Args:
        num_rows: Rows in the dataset.
        batch_size: Rows per batch (to turn a batch position into a row position).
        seed: Seed of the shuffled order.
        shuffle: Shuffle (a new order each epoch) or keep the dataset order.
        num_replicas: Training processes.
        rank: This process's rank.
    """

    def __init__(
        self, num_rows: int, batch_size: int, seed: int = 0, shuffle: bool = True, num_replicas: int = 1, rank: int = 0
    ) -> None:
        # Not DistributedSampler.__init__: it needs a dataset and an initialised process group.
        if num_rows < 1:
            raise ValueError(f"ResumableSampler: `num_rows` must be >= 1, got {num_rows}.")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler: rank {rank} outside 0..{num_replicas - 1}.")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = True
        self.num_samples = num_rows // num_replicas
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches already trained in it)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Make the next pass over ``epoch`` start after its first ``batches_done`` batches (once)."""
        self.epoch = int(epoch)
        self._resume = (int(epoch), int(batches_done))

    def order(self, epoch: int) -> list[int]:
        """This rank's row indices of ``epoch``, from its first batch."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            indices = list(range(self.num_rows))
        return indices[: self.total_size][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        indices = self.order(self.epoch)
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] * self.batch_size :]
        self._resume = None
        return iter(indices)

    def __len__(self) -> int:
        # The full epoch, also when resuming: Lightning counts the epoch's batches from len(loader)
        # and its restored batch counter, so a resumed epoch ends at the same batch.
        return self.num_samples


def trained_position(trainer: Any, batches_per_epoch: int) -> dict[str, int] | None:
    """``{"epoch", "batches_done"}``: where the fit loop stands, in batches trained, at checkpoint time.

    ``None`` outside a fit. A finished epoch is reported as the next epoch's start.
    """
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    epoch = int(trainer.current_epoch)
    # `processed` counts the batches whose training_step ran in this epoch: at a checkpoint saved
    # in on_train_batch_end it already includes the batch just trained (`completed` does not yet).
    done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    if done >= batches_per_epoch:
        epoch, done = epoch + 1, 0
    return {"epoch": epoch, "batches_done": done}


class ResumableTrainLoader:
    """Data-module mixin: a train loader in :class:`ResumableSampler` order, and its position in checkpoints.

    The host sets ``self.prompts_per_step``, ``self.seed`` and ``self.shuffle`` and calls
    :meth:`_resumable_loader` from ``train_dataloader``. Lightning saves the data module's
    ``state_dict`` in every checkpoint and calls ``load_state_dict`` before ``train_dataloader``
    on resume.
    """

    _resume_position: dict[str, int] | None = None
    _train_rows: int = 0

    def _resumable_loader(self, dataset: Any, collate_fn: Any) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        world_size = int(trainer.world_size) if trainer is not None else 1
        rank = int(trainer.global_rank) if trainer is not None else 0
        num_rows = len(dataset)
        if num_rows // world_size < self.prompts_per_step:
            raise ValueError(
                f"{type(self).__name__}: {num_rows} training prompts over {world_size} process(es) leave fewer than "
                f"prompts_per_step={self.prompts_per_step} per process: no full batch can be drawn. Lower "
                "`prompts_per_step` or add prompts."
            )
        sampler = ResumableSampler(num_rows, self.prompts_per_step, self.seed, self.shuffle, world_size, rank)
        position, self._resume_position = self._resume_position, None  # once: a second loader starts fresh
        if position is not None:
            self._check_resume(position, num_rows, world_size)
            sampler.resume_at(position["epoch"], position["batches_done"])
        self._train_rows = num_rows
        self._train_batches_per_epoch = len(sampler) // self.prompts_per_step
        self._world_size = world_size
        return DataLoader(
            dataset,
            batch_size=self.prompts_per_step,
            sampler=sampler,
            drop_last=True,
            num_workers=0,
            collate_fn=collate_fn,
        )

    def _check_resume(self, position: dict[str, int], num_rows: int, world_size: int) -> None:
        saved = (position.get("num_rows"), position.get("prompts_per_step"), position.get("world_size"))
        now = (num_rows, self.prompts_per_step, world_size)
        if saved != now:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's data position was saved with (rows, prompts_per_step, "
                f"processes) = {saved}, this run has {now}: the saved position would point at other prompts. "
                "Resume with the same data, prompts_per_step and number of processes."
            )

    def state_dict(self) -> dict[str, Any]:
        batches = getattr(self, "_train_batches_per_epoch", 0)
        position = trained_position(getattr(self, "trainer", None), batches) if batches else None
        if position is None:
            return {}
        position.update(num_rows=self._train_rows, prompts_per_step=self.prompts_per_step, world_size=self._world_size)
        return {"train_position": position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_position = state_dict.get("train_position")
