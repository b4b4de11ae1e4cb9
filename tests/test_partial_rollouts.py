"""Partial rollouts with the embedded engines: interrupt, continue under new weights, and the fit around it.

References are independent of the engine: the float64 teacher-forced logprobs of each weight set
over the whole sequence, and an uninterrupted call with the same seed. The vLLM engines' versions
are in tests/test_vllm_partial.py and tests/test_partial_remote.py.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, HFProcessEngine
from lightning_offpolicy.rollout.engine import INTERRUPTED, Completion, InterruptibleEngine, SamplingConfig
from lightning_offpolicy.rollout.partial import PartialStats, generate_resumable
from tests.module_helpers import perturbed, tiny_model
from tests.test_async_rollout import VersionSpy

PROMPTS = [[1, 5, 6, 7], [1, 9]]
#: A stop id outside the vocabulary: the completions run to max_new_tokens unless interrupted.
NEVER = 10_000


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float64 temperature-1 logprobs of ``tokens`` after ``prompt`` (the independent reference)."""
    with torch.no_grad():
        exact = copy.deepcopy(model).double()
        logits = exact(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@contextlib.contextmanager
def interrupt_at_forward(engine: HFEngine, model: torch.nn.Module, n: int):
    """Inside: a forward hook interrupts ``engine`` during the ``n``-th forward pass of ``model``."""
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1
        if calls["n"] == n:
            engine.interrupt()

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("sampler", ["lean", "generate"])
def test_an_interrupted_call_returns_the_tokens_so_far_with_their_logprobs(sampler):
    model = tiny_model()
    engine = HFEngine(pad_token_id=0, eos_token_id=NEVER, sampler=sampler)
    assert isinstance(engine, InterruptibleEngine)
    engine.update_weights(model, version=3)
    sampling = SamplingConfig(max_new_tokens=40, samples_per_prompt=2)
    full = engine.generate(PROMPTS, sampling, seed=0)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 40 for c in full)

    # Interrupted during the 6th forward pass: 6 tokens sampled, the loop stops before the 7th forward.
    with interrupt_at_forward(engine, model, 6):
        cut = engine.generate(PROMPTS, sampling, seed=0)
    for c, f in zip(cut, full, strict=True):
        assert c.finish_reason == INTERRUPTED and c.policy_version == 3
        assert c.token_ids == f.token_ids[:6]  # the same draws as the uninterrupted call, cut short
        torch.testing.assert_close(
            torch.tensor(c.logprobs, dtype=torch.float64),
            teacher_forced(model, PROMPTS[c.prompt_index], c.token_ids),
            atol=2e-5,
            rtol=0,
        )
    # The call consumed the interrupt: the next one runs to the end.
    assert [c.token_ids for c in engine.generate(PROMPTS, sampling, seed=0)] == [c.token_ids for c in full]


def test_a_completion_that_stopped_before_the_interrupt_keeps_its_stop():
    model = tiny_model()
    engine = HFEngine(pad_token_id=0, eos_token_id=NEVER)
    engine.update_weights(model, version=0)
    sampling = SamplingConfig(max_new_tokens=30, samples_per_prompt=2)
    full = engine.generate(PROMPTS, sampling, seed=0)
    # Let the 3rd token of the first completion be a stop id: that row ends there, the others go on.
    engine.stop_token_ids = [full[0].token_ids[2]]
    full = engine.generate(PROMPTS, sampling, seed=0)
    with interrupt_at_forward(engine, model, 8):
        cut = engine.generate(PROMPTS, sampling, seed=0)
    for c, f in zip(cut, full, strict=True):
        if f.finish_reason == "stop" and len(f.token_ids) <= 8:
            assert (c.finish_reason, c.token_ids) == ("stop", f.token_ids)
        else:
            assert c.finish_reason == INTERRUPTED and c.token_ids == f.token_ids[:8]
    assert any(c.finish_reason == "stop" for c in cut) and any(c.finish_reason == INTERRUPTED for c in cut)


def test_an_interrupt_between_chunks_returns_the_unstarted_rows_empty():
    model = tiny_model()
    engine = HFEngine(pad_token_id=0, eos_token_id=NEVER, max_batch_size=2)
    engine.update_weights(model, version=0)
    with interrupt_at_forward(engine, model, 3):
        cut = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=20, samples_per_prompt=2), seed=0)
    assert [len(c.token_ids) for c in cut] == [3, 3, 0, 0]
    assert all(c.finish_reason == INTERRUPTED and c.logprobs == c.token_ids[:0] for c in cut[2:])


class PushBetweenCalls:
    """A ``turn`` for generate_resumable that pushes ``new_weights`` (as ``version``) before the 2nd call."""

    def __init__(self, engine, new_weights: torch.nn.Module, version: int) -> None:
        self.engine, self.new_weights, self.version = engine, new_weights, version
        self.calls = 0

    @contextlib.contextmanager
    def __call__(self):
        self.calls += 1
        if self.calls == 2:
            self.engine.update_weights(self.new_weights, self.version)
        yield


