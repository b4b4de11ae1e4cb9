"""Reward functions and small built-in tasks for examples, tests and benchmarks.

>>> from lightning_offpolicy.data.tasks import get_task
>>> task = get_task("reverse")
>>> task.reward("dcba", {"answer": "dcba"}), task.reward("dcbb", {"answer": "dcba"})
(1.0, 0.75)
"""

from lightning_offpolicy.data.tasks.base import RewardFn, Task, TaskReward, positional_score
from lightning_offpolicy.data.tasks.builtin import AdditionTask, CopyTask, ReverseTask
from lightning_offpolicy.data.tasks.datamodule import PromptDataModule, PromptDataset, collate_prompts
from lightning_offpolicy.data.tasks.guess_number import GuessNumberTask
from lightning_offpolicy.data.tasks.registry import TASKS, get_task
from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask

__all__ = [
    "TASKS",
    "AdditionTask",
    "CopyTask",
    "GuessNumberTask",
    "MultiplyToolTask",
    "PromptDataModule",
    "PromptDataset",
    "ReverseTask",
    "RewardFn",
    "Task",
    "TaskReward",
    "collate_prompts",
    "get_task",
    "positional_score",
]
