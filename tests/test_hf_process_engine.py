"""HFProcessEngine: the embedded engine's loop in a child process, the weights in shared memory.

References: the in-process ``HFEngine(dtype="float32")`` on the same weights and seed (the same loop
in the same precision: equal completions, token for token and logprob for logprob), the engine
contract (tests/engine_contract.py), and an asynchronous fit's staleness bound.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, HFProcessEngine, SamplingConfig
from tests.engine_contract import EngineContract
from tests.module_helpers import tiny_model

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def process_engine():
    """One child process for the tests of this file (each start costs seconds: a fresh interpreter)."""
    engine = HFProcessEngine(dtype="float32", pad_token_id=0, eos_token_id=2)
    yield engine
    engine.close()


def in_process(model: torch.nn.Module, version: int = 0) -> HFEngine:
    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=2)
    engine.update_weights(model, version)
    return engine


def test_completions_equal_the_in_process_engine_before_and_after_a_push(process_engine):
    model = tiny_model()
    process_engine.update_weights(model, version=0)
    sampling = SamplingConfig(max_new_tokens=10, samples_per_prompt=4, temperature=0.8, top_k=20)
    assert process_engine.generate(PROMPTS, sampling, seed=5) == in_process(model).generate(PROMPTS, sampling, seed=5)

    with torch.no_grad():  # the trainer's step
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    process_engine.update_weights(model, version=3)
    after = process_engine.generate(PROMPTS, sampling, seed=5)
    assert after == in_process(model, version=3).generate(PROMPTS, sampling, seed=5)
    assert {c.policy_version for c in after} == {3}
    # The push is an in-place copy into the shared memory the child reads: same tensors, new values.
    for mine, theirs in zip(process_engine.model.parameters(), model.parameters(), strict=True):
        assert mine.is_shared() and torch.equal(mine, theirs)
    process_engine.update_weights(tiny_model(), version=0)  # as the other tests expect


def test_a_failed_request_raises_with_the_childs_error_and_the_engine_keeps_working(process_engine):
    process_engine.update_weights(tiny_model(), version=0)
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    with pytest.raises(RuntimeError, match="engine process failed: IndexError"):
        process_engine.generate([[10_000]], sampling, seed=0)  # an id beyond the vocabulary
    assert len(process_engine.generate(PROMPTS, sampling, seed=0)) == len(PROMPTS)


def test_errors_before_start_and_settings():
    engine = HFProcessEngine(pad_token_id=0, eos_token_id=2)
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, SamplingConfig(), seed=0)
    with pytest.raises(ValueError, match="state dict before any model"):
        engine.update_weights({}, version=0)
    with pytest.raises(ValueError, match="request_timeout_s"):
        HFProcessEngine(request_timeout_s=0)
    assert not engine.share_weights  # asynchronous rollouts accept it


def test_close_ends_the_child_process():
    engine = HFProcessEngine(pad_token_id=0, eos_token_id=2)
    engine.update_weights(tiny_model(), version=0)
    process = engine.process
    assert process.is_alive()
    engine.close()
    assert not process.is_alive() and engine.process is None
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, SamplingConfig(), seed=0)


def test_asynchronous_fit_keeps_the_staleness_bound_and_closes_the_process(tmp_path):
    L.seed_everything(0)
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    engine = HFProcessEngine()
    callback = RolloutCallback(
        engine=engine,
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=7),
        asynchrony=AsyncSettings(max_staleness=1),
        seed=3,
    )
    versions = []

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            tokens = batch.rollout.response_mask.bool()
            versions.append(pl_module.policy_version - int(batch.rollout.policy_version[tokens].min()))

    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, callbacks=[callback, Spy()], default_root_dir=tmp_path, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64))
    assert module.policy_version == 5 and len(versions) == 5
    assert versions[0] == 0 and all(0 <= v <= 1 for v in versions), versions
    assert engine.process is None  # the callback closed the engine at the end of the fit


class TestHFProcessEngineContract(EngineContract):
    """The engine contract on the child-process engine, float32 as the trainer."""

    logprob_max_tol = 1e-4  # the same float32 model and loop as HFEngine, in another process

    @pytest.fixture
    def engine(self, trainer_model, process_engine):
        process_engine.update_weights(trainer_model, version=0)
        return process_engine
