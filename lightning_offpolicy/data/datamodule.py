"""``DatasetDataModule``: prompts from your own files, a ``datasets`` object, or a reasoning-gym task."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_offpolicy.argcheck import is_int, is_real
from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.data.checks import check_prompt_lengths, check_rows, is_prompt
from lightning_offpolicy.data.files import RowLocator
from lightning_offpolicy.data.rewards.resolve import RewardSpec
from lightning_offpolicy.data.sampler import ResumableTrainLoader
from lightning_offpolicy.data.sources import REASONING_GYM_PREFIX, load_source, reasoning_gym_rows
from lightning_offpolicy.seeding import run_seed

__all__ = ["DatasetDataModule", "PromptRows"]


class PromptRows(Dataset):
    """``(prompt, metadata)`` per row of a table: the prompt column, and every other column as metadata.

    Args:
        rows: anything indexable by int that returns a dict per row (a ``datasets.Dataset``, a list).
        prompt_field: the column holding the prompt (text, or a chat ``messages`` list).
        indices: the rows to serve (default: all).
    """

    def __init__(self, rows: Any, prompt_field: str, indices: Sequence[int] | None = None) -> None:
        self.rows = rows
        self.prompt_field = prompt_field
        self.indices = list(range(len(rows))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Any, dict[str, Any]]:
        row = dict(self.rows[self.indices[index]])
        prompt = row.pop(self.prompt_field)
        if not is_prompt(prompt):  # DatasetDataModule checked every row at load: rows given some other way
            raise ValueError(
                f"DatasetDataModule: row {self.indices[index]} has prompt_field {self.prompt_field!r} = "
                f"{str(prompt)[:80]!r}; expected non-empty text or a chat messages list of "
                '{"role": ..., "content": ...}.'
            )
        return prompt, row


def collate_rows(items: list[tuple[Any, dict[str, Any]]]) -> PromptBatch:
    """One :class:`PromptBatch` of ``(prompt, metadata)`` pairs."""
    return PromptBatch(prompts=[p for p, _ in items], metadata=[m for _, m in items])


class DatasetDataModule(ResumableTrainLoader, LightningDataModule):
    """Prompts for RL training from JSONL / Parquet / CSV files, a ``datasets`` object, or a reasoning-gym task.

    Each training step gets one :class:`~lightning_offpolicy.batch.PromptBatch`: the rows' prompts,
    and every other column of each row as its metadata dict, which reaches the reward function. The
    order depends only on ``seed`` and the epoch, and a resumed run continues at the next untrained
    batch; every row is checked at load and before the first step (:meth:`check_prompt_lengths`).
    Examples and the checks: docs/journeys.md, "Data".

    Args:
        source: A ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file or a glob of them (read with
            ``datasets.load_dataset``), a directory written by ``Dataset.save_to_disk``, or
            ``reasoning_gym:<task>`` (prompt = the entry's ``question``, metadata = the whole entry,
            generated locally). From Python, also a ``datasets.Dataset`` / ``DatasetDict``.
        prompt_field: The column with the prompt: text, or a chat ``messages`` list of
            ``{"role", "content"}`` dicts. Ignored for reasoning-gym sources.
        val_source: Held-out prompts from another source (same forms as ``source``).
        val_size: Held-out prompts taken from ``source`` instead: a number of rows (int) or a
            fraction in (0, 1) (float), chosen at random with ``seed``.
        prompts_per_step: Prompts per training step on each process (the train batch size); the
            rollout side samples each ``samples_per_prompt`` times.
        val_prompts_per_step: Prompts per validation batch (default: ``prompts_per_step``).
        seed: Seed of the order, the held-out split, reasoning-gym (``None``: the run's ``seed_everything``).
        shuffle: Shuffle the training prompts (a new order each epoch); False keeps the file order.
        split: The split taken from a ``DatasetDict`` source.
        reward_fn: The reward for these prompts, exposed as ``self.reward_fn`` (which
            RolloutCallback uses when it has none): a callable, an import path such as
            ``my_pkg.rewards.exact_match``, or a list of weighted rewards (see
            :func:`lightning_offpolicy.data.rewards.resolve_reward`). Default: reasoning-gym's own scorer
            for reasoning-gym sources, none otherwise.
        reasoning_gym_size: Entries generated for a reasoning-gym ``source`` (``val_source``: a
            quarter of it, at least 1).
        reasoning_gym_config: Keyword arguments of the reasoning-gym task's config (e.g.
            ``{min_terms: 2, max_terms: 3}`` for ``basic_arithmetic``).
    """

    def __init__(
        self,
        source: str | Any,
        prompt_field: str = "prompt",
        val_source: str | Any | None = None,
        val_size: int | float | None = None,
        prompts_per_step: int = 16,
        val_prompts_per_step: int | None = None,
        seed: int | None = None,
        shuffle: bool = True,
        split: str = "train",
        reward_fn: RewardSpec = None,
        reasoning_gym_size: int = 1000,
        reasoning_gym_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        for setting, value in (("prompts_per_step", prompts_per_step), ("reasoning_gym_size", reasoning_gym_size)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}: `{setting}` must be a positive int, got {value!r}.")
        if val_prompts_per_step is not None and (not is_int(val_prompts_per_step) or val_prompts_per_step < 1):
            raise ValueError(
                f"{name}: `val_prompts_per_step` must be a positive int or None, got {val_prompts_per_step!r}."
            )
        if val_source is not None and val_size is not None:
            raise ValueError(f"{name}: set `val_source` or `val_size`, not both (got {val_source!r} and {val_size!r}).")
        # Dataset objects and callables stay out of the checkpoint's hyper-parameters.
        plain = (str, int, float, list, dict, type(None))
        objects = {"source": source, "val_source": val_source, "reward_fn": reward_fn}
        # Not the seed: Lightning refuses a key the module's hyper-parameters also have with another value.
        self.save_hyperparameters(ignore=["seed", *(k for k, v in objects.items() if not isinstance(v, plain))])
        self.source = source
        self.prompt_field = prompt_field
        self.prompts_per_step = prompts_per_step
        self.val_prompts_per_step = val_prompts_per_step or prompts_per_step
        self.seed = seed = run_seed(seed, "DatasetDataModule.seed")
        self.shuffle = shuffle
        self.split = split
        self.reasoning_gym_size = reasoning_gym_size
        self.reasoning_gym_config = dict(reasoning_gym_config or {})

        #: The reasoning-gym dataset object when ``source`` is ``reasoning_gym:<task>``, else None.
        self.procedural: Any = None
        #: ``(rows, prompt field, locator)`` of each loaded source, for the checks of every row.
        self._checked: list[tuple[Any, str, RowLocator]] = []
        rows, self.procedural = self._load(source, "source", seed, reasoning_gym_size)
        train_indices = list(range(len(rows)))
        self.val_dataset: PromptRows | None = None
        if val_size is not None:
            held_out = _held_out_count(val_size, len(rows), name)
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
            val_indices, train_indices = sorted(order[:held_out]), sorted(order[held_out:])
            self.val_dataset = PromptRows(rows, self._field(source), val_indices)
        elif val_source is not None:
            val_rows, _ = self._load(val_source, "val_source", seed + 1, max(1, reasoning_gym_size // 4))
            self.val_dataset = PromptRows(val_rows, self._field(val_source))
        self.train_dataset = PromptRows(rows, self._field(source), train_indices)
        if len(self.train_dataset) < prompts_per_step:
            raise ValueError(
                f"{name}: {len(self.train_dataset)} training prompts (after holding out "
                f"{len(rows) - len(self.train_dataset)}) are fewer than prompts_per_step={prompts_per_step}."
            )

        from lightning_offpolicy.data.rewards import ReasoningGymReward, resolve_reward

        #: What RolloutCallback scores with when it is given no reward_fn of its own.
        self.reward_fn = resolve_reward(reward_fn) if reward_fn is not None else None
        if self.reward_fn is None and self.procedural is not None:
            self.reward_fn = ReasoningGymReward(self.procedural)

    # ------------------------------------------------------------------------------ loading
    def _field(self, source: Any) -> str:
        return "question" if _is_reasoning_gym(source) else self.prompt_field

    def _load(self, source: Any, setting: str, seed: int, size: int) -> tuple[Any, Any]:
        name = type(self).__name__
        if _is_reasoning_gym(source):
            procedural, rows = reasoning_gym_rows(
                source[len(REASONING_GYM_PREFIX) :], size, seed, self.reasoning_gym_config
            )
            self._checked.append((rows, "question", RowLocator(setting)))
            return rows, procedural
        rows = load_source(source, self.split, setting)
        if len(rows) == 0:
            raise ValueError(f"{name}: `{setting}`={_describe(source)} has no rows.")
        if self.prompt_field not in rows.column_names:
            raise ValueError(
                f"{name}: `prompt_field`={self.prompt_field!r} is not a column of `{setting}`={_describe(source)}; "
                f"its columns: {', '.join(rows.column_names)}. Set `prompt_field` to the column with the prompts."
            )
        locate = RowLocator.for_source(source, setting)
        check_rows(rows, self.prompt_field, locate, name)  # every row now, not when its batch comes up
        self._checked.append((rows, self.prompt_field, locate))
        return rows, None

    def check_prompt_lengths(self, tokenizer: Any, max_new_tokens: int, limit: tuple[int, str] | None) -> None:
        """``ValueError`` naming the rows whose prompt + ``max_new_tokens`` does not fit ``limit``.

        ``RolloutCallback`` calls it before the first step, with the module's tokenizer and the
        context of the model and the engine; every prompt of every source is tokenized once, in
        batches.

        Args:
            tokenizer: the tokenizer the rollouts encode prompts with.
            max_new_tokens: ``rollout.sampling.max_new_tokens``.
            limit: ``(tokens, description)`` of the context
                (:func:`lightning_offpolicy.preflight.context_limit`); ``None``: not known, nothing checked.
        """
        if limit is None:
            return
        for rows, field, locate in self._checked:
            check_prompt_lengths(rows, field, locate, tokenizer, max_new_tokens, limit, type(self).__name__)

    # ------------------------------------------------------------------------------ loaders
    def train_dataloader(self) -> DataLoader:
        return self._resumable_loader(self.train_dataset, collate_rows)

    def val_dataloader(self) -> DataLoader | list:
        return self._held_out_loader(self.val_dataset, collate_rows)


def _is_reasoning_gym(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(REASONING_GYM_PREFIX)


def _describe(source: Any) -> str:
    return repr(source) if isinstance(source, str) else type(source).__name__


def _held_out_count(val_size: int | float, num_rows: int, name: str) -> int:
    if not is_real(val_size):
        raise ValueError(f"{name}: `val_size` must be an int (rows) or a float in (0, 1), got {val_size!r}.")
    if isinstance(val_size, float):
        if not 0.0 < val_size < 1.0:
            raise ValueError(f"{name}: `val_size`={val_size} as a fraction must lie in (0, 1); an int counts rows.")
        count = max(1, round(val_size * num_rows))
    else:
        count = val_size
    if not 1 <= count < num_rows:
        raise ValueError(
            f"{name}: `val_size`={val_size!r} holds out {count} of {num_rows} rows; it must leave at least one "
            "training row and hold out at least one."
        )
    return count
