"""torchmetrics classes: the correction and policy-loss metrics of a training step, and the held-out
evaluation's, each exact across devices."""

from lightning_offpolicy.metrics.correction import CorrectionMetrics
from lightning_offpolicy.metrics.evaluation import EvaluationMetrics
from lightning_offpolicy.metrics.policy_loss import PolicyLossMetrics

__all__ = ["CorrectionMetrics", "EvaluationMetrics", "PolicyLossMetrics"]
