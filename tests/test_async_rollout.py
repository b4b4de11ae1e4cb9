"""The asynchronous RolloutCallback: bounded staleness, equality with the synchronous path, resume, failures.

Real components throughout: the tiny SFT-warmed Llama, the embedded engine with its own float32 copy
(generation really runs in a background thread while the trainer updates the weights), Lightning's
fit loop. The vLLM variants are in tests/test_vllm_async.py.
"""

from __future__ import annotations

import pickle
import threading
import time
from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, SamplingConfig
from lightning_offpolicy.rollout.producer import RolloutProducer
from tests.module_helpers import TWO_RANK_STRATEGY


class VersionSpy(L.Callback):
    """Records, per trained batch, the trainer's version and the policy versions of its tokens."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, list[int], list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rollout = batch.rollout
        tokens = rollout.response_mask.bool()
        versions = sorted(set(rollout.policy_version[tokens].tolist()))
        self.rows.append((pl_module.policy_version, versions, list(batch.prompts)))

    def staleness(self) -> list[int]:
        return [version - min(versions) for version, versions, _ in self.rows]


def fit(
    max_batches: int,
    root,
    max_staleness: int = 0,
    sync_every: int = 1,
    num_minibatches: int = 2,
    engine=None,
    force_background: bool = False,
    ckpt_path=None,
    extra_callbacks=(),
    seed: int = 3,
    **callback_kwargs,
):
    L.seed_everything(0)
    module = OffPolicyRLModule(
        model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3), num_minibatches=num_minibatches
    )
    callback = RolloutCallback(
        engine=engine or HFEngine(dtype="float32"),
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=7),
        seed=seed,
        asynchrony=AsyncSettings(max_staleness=max_staleness, sync_every=sync_every),
        **callback_kwargs,
    )
    callback._background = callback._background or force_background
    spy = VersionSpy()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_batches * num_minibatches,
        callbacks=[callback, spy, *extra_callbacks],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, callback, spy, trainer


class SlowSteps(L.Callback):
    """Lengthens every training batch, so that generation outpaces training on a loaded machine too."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.25)


@pytest.mark.parametrize(("max_staleness", "sync_every", "num_minibatches"), [(2, 1, 2), (3, 2, 1), (1, 1, 1)])
def test_trained_tokens_are_never_staler_than_max_staleness(tmp_path, max_staleness, sync_every, num_minibatches):
    module, callback, spy, trainer = fit(
        6,
        tmp_path,
        max_staleness=max_staleness,
        sync_every=sync_every,
        num_minibatches=num_minibatches,
        extra_callbacks=[SlowSteps()],
    )
    staleness = spy.staleness()
    assert len(staleness) == 6
    assert all(0 <= s <= max_staleness for s in staleness), staleness
    # The generator really ran ahead: the bound is reached, not just respected by waiting.
    assert max(staleness) == max_staleness - max_staleness % num_minibatches, staleness
    assert staleness[0] == 0  # the first batch is generated with the initial weights
    assert module.policy_version == 6 * num_minibatches
    assert callback.generated_batches == 6
    assert callback.dropped_samples == 0  # bounded by admission, not by throwing samples away
    # Every trained batch is a complete group of distinct prompts (nothing dropped, nothing repeated).
    assert all(len(prompts) == 4 for _, _, prompts in spy.rows)
    assert callback.producer is None  # shut down with the fit
    # The progress bar shows the reward, the staleness and the generation speed.
    bar = trainer.progress_bar_metrics
    assert {"reward", "stale", "gen_tok/s"} <= set(bar) and bar["stale"] == staleness[-1], bar


