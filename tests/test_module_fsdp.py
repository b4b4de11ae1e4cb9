"""FSDP2 on CPU: two ranks under ModelParallelStrategy (``fully_shard`` per decoder layer) == one process.

The same check as tests/test_module_ddp.py, for the sharded path: parameters are DTensors sharded
across the ranks, forwards all-gather them, gradients are reduce-scattered.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.module_helpers import fit_on, make_rollout, tiny_model
from tests.test_module_ddp import make_module

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_step.py"


@pytest.mark.slow
def test_two_rank_fsdp2_step_equals_single_process_step(tmp_path):
    out = tmp_path / "fsdp2.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    assert result["sharded"] > 0  # the parameters really were DTensors

    model = tiny_model()
    full = make_rollout(model, seed=3, rows=8)
    single = make_module(copy.deepcopy(model))
    single_trainer = fit_on(single, [full.select([0, 1, 4, 5, 2, 3, 6, 7])], max_steps=2)
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), single.policy.parameters(), strict=True))
    assert moved > 1e-4
    for name, param in single.policy.named_parameters():
        torch.testing.assert_close(result["weights"][name], param.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # The weights a rollout engine gets from the sharded trainer: whole tensors, checkpoint names.
    for name, tensor in single.policy.state_dict().items():
        exported = result["exported"][name]
        assert type(exported) is torch.Tensor and exported.shape == tensor.shape, name
        torch.testing.assert_close(exported, tensor, rtol=1e-5, atol=1e-6, msg=name)
    for key in ("rollout_corr/kl", "rollout_corr/chi2_seq", "ppo/clip_frac", "train/reward"):
        assert result["metrics"][key] == pytest.approx(float(single_trainer.callback_metrics[key]), rel=1e-5, abs=1e-7)
