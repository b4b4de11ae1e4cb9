"""Held-out evaluation: what one validation batch yields, and its metrics, exact across ranks.

On each validation batch the :class:`~lightning_offpolicy.lightning.callback.RolloutCallback` generates, with
the trainer's current weights, one greedy completion and ``k = samples_per_prompt`` sampled
completions per prompt (the training sampling settings), scores them with the run's reward
function and attaches an :class:`EvaluationBatch` to the :class:`~lightning_offpolicy.batch.PromptBatch`;
``OffPolicyRLModule.validation_step`` feeds it to :class:`EvaluationMetrics`, logged at the end of
the validation epoch:

=======================  ==================================================================
``val/reward_greedy``    mean reward of the greedy completion, over prompts
``val/reward_sampled``   mean reward of the sampled completions, over all samples
``val/pass@k``           fraction of prompts with at least one sample whose reward is
                         ``>= success_threshold`` (``k = samples_per_prompt``)
``val/length``           mean sampled completion length in tokens (the stop token included)
``val/length_greedy``    mean greedy completion length in tokens
=======================  ==================================================================

The samples of a prompt are drawn with a seed made of the callback's ``seed`` and the prompt's
text, not its position: every evaluation of the same prompt set uses the same random numbers
(evaluations compare across steps), and the values do not depend on the batch size or the
number of processes.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lightning_offpolicy.batch import EvaluationBatch

__all__ = ["EvaluationMetrics"]

_F64 = torch.float64


class EvaluationMetrics(Metric):
    """The ``val/*`` metrics of a whole validation epoch: float64 sums and counts, summed across ranks.

    ``compute()`` returns ``{"val/reward_greedy", "val/reward_sampled", "val/pass@k",
    "val/length", "val/length_greedy"}`` (0 for a metric with nothing accumulated).
    """

    full_state_update = False
    _SUMS = ("greedy_reward", "sampled_reward", "passed", "greedy_length", "sampled_length", "prompts", "samples")

    def __init__(self) -> None:
        super().__init__()
        for name in self._SUMS:
            self.add_state(name, default=torch.tensor(0.0, dtype=_F64), dist_reduce_fx="sum")

    def update(self, batch: EvaluationBatch) -> None:
        self.greedy_reward += batch.greedy_rewards.to(self.device, _F64).sum()
        self.sampled_reward += batch.sampled_rewards.to(self.device, _F64).sum()
        self.passed += batch.passed.to(self.device, _F64).sum()
        self.greedy_length += batch.greedy_lengths.to(self.device, _F64).sum()
        self.sampled_length += batch.sampled_lengths.to(self.device, _F64).sum()
        self.prompts += float(batch.greedy_rewards.numel())
        self.samples += float(batch.sampled_rewards.numel())

    def compute(self) -> dict[str, torch.Tensor]:
        prompts, samples = self.prompts.clamp(min=1), self.samples.clamp(min=1)
        return {
            "val/reward_greedy": self.greedy_reward / prompts,
            "val/reward_sampled": self.sampled_reward / samples,
            "val/pass@k": self.passed / prompts,
            "val/length": self.sampled_length / samples,
            "val/length_greedy": self.greedy_length / prompts,
        }
