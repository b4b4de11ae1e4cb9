"""The shipped recipes of the user journeys, run end to end on CPU with the tiny model."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.cli import main
from tests.test_vllm_fit import vllm_children
from tests.vllm_fixtures import requires_vllm

ROOT = Path(__file__).resolve().parents[1]


def documented_command(doc: Path, heading: str) -> list[str]:
    """The words of the first ``bash`` block after ``heading`` in ``doc`` (one command, continued lines)."""
    section = doc.read_text().split(heading, 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


@requires_vllm
@pytest.mark.slow
@pytest.mark.long(
    "the CPU command docs/journeys.md gives for the LoRA recipe, run as written: a fit with vLLM's adapter sync"
)
def test_lora_single_gpu_recipe_runs_on_cpu_with_the_tiny_model(tmp_path, vllm_engine_holder):
    vllm_engine_holder.close()  # one engine at a time on a small machine
    # The command docs/journeys.md gives for CPU (the model, the dtypes, the sizes overridden), as
    # written there, plus where this test wants the files.
    command = documented_command(ROOT / "docs" / "journeys.md", "### The same recipe on CPU")
    assert command[:4] == ["lightning-offpolicy", "fit", "--config", "configs/lora_single_gpu.yaml"], command
    main([
        *command[1:3], str(ROOT / command[3]), *command[4:],
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