def check_segments(completions: list[Completion], old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Each token's version and logprob are those of the weights that sampled it (old: 0, new: 1)."""
    for c in completions:
        versions = c.token_versions()
        cut = versions.count(0)
        assert versions == [0] * cut + [1] * (len(versions) - cut), versions
        prompt = PROMPTS[c.prompt_index]
        logprobs = torch.tensor(c.logprobs, dtype=torch.float64)
        under_old, under_new = teacher_forced(old, prompt, c.token_ids), teacher_forced(new, prompt, c.token_ids)
        # float32 batched sampling with a KV cache over hundreds of tokens vs a float64 unpadded forward.
        torch.testing.assert_close(logprobs[:cut], under_old[:cut], atol=3e-4, rtol=0)
        torch.testing.assert_close(logprobs[cut:], under_new[cut:], atol=3e-4, rtol=0)
        # The two weight sets really disagree on these tokens: the check above tells them apart.
        assert (under_old - under_new).abs().max() > 1e-2


def test_a_continued_completion_has_each_segments_version_and_logprobs():
    old = tiny_model()
    new = perturbed(old, 0.3)
    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=NEVER)
    engine.update_weights(old, version=0)
    sampling = SamplingConfig(max_new_tokens=24, samples_per_prompt=2)
    turn = PushBetweenCalls(engine, new, version=1)
    stats = PartialStats()
    with interrupt_at_forward(engine, engine.model, 5):
        completions = generate_resumable(engine, PROMPTS, sampling, seed=0, turn=turn, stats=stats)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in completions)
    assert all(c.token_versions() == [0] * 5 + [1] * 19 for c in completions)
    check_segments(completions, old, new)
    assert (stats.interrupted, stats.interruptions, stats.continuation_calls) == (4, 4, 1)


def test_rows_with_different_budgets_continue_in_separate_calls_within_max_new_tokens():
    model = tiny_model()
    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=NEVER, max_batch_size=2)
    engine.update_weights(model, version=0)
    stats = PartialStats()
    with interrupt_at_forward(engine, engine.model, 4):  # the first chunk cut at 4, the second not started
        completions = generate_resumable(
            engine, PROMPTS, SamplingConfig(max_new_tokens=12, samples_per_prompt=2), seed=0, stats=stats
        )
    assert [len(c.token_ids) for c in completions] == [12] * 4
    assert stats.continuation_calls == 2  # budgets 8 and 12


def test_the_process_engine_is_interrupted_across_processes():
    old = tiny_model()
    # Another policy of the same scale: perturbed(old, 0.3) adds noise 15x the weights' own std, and
    # over 400 tokens its inflated activations cost float32 sampling up to 4e-4 nats against the
    # float64 reference (1e-5 at this scale), past check_segments' tolerance wherever the cut lands.
    new = tiny_model(seed=1)
    engine = HFProcessEngine(pad_token_id=0, eos_token_id=NEVER)
    try:
        engine.update_weights(old, version=0)
        sampling = SamplingConfig(max_new_tokens=400, samples_per_prompt=2)
        # An interrupt with no call in flight cuts the next call short at once; the one after runs normally.
        engine.interrupt()
        early = engine.generate(PROMPTS, sampling, seed=0)
        assert all(c.finish_reason == INTERRUPTED and c.token_ids == [] for c in early)
        short = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=5, samples_per_prompt=2), seed=0)
        assert all(c.finish_reason == "length" for c in short)

        # A long call, interrupted from another thread a quarter into its full time (measured on this
        # machine, now: a fixed delay lands after the call on a fast one): it returns one forward
        # pass after the interrupt, not after its 400 tokens.
        began = time.perf_counter()
        engine.generate(PROMPTS, sampling, seed=1)
        delay = (time.perf_counter() - began) / 4
        began = time.perf_counter()
        timer = threading.Timer(delay, engine.interrupt)
        turn = PushBetweenCalls(engine, new, version=1)
        timer.start()
        first: list[Completion] = []

        @contextlib.contextmanager
        def timed_turn():
            with turn():
                yield
            if turn.calls == 1:
                first.append(time.perf_counter() - began)

        completions = generate_resumable(engine, PROMPTS, sampling, seed=0, turn=timed_turn)
        timer.join()
        total = time.perf_counter() - began
        cut = completions[0].token_versions().count(0)
        assert 0 < cut < 400, "the interrupt came after the call had ended: lengthen max_new_tokens"
        # The first call ended one forward pass after the interrupt, not after 400 tokens.
        per_token = (total - first[0]) / (400 - cut)
        assert first[0] - delay < max(0.25, 20 * per_token), (first[0], delay, per_token)
        assert all(len(c.token_ids) == 400 for c in completions)
        check_segments(completions, old, new)
    finally:
        engine.close()


# ------------------------------------------------------------------------------ the fit


class TimingSpy(L.Callback):
    """Records the RolloutCallback's per-batch timing and counts, and the seconds of each weight push."""

    def __init__(self, rollout: RolloutCallback) -> None:
        self.rollout = rollout
        self.batches: list[dict[str, float]] = []
        self.pushes: list[float] = []
        push = rollout._after_async_step

        def timed_push(pl_module):
            push(pl_module)
            if "sync_s" in rollout.last_timing:
                self.pushes.append(rollout.last_timing["sync_s"])

        rollout._after_async_step = timed_push

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(dict(self.rollout.last_timing))


