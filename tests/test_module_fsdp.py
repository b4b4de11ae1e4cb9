"""FSDP2 on CPU: two ranks under ModelParallelStrategy (``fully_shard`` per decoder layer) == one process.

The same check as tests/test_module_ddp.py, for the sharded path: parameters are DTensors sharded
across the ranks, forwards all-gather them, gradients are reduce-scattered.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.module_helpers import fit_on, make_rollout, tiny_model
from tests.test_module_ddp import make_module

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_two_ranks.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """One two-rank run of tests/scripts/fsdp2_two_ranks.py for the checks below (a start costs ~10 s of
    imports on each rank); the directory its rank 0 wrote ``step.pt`` and ``saves.json`` to."""
    out = tmp_path_factory.mktemp("fsdp2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=out
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
def test_two_rank_fsdp2_step_equals_single_process_step(two_ranks):
    result = torch.load(two_ranks / "step.pt", weights_only=False)
    assert result["sharded"] > 0  # the parameters really were DTensors
    assert "cannot sample from a policy sharded over 2 ranks" in result["refused"]

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


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group (ModelParallelStrategy on one device), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_tiny_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("sampler", ["lean", "generate"])
def test_hf_engine_samples_from_a_sharded_policy_on_one_device(one_rank_group, sampler):
    """The default engine shares the (FSDP2-sharded) policy: it samples what the unsharded policy samples
    (the lean loop runs under no_grad there: FSDP2's unshard fails on inference tensors)."""
    from lightning_offpolicy.rollout.engine import SamplingConfig
    from lightning_offpolicy.rollout.hf.engine import HFEngine

    plain, sharded = tiny_model(), _sharded_tiny_model()
    assert any(hasattr(p, "full_tensor") for p in sharded.parameters())
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0, samples_per_prompt=2)
    out = []
    for model in (plain, sharded):
        engine = HFEngine(pad_token_id=0, eos_token_id=2, sampler=sampler)
        engine.update_weights(model, 1)
        out.append(engine.generate([[1, 5, 6, 7], [1, 9]], cfg, seed=4))
    assert [c.token_ids for c in out[1]] == [c.token_ids for c in out[0]]
    for a, b in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-5, atol=1e-5)


def test_engines_that_copy_the_policy_refuse_a_sharded_one_naming_what_works(one_rank_group):
    from lightning_offpolicy.rollout.hf.engine import HFEngine
    from lightning_offpolicy.rollout.hf.process import HFProcessEngine

    sharded = _sharded_tiny_model()
    for engine, name in (
        (HFEngine(dtype="float32"), "HFEngine(dtype='float32')"),
        (HFProcessEngine(), "HFProcessEngine"),
    ):
        with pytest.raises(ValueError, match=rf"{re.escape(name)} keeps its own copy .* VLLMEngine"):
            engine.update_weights(sharded, 0)


@pytest.mark.slow
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "lightning-alone"])
def test_a_sharded_checkpoint_that_fails_on_one_rank_leaves_the_previous_one_whole(two_ranks, atomic):
    """Three distributed checkpoints to one path under FSDP2, the second failing on rank 1 (a full disk while it
    writes its shard). Lightning alone writes over the previous directory: rank 0's new shard beside rank 1's
    old one, a checkpoint of neither save. With ``make_sharded_saves_atomic`` the previous one stays whole."""
    saves = json.loads((two_ranks / "saves.json").read_text())
    first, failed, third = saves["atomic" if atomic else "lightning-alone"]
    assert first["raised"] == third["raised"] == ""
    assert set(first["files"]) == set(third["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}
    assert third["files"]["__0_0.distcp"] != first["files"]["__0_0.distcp"]  # other weights: a new checkpoint
    if not atomic:  # what the wrapper prevents: a mix of the two saves under the final name
        assert failed["raised"].startswith("CheckpointException")
        assert failed["files"]["__0_0.distcp"] != first["files"]["__0_0.distcp"]
        assert failed["files"]["__1_0.distcp"] == first["files"]["__1_0.distcp"]
        return
    assert failed["raised"].startswith("OSError: [Errno 28] Checkpoint not saved: writing the sharded checkpoint ")
    assert "(rank 1: [Errno 28] No space left on device)" in failed["raised"]
    assert failed["files"] == first["files"]  # the previous checkpoint, byte for byte
    assert all(save["hidden"] == ["last.ckpt"] for save in (first, failed, third))  # no staging directory left
