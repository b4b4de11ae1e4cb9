"""Batches that flow from the prompt DataModule through the RolloutCallback into training_step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptBatch:
    """One step's prompts, as the prompt DataLoader yields them.

    The :class:`~lightning_offpolicy.rollout.RolloutCallback` attaches the generated, scored
    :class:`RolloutBatch` to ``rollout`` in ``on_train_batch_start``, with the weights of that
    very step, before ``training_step`` receives the batch.

    Attributes:
        prompts: prompt texts.
        metadata: one dict per prompt for the reward function (e.g. the expected answer).
        rollout: the rollouts of these prompts, filled in by the callback.
    """

    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    rollout: Any = None

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"PromptBatch: {len(self.prompts)} prompts but {len(self.metadata)} metadata entries.")

    def __len__(self) -> int:
        return len(self.prompts)