def partial_fit(root, max_batches: int, partial_rollouts: bool = True, ckpt_path=None, max_new_tokens: int = 160):
    L.seed_everything(0)
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    callback = RolloutCallback(
        engine=HFEngine(dtype="float32", eos_token_id=NEVER, stop_token_ids=[]),
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=max_new_tokens),
        seed=3,
        asynchrony=AsyncSettings(max_staleness=2, partial_rollouts=partial_rollouts),
    )
    spy, timing = VersionSpy(), TimingSpy(callback)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_batches,
        callbacks=[callback, spy, timing],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64), ckpt_path=ckpt_path)
    return module, callback, spy, timing, trainer


def test_a_push_interrupts_long_requests_and_tokens_stay_within_the_bound(tmp_path):
    module, callback, spy, timing, _ = partial_fit(tmp_path, 6)
    assert len(spy.rows) == 6 and all(0 <= s <= 2 for s in spy.staleness()), spy.staleness()
    # Batches generated across pushes carry tokens of several versions; the oldest is within the bound.
    assert any(len(versions) > 1 for _, versions, _ in spy.rows), spy.rows
    interrupted = [b.get("interrupted_frac", 0.0) for b in timing.batches]
    assert max(interrupted) > 0, timing.batches
    assert all("tokens_per_version" in b and "continuation_calls" in b for b in timing.batches)
    # A push never waited for a request of 8 x 160 tokens: it cut it short after one forward pass.
    generate = sorted(b["generate_s"] for b in timing.batches)
    assert timing.pushes and max(timing.pushes) < generate[len(generate) // 2] / 4, (timing.pushes, generate)
    assert callback.producer is None  # stopped cleanly with the fit


def test_resume_after_a_stop_mid_interruption_loses_no_batch(tmp_path):
    _, callback, _, _, trainer = partial_fit(tmp_path, 3, max_new_tokens=60)
    checkpoint = tmp_path / "after3.ckpt"
    trainer.save_checkpoint(checkpoint)
    _, resumed_callback, resumed_spy, _, _ = partial_fit(tmp_path, 5, ckpt_path=checkpoint, max_new_tokens=60)
    assert resumed_callback.generated_batches == 5
    assert resumed_spy.staleness()[0] == 0  # in-flight partial rollouts were not saved: regenerated
    _, _, full_spy, _, _ = partial_fit(tmp_path / "full", 5, max_new_tokens=60)
    assert [r[2] for r in resumed_spy.rows] == [r[2] for r in full_spy.rows[3:]]


def test_partial_rollouts_name_what_they_need(tmp_path):
    with pytest.raises(ValueError, match="partial_rollouts=True needs max_staleness >= 1"):
        RolloutCallback(asynchrony=AsyncSettings(partial_rollouts=True))

    class NoInterrupt:
        share_weights = False

        def generate(self, prompt_ids, sampling, seed=None):
            return []

        def update_weights(self, source, version):
            pass

        def close(self):
            pass

    callback = RolloutCallback(engine=NoInterrupt(), asynchrony=AsyncSettings(max_staleness=1, partial_rollouts=True))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[callback], logger=False, default_root_dir=tmp_path)
    module = OffPolicyRLModule(model="tiny:reverse")
    with pytest.raises(ValueError, match="needs an engine that can be interrupted"):
        trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=8))


def test_a_push_interrupts_only_a_call_in_flight():
    """An idle producer (waiting for admission) is not interrupted: its next call would be cut for nothing."""
    from lightning_offpolicy.batch import PromptBatch
    from lightning_offpolicy.rollout.producer import RolloutProducer
    from tests.test_async_rollout import fake_rollout, wait_for

    interrupts: list[int] = []
    in_call, release = threading.Event(), threading.Event()
    producer: RolloutProducer

    def interrupt():  # an engine honours it: the call in flight returns
        interrupts.append(1)
        release.set()

    def produce(prompts, index):
        with producer.generation_turn():
            if index in (1, 2):  # these calls run until the test lets them go
                in_call.set()
                release.wait(10)
        return fake_rollout([0, 0]), 0.0

    stream = (PromptBatch(prompts=[f"p{i}"]) for i in range(100))
    producer = RolloutProducer(
        produce,
        stream,
        max_staleness=1,
        steps_per_batch=1,
        first_index=0,
        trainer_version=0,
        engine_version=0,
        interrupt=interrupt,
    )
    producer.start()
    try:
        wait_for(in_call.is_set)  # batch 0 done, batch 1 in its call
        release.set()
        wait_for(lambda: producer.queue_depth == 2)
        time.sleep(0.1)  # batch 2 is not admissible: the producer waits, idle
        with producer.engine_access():
            pass
        assert interrupts == []
        in_call.clear()
        release.clear()
        producer.take(0)
        with producer.engine_access():
            producer.set_engine_version(1)
        wait_for(in_call.is_set)  # batch 2 in its call now
        with producer.engine_access():
            pass
        assert interrupts == [1]
    finally:
        release.set()
        producer.close()
