"""Where prompts come from: data files and ``datasets`` objects, or a procedural reasoning-gym task.

Files are read by the ``datasets`` library (``load_dataset("json" | "parquet" | "csv")``), a
directory written by ``Dataset.save_to_disk`` by ``load_from_disk``; reasoning-gym tasks are
generated locally (``reasoning_gym.create_dataset``), nothing is downloaded.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from lightning_offpolicy.data.files import UTF8_ADVICE, file_builder, find_invalid_utf8_line

__all__ = ["REASONING_GYM_PREFIX", "close_task_names", "load_source", "reasoning_gym_rows"]

#: ``source: reasoning_gym:<task>`` generates the task's prompts with reasoning-gym.
REASONING_GYM_PREFIX = "reasoning_gym:"


def load_source(source: Any, split: str = "train", setting: str = "source") -> Any:
    """A ``datasets.Dataset`` from a file path or glob, a ``save_to_disk`` directory, or a Dataset / DatasetDict.

    Args:
        source: the path / glob, or a ``datasets.Dataset`` / ``DatasetDict``.
        split: the split taken from a ``DatasetDict`` (files load as the single split ``train``).
        setting: the name of the setting in error messages.
    """
    import datasets

    if isinstance(source, datasets.DatasetDict):
        return _pick_split(source, split, setting)
    if isinstance(source, datasets.Dataset):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"DatasetDataModule: `{setting}` must be a file path / glob, reasoning_gym:<task>, or a datasets.Dataset "
            f"/ DatasetDict; got {type(source).__name__}."
        )
    path = os.path.expanduser(os.fspath(source))
    if os.path.isdir(path):
        return load_source(datasets.load_from_disk(path), split, setting)
    files = sorted(glob.glob(path)) if glob.has_magic(path) else ([path] if os.path.isfile(path) else [])
    if not files:
        raise FileNotFoundError(
            f"DatasetDataModule: `{setting}`={source!r}: no such file"
            + (" (the glob matches nothing)" if glob.has_magic(path) else "")
            + f" (working directory: {os.getcwd()}). Give a JSONL / Parquet / CSV file, a glob, or "
            "reasoning_gym:<task>."
        )
    builders = {file_builder(f) for f in files}
    if len(builders) > 1:
        raise ValueError(f"DatasetDataModule: `{setting}`={source!r} matches files of several formats: {files[:5]}.")
    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"DatasetDataModule: `{setting}`={source!r} has no rows (empty file).")
    try:
        return datasets.load_dataset(builders.pop(), data_files=files, split="train")
    except Exception as error:
        if "corresponds to no data" in str(error):
            raise ValueError(f"DatasetDataModule: `{setting}`={source!r} has no rows.") from error
        if _caused_by(error, UnicodeDecodeError):
            where = find_invalid_utf8_line(files)
            if where is not None:
                raise ValueError(f"DatasetDataModule: `{setting}`={source!r}: {where}. {UTF8_ADVICE}") from error
        raise ValueError(
            f"DatasetDataModule: reading `{setting}`={source!r} ({len(files)} file(s)) failed: "
            f"{type(error).__name__}: {error}"
        ) from error


def _caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``error`` or an exception it was raised from / during is a ``kind``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _pick_split(dataset_dict: Any, split: str, setting: str) -> Any:
    if split not in dataset_dict:
        raise ValueError(
            f"DatasetDataModule: `{setting}` is a DatasetDict without the split {split!r}; it has "
            f"{', '.join(dataset_dict)}. Set `split`."
        )
    return dataset_dict[split]


def close_task_names(task: str, names: Any, limit: int = 8) -> list[str]:
    """Task names close to ``task``: spelling matches (``difflib``) first, then names containing it (or contained)."""
    import difflib

    lowered = task.lower().replace("-", "_").replace(" ", "_")
    spelled = difflib.get_close_matches(lowered, sorted(names), n=limit, cutoff=0.75)
    contained = [name for name in sorted(names) if lowered in name or name in lowered]
    return list(dict.fromkeys([*spelled, *contained]))[:limit]


def reasoning_gym_rows(task: str, size: int, seed: int, config: dict[str, Any] | None = None) -> tuple[Any, list]:
    """``(procedural dataset, entries)`` of reasoning-gym task ``task``, generated locally.

    Each entry is a dict with ``question``, ``answer`` and ``metadata`` (what the task's
    ``score_answer`` reads).
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = close_task_names(task, DATASETS)
        examples = close or sorted(DATASETS)[:12]
        hint = f"Did you mean {REASONING_GYM_PREFIX}{close[0]}? " if close else ""
        raise ValueError(
            f"DatasetDataModule: unknown reasoning-gym task {task!r} (source: {REASONING_GYM_PREFIX}{task}). {hint}"
            f"{'Similar' if close else 'Some'} tasks: {', '.join(examples)} ({len(DATASETS)} in all; "
            "list them with `python -c 'from reasoning_gym.factory import DATASETS; print(sorted(DATASETS))'`)."
        )
    procedural = reasoning_gym.create_dataset(task, size=size, seed=seed, **(config or {}))
    return procedural, [procedural[i] for i in range(len(procedural))]
