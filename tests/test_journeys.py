"""The shipped recipes of the user journeys, run end to end on CPU with the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.cli import main
from tests.test_vllm_fit import vllm_children
from tests.vllm_fixtures import requires_vllm

ROOT = Path(__file__).resolve().parents[1]


@requires_vllm
@pytest.mark.slow
def test_lora_single_gpu_recipe_runs_on_cpu_with_the_tiny_model(tmp_path, vllm_engine_holder):
    vllm_engine_holder.close()  # one engine at a time on a small machine
    main([
        "fit", "--config", str(ROOT / "configs" / "lora_single_gpu.yaml"),
        # What differs on a CPU machine: the model, the dtypes, the sizes.
        "--model.model=tiny:reverse", "--model.torch_dtype=float32", "--model.lora_rank=8",
        "--model.lora_alpha=16", "--model.optimizer.init_args.lr=1e-3", "--trainer.accelerator=cpu",
        "--rollout.engine.init_args.dtype=float32", "--rollout.engine.init_args.max_model_len=128",
        "--rollout.engine.init_args.enforce_eager=true", "--rollout.max_new_tokens=8",
        "--rollout.samples_per_prompt=2", "--data.init_args.prompts_per_step=4", "--trainer.max_steps=8",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ])  # fmt: skip
    (version,) = list((tmp_path / "lora_single_gpu").iterdir())
    events = EventAccumulator(str(version))
    events.Reload()
    assert events.Scalars("train/policy_version")[-1].value == 8
    assert all(e.value <= 2 for e in events.Scalars("staleness/max"))
    # float32 engine and trainer, adapters synced through vLLM's LoRA: the first (fresh) batch's
    # mismatch is the engine's numerical residual only.
    assert events.Scalars("rollout_corr/abs_logprob_diff_mean")[0].value < 1e-3
    assert not vllm_children(), vllm_children()