def test_max_staleness_0_through_the_producer_equals_the_synchronous_callback(tmp_path):
    sync_module, _, sync_spy, _ = fit(4, tmp_path / "sync")
    async_module, _, async_spy, _ = fit(4, tmp_path / "async", force_background=True)
    assert async_spy.staleness() == [0, 0, 0, 0]
    assert [r[2] for r in async_spy.rows] == [r[2] for r in sync_spy.rows]  # same prompts, same order
    for a, b in zip(async_module.policy.parameters(), sync_module.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_continues_within_the_bound_without_a_burst(tmp_path):
    module, callback, spy, trainer = fit(4, tmp_path, max_staleness=2)
    checkpoint = tmp_path / "after4.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert callback.generated_batches == 4

    resumed, resumed_callback, resumed_spy, _ = fit(7, tmp_path, max_staleness=2, ckpt_path=checkpoint)
    staleness = resumed_spy.staleness()
    assert len(staleness) == 3 and all(s <= 2 for s in staleness), staleness
    # Queued rollouts were not saved: the first batch after the resume is generated from the restored weights.
    assert staleness[0] == 0
    assert resumed_spy.rows[0][0] == 8 and resumed.policy_version == 14
    assert resumed_callback.generated_batches == 7
    # It continues the prompt stream after the 4 trained batches instead of replaying them.
    full_module, _, full_spy, _ = fit(7, tmp_path / "full", max_staleness=2)
    assert [r[2] for r in resumed_spy.rows] == [r[2] for r in full_spy.rows[4:]]


class FailingEngine(HFEngine):
    """The embedded engine, failing at its ``fail_at``-th generate call (an engine dying mid-run)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(dtype="float32")
        self.calls = 0
        self.fail_at = fail_at
        self.closed = False

    def generate(self, prompt_ids, sampling, seed=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("engine process exited")
        return super().generate(prompt_ids, sampling, seed)

    def close(self) -> None:
        self.closed = True
        super().close()


def test_engine_failure_in_the_background_stops_the_fit_with_the_cause(tmp_path):
    engine = FailingEngine(fail_at=3)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="background rollout generation failed: ConnectionError") as info:
        fit(6, tmp_path, max_staleness=1, engine=engine)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert time.monotonic() - started < 120
    assert engine.closed
    assert not [t for t in threading.enumerate() if t.name == "RolloutProducer"]


def stuck_reward(prompts, completions, metadata):
    while True:  # a reward that never returns (a Python loop: the abandoned call is stopped too)
        time.sleep(0.01)


def test_a_stuck_reward_in_the_background_stops_the_fit_at_reward_timeout_s(tmp_path):
    started = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"background rollout generation failed: RewardError: reward function tests\.test_async_rollout\."
        r"stuck_reward did not return within reward_timeout_s=0\.5 s on a batch of 8 completions",
    ):
        fit(3, tmp_path, max_staleness=1, reward_fn=stuck_reward, reward_timeout_s=0.5)
    assert time.monotonic() - started < 60
    assert not [t for t in threading.enumerate() if t.name == "RolloutProducer"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_staleness": -1}, "max_staleness=-1 must be an int >= 0"),
        ({"max_staleness": 1.5}, "max_staleness=1.5"),
        ({"sync_every": 0}, "sync_every=0 must be an int >= 1"),
        ({"max_staleness": 1, "sync_every": 3}, "needs max_staleness >= sync_every - 1 = 2"),
        ({"sync_every": 2}, "needs max_staleness >= sync_every - 1 = 1"),
    ],
)
def test_bad_staleness_settings_name_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCallback(asynchrony=AsyncSettings(**kwargs))


def test_background_generation_refuses_an_engine_sharing_the_trainer_weights(tmp_path):
    with pytest.raises(ValueError, match=r"HFEngine\(dtype='float32' / 'bfloat16'\)"):
        fit(2, tmp_path, max_staleness=1, engine=HFEngine())


# ------------------------------------------------------------------------------ the producer alone


def fake_rollout(versions: list[int]):
    from lightning_offpolicy.batch import RolloutBatch

    n = len(versions)
    return RolloutBatch.from_sequences(
        prompt_ids=[[1, 2]] * n,
        response_ids=[[3, 4]] * n,
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        group_ids=torch.arange(n),
        policy_versions=versions,
        rollout_logprobs=[[-1.0, -1.0]] * n,
        pad_token_id=0,
    )


def test_producer_admission_follows_the_capacity_rule_and_regenerates_a_too_stale_batch():
    """Drive the producer by hand: what it starts, at which engine version, and the drop path."""
    engine = {"version": 0}
    started: list[tuple[int, int]] = []

    def produce(prompts, index):
        started.append((index, engine["version"]))
        return fake_rollout([engine["version"]] * 2), 0.0

    stream = (PromptBatch(prompts=[f"p{i}"]) for i in range(100))
    producer = RolloutProducer(
        produce, stream, max_staleness=2, steps_per_batch=2, first_index=0, trainer_version=0, engine_version=0
    )
    producer.start()
    try:
        wait_for(lambda: len(started) == 2)
        time.sleep(0.2)
        # Batch 0 (trained at 0) and batch 1 (trained at 2) fit the bound with version-0 weights; batch 2 does not.
        assert started == [(0, 0), (1, 0)]
        first, _ = producer.take(0)
        assert first.index == 0 and producer.queue_depth == 1
        time.sleep(0.2)
        assert len(started) == 2  # batch 2 would be trained at 4 > 0 + 2
        with producer.engine_access():
            engine["version"] = 2
            producer.set_engine_version(2)
        wait_for(lambda: len(started) == 3)
        assert started[2] == (2, 2)
        # The trainer took 4 steps instead of the announced 2: batch 1 (version 0) is now 4 versions old.
        producer.observe_steps_per_batch(4)
        with producer.engine_access():
            engine["version"] = 4
            producer.set_engine_version(4)
        taken, _ = producer.take(4)
        assert taken.prompts.prompts == ["p2"]  # batch 1 was too stale: skipped ...
        assert producer.dropped_samples == 2
        with producer.engine_access():
            engine["version"] = 6
            producer.set_engine_version(6)
        regenerated, _ = producer.take(8)
        assert regenerated.prompts.prompts == ["p1"]  # ... and generated again with fresh weights
        assert started[3] == (3, 6)
    finally:
        producer.close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


class RankRecorder(L.Callback):
    """Writes each rank's trained prompts and staleness to ``directory/rank<r>.json`` (the ranks' processes)."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.spy = VersionSpy()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.spy.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_end(self, trainer, pl_module):
        import json

        rows = {"staleness": self.spy.staleness(), "prompts": [r[2] for r in self.spy.rows]}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(rows))


