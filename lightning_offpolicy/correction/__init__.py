"""Off-policy correction core: pure torch, usable from any trainer (no Lightning, vLLM or transformers).

>>> import torch
>>> from lightning_offpolicy.correction import OffPolicyCorrectionConfig, compute_correction, policy_loss
>>> prox = torch.tensor([[-1.0, -2.0, 0.0]]); rollout = torch.tensor([[-1.5, -2.0, 0.0]])
>>> mask = torch.tensor([[1.0, 1.0, 0.0]])
>>> out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.token_tis(clip_high=1.5))
>>> out.weights
tensor([[1.5000, 1.0000, 1.0000]])
"""

from lightning_offpolicy.correction.aggregation import aggregate
from lightning_offpolicy.correction.config import (
    PRESETS,
    CorrectionConfigError,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    check_compatible,
    check_objective_compatible,
    preset,
)
from lightning_offpolicy.correction.correction import CorrectionOutput, CorrectionStats, compute_correction
from lightning_offpolicy.correction.kl import KL_ESTIMATORS, kl_estimate
from lightning_offpolicy.correction.losses import PolicyLossInfo, policy_loss
from lightning_offpolicy.correction.ratios import safe_exp

__all__ = [
    "PRESETS",
    "CorrectionConfigError",
    "CorrectionOutput",
    "CorrectionStats",
    "KL_ESTIMATORS",
    "OffPolicyCorrectionConfig",
    "PolicyLossConfig",
    "PolicyLossInfo",
    "aggregate",
    "check_compatible",
    "check_objective_compatible",
    "compute_correction",
    "kl_estimate",
    "policy_loss",
    "preset",
    "safe_exp",
]
