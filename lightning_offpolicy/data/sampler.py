"""A seeded prompt order that a resumed run continues at the next unseen batch.

Lightning restarts the train loader from the top of the epoch when a run resumes mid-epoch, so a
run resumed at step 8 would train the epoch's first batches again. :class:`ResumableSampler`
fixes the order of every epoch by ``(seed, epoch)`` alone, shards it across ranks, and can start
one epoch part-way (:meth:`ResumableSampler.resume_at`). :func:`trained_position` reads, at
checkpoint time, how far the fit loop has trained; :class:`ResumableDataLoader` saves it as its
``state_dict``, which Lightning stores in the checkpoint and hands back to the resumed run's loader.

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

__all__ = ["ResumableDataLoader", "ResumableSampler", "ResumableTrainLoader", "trained_position"]


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
        self._epoch_offset: int | None = None

    def set_epoch(self, epoch: int) -> None:
        if self._resume is not None and self._epoch_offset is None:
            # The first epoch the resumed loop announces is the one the checkpoint stopped in. Lightning
            # may number it differently (a checkpoint saved after fit() counts the unfinished epoch as
            # done), so keep the data's own numbering from here on.
            self._epoch_offset = self._resume[0] - int(epoch)
        self.epoch = int(epoch) + (self._epoch_offset or 0)

    @property
    def epoch_offset(self) -> int:
        """The data's epoch minus the epoch number the fit loop announces (0 unless resumed)."""
        return self._epoch_offset or 0

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Make the next pass start at batch ``batches_done`` of ``epoch`` (once); later epochs follow on."""
        self.epoch = int(epoch)
        self._resume = (int(epoch), int(batches_done))
        self._epoch_offset = None

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


def trained_position(trainer: Any, batches_per_epoch: int, epoch_offset: int = 0) -> dict[str, int] | None:
    """``{"epoch", "batches_done"}``: where the fit loop stands, in batches trained, at checkpoint time.

    ``None`` outside a fit. A finished epoch is reported as the next epoch's start. ``epoch_offset``
    turns the fit loop's epoch number into the data's (see :meth:`ResumableSampler.set_epoch`).
    """
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    # The epoch the last batches ran in: `started` - 1. Not `current_epoch`, which fit() advances
    # when it stops mid-epoch at max_steps, so a checkpoint saved after fit() would skip a whole epoch.
    epoch = max(int(trainer.fit_loop.epoch_progress.current.started) - 1, 0) + epoch_offset
    # `processed` counts the batches whose training_step ran in this epoch: at a checkpoint saved
    # in on_train_batch_end it already includes the batch just trained (`completed` does not yet).
    done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    if done >= batches_per_epoch:
        epoch, done = epoch + 1, 0
    return {"epoch": epoch, "batches_done": done}


class ResumableDataLoader(DataLoader):
    """A train ``DataLoader`` in :class:`ResumableSampler` order whose checkpoint state is the trained position.

    Lightning saves the ``state_dict`` of a train loader that has one in every checkpoint, and on
    resume calls ``load_state_dict`` on the new run's loader before iterating it: the sampler then
    starts at the next batch the saved run had not trained.

    Args:
        dataset: The map-style dataset.
        batch_size: Rows per batch (the sampler's ``batch_size``).
        sampler: The order.
        collate_fn: Rows to batch.
        trainer: The trainer whose fit loop says how far training got (None: no position is saved).
    """

    def __init__(
        self, dataset: Any, batch_size: int, sampler: ResumableSampler, collate_fn: Any, trainer: Any = None
    ) -> None:
        super().__init__(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=0, collate_fn=collate_fn
        )
        self._trainer = trainer

    def _layout(self) -> dict[str, int]:
        sampler = self.sampler
        return {"num_rows": sampler.num_rows, "batch_size": sampler.batch_size, "world_size": sampler.num_replicas}

    def state_dict(self) -> dict[str, Any]:
        position = trained_position(self._trainer, len(self), self.sampler.epoch_offset)
        return {} if position is None else {"train_position": {**position, **self._layout()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = state_dict.get("train_position")
        if not position:
            return
        saved = tuple(position.get(k) for k in ("num_rows", "batch_size", "world_size"))
        now = tuple(self._layout().values())
        if saved != now:
            raise ValueError(
                f"The checkpoint's data position was saved with (rows, prompts_per_step, processes) = {saved}; this "
                f"run has {now}, so the position would point at other prompts. Resume with the same data, "
                "prompts_per_step and number of processes (or start a new run)."
            )
        self.sampler.resume_at(position["epoch"], position["batches_done"])


class ResumableTrainLoader:
    """Data-module mixin: :meth:`_resumable_loader` builds the train loader (a :class:`ResumableDataLoader`),
    :meth:`_held_out_loader` the validation loader.

    The host sets ``self.prompts_per_step``, ``self.val_prompts_per_step``, ``self.seed`` and ``self.shuffle``.
    """

    def _held_out_loader(self, dataset: Any, collate_fn: Any) -> DataLoader | list:
        """The held-out prompts in a fixed order; an empty list (Lightning skips validation) when there are none."""
        if dataset is None or not len(dataset):
            return []
        return DataLoader(
            dataset,
            batch_size=self.val_prompts_per_step,
            shuffle=False,
            num_workers=0,
            collate_fn=collate_fn,
            # Its own generator: the loader's iterator draws a base seed, which must not move the global RNG
            # (an evaluation would otherwise change the training that follows it).
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _resumable_loader(self, dataset: Any, collate_fn: Any) -> ResumableDataLoader:
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
        return ResumableDataLoader(dataset, self.prompts_per_step, sampler, collate_fn, trainer)