def _async_two_rank_parts() -> tuple[OffPolicyRLModule, RolloutCallback, PromptDataModule]:
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3), num_minibatches=2)
    callback = RolloutCallback(
        engine=HFEngine(dtype="float32"),
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=7),
        asynchrony=AsyncSettings(max_staleness=2),
        seed=3,
    )
    return module, callback, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64)


def test_the_async_parts_pickle_as_ddp_spawn_sends_them_to_its_ranks():
    """``ddp_spawn`` pickles the module, the callbacks (an engine, the asynchrony) and the data to each rank
    (the 2-rank test below forks its ranks: tests/module_helpers.py)."""
    from multiprocessing.reduction import ForkingPickler

    module, callback, data = _async_two_rank_parts()
    module2, callback2, data2 = pickle.loads(ForkingPickler.dumps((module, callback, data)))
    assert callback2.asynchrony == callback.asynchrony and callback2.sampling == callback.sampling
    assert type(callback2.engine) is HFEngine and callback2.seed == 3
    assert module2.num_minibatches == 2 and data2.prompts_per_step == 4


@pytest.mark.slow
def test_two_rank_ddp_async_shards_the_prompts_and_keeps_the_bound(tmp_path):
    import json

    module, callback, data = _async_two_rank_parts()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TWO_RANK_STRATEGY,
        max_steps=8,
        callbacks=[callback, RankRecorder(tmp_path)],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert len(rank["staleness"]) == 4
        assert all(s <= 2 for s in rank["staleness"]) and max(rank["staleness"]) == 2, rank["staleness"]
    # Each rank trains its own shard: 2 ranks x 4 batches x 4 prompts, none trained twice (the
    # dataset repeats a few short prompts: compare multisets).
    from collections import Counter

    dataset = Counter(p for p, _ in PromptDataModule(task="reverse", num_train_prompts=64).train_dataset.items)
    trained = Counter(p for rank in ranks for batch in rank["prompts"] for p in batch)
    assert sum(trained.values()) == 32 and all(trained[p] <= dataset[p] for p in trained), trained
