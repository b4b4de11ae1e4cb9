"""lightning_offpolicy: off-policy-corrected reinforcement learning of language models with PyTorch Lightning.

The public API, importable from here::

    from lightning_offpolicy import OffPolicyRLModule, RolloutCallback, VLLMEngine

Names load on first use (PEP 562), so ``import lightning_offpolicy`` and the pure-torch
``lightning_offpolicy.correction`` stay light: Lightning, transformers and vLLM are imported only by
the parts that need them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("lightning_offpolicy")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0.0.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # Training
    "OffPolicyRLModule": "lightning_offpolicy.lightning.module",
    "OffPolicyMixin": "lightning_offpolicy.lightning.mixin",
    "PromptBatch": "lightning_offpolicy.batch",
    "RolloutBatch": "lightning_offpolicy.batch",
    "PreemptionCheckpoint": "lightning_offpolicy.lightning.preemption",
    "RLProgressBar": "lightning_offpolicy.lightning.progress",
    # Rollout
    "RolloutCallback": "lightning_offpolicy.lightning.callback",
    "RolloutEngine": "lightning_offpolicy.rollout",
    "SamplingConfig": "lightning_offpolicy.rollout",
    "Completion": "lightning_offpolicy.rollout",
    "HFEngine": "lightning_offpolicy.rollout",
    "VLLMEngine": "lightning_offpolicy.rollout",
    "RemoteVLLMEngine": "lightning_offpolicy.rollout",
    # Correction (pure torch)
    "OffPolicyCorrectionConfig": "lightning_offpolicy.correction",
    "PolicyLossConfig": "lightning_offpolicy.correction",
    "compute_correction": "lightning_offpolicy.correction",
    "policy_loss": "lightning_offpolicy.correction",
    # Metrics (torchmetrics)
    "CorrectionMetrics": "lightning_offpolicy.metrics.correction",
    "PolicyLossMetrics": "lightning_offpolicy.metrics.correction",
    # Data, tokenizers, rewards
    "DatasetDataModule": "lightning_offpolicy.data",
    "PromptDataModule": "lightning_offpolicy.data.tasks",
    "CharTokenizer": "lightning_offpolicy.data.tokenizers",
    "HFTokenizer": "lightning_offpolicy.data.tokenizers",
    "WeightedReward": "lightning_offpolicy.data.rewards",
}

__all__ = [
    "CharTokenizer",
    "Completion",
    "CorrectionMetrics",
    "DatasetDataModule",
    "HFEngine",
    "HFTokenizer",
    "OffPolicyCorrectionConfig",
    "OffPolicyMixin",
    "OffPolicyRLModule",
    "PolicyLossConfig",
    "PolicyLossMetrics",
    "PreemptionCheckpoint",
    "PromptBatch",
    "PromptDataModule",
    "RLProgressBar",
    "RemoteVLLMEngine",
    "RolloutBatch",
    "RolloutCallback",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
    "WeightedReward",
    "compute_correction",
    "policy_loss",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_offpolicy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from lightning_offpolicy.batch import PromptBatch, RolloutBatch
    from lightning_offpolicy.correction import (
        OffPolicyCorrectionConfig,
        PolicyLossConfig,
        compute_correction,
        policy_loss,
    )
    from lightning_offpolicy.data import DatasetDataModule
    from lightning_offpolicy.data.rewards import WeightedReward
    from lightning_offpolicy.data.tasks import PromptDataModule
    from lightning_offpolicy.data.tokenizers import CharTokenizer, HFTokenizer
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.mixin import OffPolicyMixin
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.lightning.preemption import PreemptionCheckpoint
    from lightning_offpolicy.lightning.progress import RLProgressBar
    from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics
    from lightning_offpolicy.rollout import (
        Completion,
        HFEngine,
        RemoteVLLMEngine,
        RolloutEngine,
        SamplingConfig,
        VLLMEngine,
    )
