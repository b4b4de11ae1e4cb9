"""The prompt DataModule: a fixed, seeded set of task prompts, served as PromptBatch, and held-out prompts."""

from __future__ import annotations

import random
import warnings
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.data.sampler import ResumableTrainLoader
from lightning_offpolicy.data.tasks.base import Task, TaskReward
from lightning_offpolicy.data.tasks.registry import TASKS, get_task
from lightning_offpolicy.seeding import run_seed

__all__ = ["PromptDataset", "PromptDataModule", "collate_prompts"]

# ``num_val_prompts=0`` answers val_dataloader() with an empty list (no validation); Lightning's
# notice about an empty list loader is noise then.
warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")


class PromptDataset(Dataset):
    """A list of ``(prompt, metadata)`` pairs."""

    def __init__(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, dict[str, Any]]:
        return self.items[index]


def collate_prompts(items: list[tuple[str, dict[str, Any]]]) -> PromptBatch:
    """Turn a list of ``(prompt, metadata)`` into one :class:`PromptBatch`."""
    return PromptBatch(prompts=[p for p, _ in items], metadata=[dict(m) for _, m in items])


class PromptDataModule(ResumableTrainLoader, LightningDataModule):
    """Prompts of a built-in task for RL training; each step gets one :class:`PromptBatch`.

    After construction ``self.task`` is the :class:`~lightning_offpolicy.data.tasks.Task` and
    ``self.reward_fn`` the matching :class:`~lightning_offpolicy.data.tasks.TaskReward`.

    The order of the prompts depends only on ``seed`` and the epoch, and a run resumed from a
    checkpoint continues at the next batch it has not trained (the position is saved in the
    checkpoint; see :mod:`lightning_offpolicy.data.sampler`).

    Args:
        task: name of a built-in task (``reverse``, ``addition``, ``copy``, ``guess_number``).
        prompts_per_step: prompts per training step (the DataLoader batch size); each prompt is
            sampled ``rollout.sampling.samples_per_prompt`` times by the rollout side.
        num_train_prompts: size of the fixed training prompt set (one epoch = this many prompts).
        seed: seed of the prompt set and its order (``None``: the run's ``seed_everything``).
        num_val_prompts: held-out prompts for evaluation in Lightning's validation loop (``val/*``
            metrics, see :mod:`lightning_offpolicy.metrics.evaluation`); 0: no validation. They come from
            a seed stream of their own and never equal a training prompt (except for a task whose
            prompts are all alike, ``guess_number``); the training prompts and their order are the
            same whatever this is.
        val_prompts_per_step: held-out prompts per validation batch.
    """

    def __init__(
        self,
        task: str = "reverse",
        prompts_per_step: int = 16,
        num_train_prompts: int = 2048,
        seed: int | None = None,
        num_val_prompts: int = 0,
        val_prompts_per_step: int = 16,
    ) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"PromptDataModule: unknown `task` {task!r}; available: {', '.join(sorted(TASKS))}.")
        if not isinstance(prompts_per_step, int) or prompts_per_step < 1:
            raise ValueError(f"PromptDataModule: `prompts_per_step` must be a positive int, got {prompts_per_step!r}.")
        if not isinstance(num_train_prompts, int) or num_train_prompts < 1:
            raise ValueError(
                f"PromptDataModule: `num_train_prompts` must be a positive int, got {num_train_prompts!r}."
            )
        if prompts_per_step > num_train_prompts:
            raise ValueError(
                f"PromptDataModule: `prompts_per_step` ({prompts_per_step}) must be <= `num_train_prompts` "
                f"({num_train_prompts}), or no full batch can be drawn."
            )
        if not is_int(num_val_prompts) or num_val_prompts < 0:
            raise ValueError(
                f"PromptDataModule: `num_val_prompts` must be an int >= 0 (0: no validation), got {num_val_prompts!r}."
            )
        if not is_int(val_prompts_per_step) or val_prompts_per_step < 1:
            raise ValueError(
                f"PromptDataModule: `val_prompts_per_step` must be a positive int, got {val_prompts_per_step!r}."
            )
        # Not the seed: Lightning refuses a key the module's hyper-parameters also have with another value.
        self.save_hyperparameters(ignore=["seed"])
        self.task_name = task
        self.prompts_per_step = prompts_per_step
        self.num_train_prompts = num_train_prompts
        self.seed = seed = run_seed(seed, "PromptDataModule.seed")
        self.shuffle = True
        self.task: Task = get_task(task)
        self.reward_fn = TaskReward(self.task)
        rng = random.Random(seed)
        self.train_dataset = PromptDataset([self.task.sample(rng) for _ in range(num_train_prompts)])
        self.num_val_prompts = num_val_prompts
        self.val_prompts_per_step = val_prompts_per_step
        self.val_dataset = PromptDataset(self._held_out_prompts(num_val_prompts))

    def _held_out_prompts(self, count: int) -> list[tuple[str, dict[str, Any]]]:
        """``count`` prompts from a stream of their own, distinct and none a training prompt (unless
        ``task.distinct_held_out`` is False: then plain draws)."""
        if count == 0:
            return []
        rng = random.Random(f"held-out:{self.seed}")  # str seeds are hashed with sha512: stable across runs
        if not self.task.distinct_held_out:
            return [self.task.sample(rng) for _ in range(count)]
        taken = {prompt for prompt, _ in self.train_dataset.items}
        items: list[tuple[str, dict[str, Any]]] = []
        for _ in range(100 * count + 10_000):
            prompt, metadata = self.task.sample(rng)
            if prompt not in taken:
                taken.add(prompt)
                items.append((prompt, metadata))
                if len(items) == count:
                    return items
        raise ValueError(
            f"PromptDataModule: could not draw {count} held-out prompts of task {self.task_name!r} distinct from "
            f"the {self.num_train_prompts} training prompts (found {len(items)}); the task has too few distinct "
            "prompts: lower `num_val_prompts` or `num_train_prompts`."
        )

    def train_dataloader(self) -> DataLoader:
        return self._resumable_loader(self.train_dataset, collate_prompts)

    def val_dataloader(self) -> DataLoader | list:
        """The held-out prompts in a fixed order (an empty list, no validation, when ``num_val_prompts=0``)."""
        return self._held_out_loader(self.val_dataset, collate_prompts)
