"""Name -> task class registry."""

from __future__ import annotations

from typing import Any

from lightning_offpolicy.data.tasks.base import Task
from lightning_offpolicy.data.tasks.builtin import AdditionTask, CopyTask, ReverseTask
from lightning_offpolicy.data.tasks.guess_number import GuessNumberTask
from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask

__all__ = ["TASKS", "get_task"]

#: Built-in tasks by name. Add your own: ``TASKS["mine"] = MyTask``.
TASKS: dict[str, type[Task]] = {
    ReverseTask.name: ReverseTask,
    AdditionTask.name: AdditionTask,
    CopyTask.name: CopyTask,
    GuessNumberTask.name: GuessNumberTask,
    MultiplyToolTask.name: MultiplyToolTask,
}


def get_task(name: str, **kwargs: Any) -> Task:
    """Instantiate the task registered as ``name`` with ``kwargs``.

    >>> get_task("addition").max_new_tokens
    4
    """
    try:
        cls = TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown task {name!r}; available tasks: {', '.join(sorted(TASKS))}.") from None
    return cls(**kwargs)
