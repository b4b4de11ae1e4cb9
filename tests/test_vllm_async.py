"""The asynchronous RolloutCallback on the real vLLM engine: bounded staleness, metrics, engine death."""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.cli import main
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import AsyncSettings, SamplingConfig
from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine
from tests.test_async_rollout import VersionSpy
from tests.test_vllm_fit import vllm_children
from tests.vllm_fixtures import ENGINE_START, requires_vllm

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [requires_vllm, pytest.mark.slow]


def test_async_vllm_fit_from_the_yaml_stays_within_max_staleness_and_logs_the_queue(tmp_path, vllm_engine_holder):
    vllm_engine_holder.close()  # one engine at a time on a small machine
    main([
        "fit", "--config", str(ROOT / "configs" / "vllm_async.yaml"),
        "--trainer.max_steps=16", f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
        "--data.init_args.prompts_per_step=8", "--rollout.sampling.samples_per_prompt=4",
        # The config ships bypass mode, whose rollout_corr/* compare pi_theta per mini-batch (the
        # second one has moved a step): decoupled here, so the first batch's metric is the bf16 gap alone.
        "--model.correction.bypass_mode=false",
    ])  # fmt: skip
    (version,) = list((tmp_path / "vllm_async").iterdir())
    events = EventAccumulator(str(version), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    staleness_max = [e.value for e in events.Scalars("staleness/max")]
    assert len(staleness_max) == 8
    assert all(0 <= s <= 2 for s in staleness_max), staleness_max
    assert max(staleness_max) == 2, staleness_max  # generation really ran ahead of the trainer
    assert staleness_max[0] == 0
    histograms = events.Histograms("staleness/hist")
    assert len(histograms) == 8 and all(h.histogram_value.max <= 2 for h in histograms)
    for key in (
        "rollout/queue_depth",
        "rollout/wait_s",
        "rollout/tokens_per_s",
        "rollout/sync_s",
        "rollout/sync_probe_diff",
    ):
        assert events.Scalars(key), key
    assert all(e.value == 0 for e in events.Scalars("rollout/dropped_samples"))
    kl = [e.value for e in events.Scalars("rollout_corr/abs_logprob_diff_mean")]
    # The first batch is generated with the step's own weights: only the bf16 precision gap. Later
    # batches are 2 versions old, and the mismatch metric shows it.
    assert 1e-5 < kl[0] < 0.02, kl
    assert all(math.isfinite(v) for v in kl) and max(kl[1:]) > 5 * kl[0], kl
    assert events.Scalars("train/policy_version")[-1].value == 16
    assert not vllm_children(), vllm_children()


class KillEngineCore(L.Callback):
    """Kills the vLLM engine-core process after the given batch (an engine dying mid-run)."""

    def __init__(self, engine: VLLMEngine, after_batch: int) -> None:
        self.engine = engine
        self.after_batch = after_batch
        self.killed_at: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.after_batch:
            for proc in self.engine._engine_procs:
                if getattr(proc, "vllm_name", "").startswith("VLLM::EngineCor"):
                    proc.kill()
                    self.killed_at = time.monotonic()


def test_engine_death_mid_async_fit_stops_cleanly_and_keeps_the_checkpoint(tmp_path, tiny_ckpt, vllm_engine_holder):
    vllm_engine_holder.close()
    engine = VLLMEngine(model=None, request_timeout_s=120, start=ENGINE_START)
    module = OffPolicyRLModule(model=str(tiny_ckpt), optimizer=partial(torch.optim.AdamW, lr=1e-3), num_minibatches=2)
    spy = VersionSpy()
    killer = KillEngineCore(engine, after_batch=3)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=40,
        callbacks=[
            RolloutCallback(
                engine=engine,
                sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=7),
                asynchrony=AsyncSettings(max_staleness=2),
            ),
            spy,
            killer,
            checkpoints,
        ],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="VLLMEngine") as info:
        trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64))
    assert killer.killed_at is not None
    assert time.monotonic() - killer.killed_at < 60, "the fit did not stop promptly after the engine died"
    assert "exited" in str(info.value) or "dead" in str(info.value), str(info.value)
    staleness = spy.staleness()
    assert 4 <= len(staleness) <= 5 and all(s <= 2 for s in staleness), staleness
    # Nothing is lost: the last checkpoint written before the failure is complete and loads.
    last = max((tmp_path / "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["policy_version"] == state["global_step"] == 8
    assert not vllm_children(), vllm_children()
