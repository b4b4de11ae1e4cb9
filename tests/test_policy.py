"""lightning_offpolicy.train.policy: building the policy (LoRA, reference, checkpointing) outside the module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.train import policy as policy_building

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_offpolicy"


@pytest.mark.parametrize(
    ("mode", "peft", "ref_kl_coef", "expected"),
    [
        ("auto", False, 0.0, "none"),
        ("auto", True, 0.0, "none"),
        ("auto", False, 0.1, "frozen_copy"),
        ("auto", True, 0.1, "disable_adapter"),
        ("frozen_copy", True, 0.0, "frozen_copy"),
        ("none", False, 0.1, "none"),
    ],
)
def test_effective_reference_mode(mode, peft, ref_kl_coef, expected):
    model = torch.nn.Linear(2, 2)
    if peft:
        model.disable_adapter = lambda: None  # what the mode reads of a peft model
    assert policy_building.effective_reference_mode(mode, model, ref_kl_coef) == expected


def test_build_reference_copies_once_frozen_and_refuses_impossible_modes():
    model = build_tiny_llama(seed=0)
    reference = policy_building.build_reference(model, "auto", 0.1)
    assert reference is not model and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    assert policy_building.build_reference(model, "auto", 0.1, existing=reference) is reference
    assert policy_building.build_reference(model, "auto", 0.0) is None
    with pytest.raises(ValueError, match="ref_kl_coef > 0 needs a reference"):
        policy_building.build_reference(model, "none", 0.1)
    with pytest.raises(ValueError, match="needs a peft model"):
        policy_building.build_reference(model, "disable_adapter", 0.1)


def test_lora_rank_0_keeps_the_model_and_checkpointing_needs_transformers():
    model = torch.nn.Linear(2, 2)
    assert policy_building.add_lora(model, 0, 16.0, "all-linear") is model
    with pytest.raises(ValueError, match="gradient_checkpointing=True needs a transformers model"):
        policy_building.enable_gradient_checkpointing(model)


def test_importing_the_module_changes_no_global_state():
    # Everything module.py imports is imported first; then only module.py itself may run.
    code = """
import warnings, torch
import lightning.pytorch, torchmetrics
import lightning_offpolicy.correction, lightning_offpolicy.train.policy, lightning_offpolicy.train.step
import lightning_offpolicy.metrics.evaluation, lightning_offpolicy.metrics.correction, lightning_offpolicy.preflight
filters, safe = list(warnings.filters), list(torch.serialization.get_safe_globals())
import lightning_offpolicy.lightning.module
assert list(warnings.filters) == filters, "warning filters changed"
assert list(torch.serialization.get_safe_globals()) == safe, "safe globals changed"
assert lightning_offpolicy.correction.OffPolicyCorrectionConfig in safe
"""
    subprocess.run([sys.executable, "-c", code], check=True)
