"""The rollout-engine contract, one suite run over every engine (as torchmetrics' ``MetricTester``).

A test module subclasses :class:`EngineContract` (or :class:`VLLMEngineContract`) as ``Test...`` and
provides two fixtures: ``engine`` (a started engine whose weights are the float32 tiny checkpoint's,
eos id 2, version 0) and ``trainer_model`` (a fresh float32 copy of that checkpoint: the trainer's
side). Every reference is independent of the engine: the trainer's teacher-forced logprobs and a
hand-written argmax loop. Tests that change the engine's weights restore them before they end.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time

import pytest
import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.data.environments import StepResult
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from lightning_offpolicy.rollout.engine import RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings
from lightning_offpolicy.rollout.vllm.sync.check import trainer_probe_logprobs
from tests.module_helpers import argmax_completion
from tests.vllm_fixtures import lose_syncs, residuals, reverse_prompts, teacher_forced_logprobs

# The tiny model is peaked: flattened (temperature 1.5) its nuclei at top_p 0.98 run past 20 tokens.
FLAT_TOP_P = SamplingConfig(max_new_tokens=6, temperature=1.5, samples_per_prompt=2, top_p=0.98)


def assert_kept_sets_are_nuclei(completions, prompts, model, sampling: SamplingConfig = FLAT_TOP_P) -> list[int]:
    """Every token's kept set is :func:`top_p_nuclei`'s (positions that float32 could decide either way skipped,
    at most 1 in 20); the widths compared."""
    widths, ambiguous = [], 0
    for c in completions:
        prompt, temperature = prompts[c.prompt_index], sampling.temperature
        nuclei, margins = top_p_nuclei(model, prompt, c.token_ids, temperature, sampling.top_p)
        assert len(c.sampling_support) == len(c.token_ids)
        for kept, nucleus, margin in zip(c.sampling_support, nuclei, margins, strict=True):
            if margin < 1e-5:  # a cumulative probability this close to 1 - top_p: float32 decides
                ambiguous += 1
                continue
            assert sorted(kept) == (sorted(nucleus) if len(nucleus) < model.config.vocab_size else [])
            widths.append(len(nucleus))
    assert widths and ambiguous <= len(widths) // 20
    return widths


@torch.no_grad()
def top_p_nuclei(
    model, prompt: list[int], completion: list[int], temperature: float, top_p: float
) -> tuple[list[list[int]], list[float]]:
    """vLLM's top-p rule on the model's float64 logits at each completion position: sorted ascending,
    the tokens whose cumulative probability stays <= 1 - top_p are cut (the last one never). Also the
    distance of the nearest cumulative sum to that threshold (how much rounding could move the cut)."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double() / temperature
    probs, order = torch.softmax(logits, -1).sort(-1)
    cumulative = probs.cumsum(-1)
    cut = cumulative <= 1 - top_p
    cut[:, -1] = False
    nuclei = [row_order[~row_cut].tolist() for row_order, row_cut in zip(order, cut, strict=True)]
    margins = (cumulative - (1 - top_p)).abs().min(-1).values.tolist()
    return nuclei, margins


@torch.no_grad()
def top_k_logprobs(model, prompts, completions, temperature: float, top_k: int) -> list[list[float]]:
    """Per-row forward: log_softmax of the top-k-filtered logits / T (the distribution sampled from)."""
    out = []
    for c in completions:
        p = prompts[c.prompt_index]
        logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1].float() / temperature
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0].tolist())
    return out


def batch_of(prompts: list[list[int]], completions: list, pad_token_id: int) -> RolloutBatch:
    """The validated batch of ``completions`` with their logprobs and kept supports (rewards 0)."""
    batch = RolloutBatch.from_sequences(
        prompt_ids=[prompts[c.prompt_index] for c in completions],
        response_ids=[c.token_ids for c in completions],
        rewards=[0.0] * len(completions),
        advantages=torch.zeros(len(completions)),
        group_ids=[c.prompt_index for c in completions],
        policy_versions=[0] * len(completions),
        rollout_logprobs=[c.logprobs for c in completions],
        pad_token_id=pad_token_id,
        sampling_supports=[c.sampling_support for c in completions],
    )
    batch.validate()
    return batch


def turn_contexts(episodes) -> tuple[list[list[int]], list]:
    """Each turn's context (the episode's ids before it) and its completion pointing at it, checking that the
    turns and the environment's ids add up to each episode's whole context."""
    contexts, completions = [], []
    for episode in episodes:
        context = list(episode.prompt_ids)
        for turn in episode.turns:
            contexts.append(list(context))
            completions.append(dataclasses.replace(turn.completion, prompt_index=len(contexts) - 1))
            context += turn.completion.token_ids + turn.observation_ids
        assert context == episode.context_ids
    return contexts, completions


class Replies:
    """An environment that answers "again" until the model has replied ``turns`` times."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def reset(self, prompt, metadata) -> None:
        self.replies = 0

    def step(self, reply: str) -> StepResult:
        self.replies += 1
        return StepResult(messages=[{"role": "user", "content": "again"}], done=self.replies >= self.turns)


class EngineContract:
    """What every :class:`~lightning_offpolicy.rollout.engine.RolloutEngine` guarantees."""

    #: Largest |engine - trainer| per-token logprob accepted at equal float32 weights.
    logprob_max_tol = 1e-3
    #: Mean of the same.
    logprob_mean_tol = 1e-4

    def test_is_a_rollout_engine(self, engine):
        assert isinstance(engine, RolloutEngine)

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_logprobs_are_the_trainers(self, engine, trainer_model, temperature):
        prompts = reverse_prompts(16)
        cfg = SamplingConfig(max_new_tokens=16, temperature=temperature, samples_per_prompt=4)
        completions = engine.generate(prompts, cfg, seed=11)
        assert [c.prompt_index for c in completions] == [i for i in range(16) for _ in range(4)]
        assert all(c.finish_reason in ("stop", "length") and c.policy_version == 0 for c in completions)
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) >= 1
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
            else:
                assert len(c.token_ids) == 16 and 2 not in c.token_ids
        reference = teacher_forced_logprobs(trainer_model, prompts, completions, temperature)
        res = residuals([c.logprobs for c in completions], reference)
        name = type(engine).__name__
        print(f"\n{name} T={temperature}: {res.numel()} tokens, |engine - trainer| max {res.max():.3g}")
        assert res.max() <= self.logprob_max_tol and res.mean() <= self.logprob_mean_tol
        if temperature != 1.0:  # processed logprobs: the raw (T=1) ones are clearly different
            raw = residuals(
                [c.logprobs for c in completions], teacher_forced_logprobs(trainer_model, prompts, completions, 1.0)
            )
            assert raw.mean() > 0.05

    def test_top_k_logprobs_are_of_the_filtered_distribution(self, engine, trainer_model):
        prompts = reverse_prompts(8, seed=1)
        completions = engine.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=3), seed=5)
        res = residuals([c.logprobs for c in completions], top_k_logprobs(trainer_model, prompts, completions, 0.8, 3))
        assert res.max() <= self.logprob_max_tol

    @pytest.mark.parametrize("truncation", [dict(top_p=0.7), dict(top_k=5, top_p=0.9)], ids=["top_p", "top_k_p"])
    def test_the_sampling_mask_makes_the_trainers_logprobs_the_engines(self, engine, trainer_model, truncation):
        """Renormalized over the support the engine reports, the trainer's logprobs are the engine's:
        log ratios of 0 at every token (float32 rounding); over the whole vocabulary they are not."""
        prompts = reverse_prompts(8, seed=3)
        sampling = SamplingConfig(max_new_tokens=12, temperature=0.9, samples_per_prompt=4, **truncation)
        batch = batch_of(prompts, engine.generate(prompts, sampling, seed=13), pad_token_id=0)
        kept = batch.sampling_support >= 0
        assert bool(kept.any()) and int(kept.sum(-1).max()) <= truncation.get("top_k", 64)
        real = batch.response_mask.bool()
        with torch.no_grad():
            args = (trainer_model, batch.input_ids, batch.attention_mask, batch.prompt_length, 0.9)
            masked = causal_lm_token_logprobs(*args, sampling_support=batch.sampling_support)[real]
            full = causal_lm_token_logprobs(*args)[real]
        log_ratio = (masked - batch.rollout_logprobs[real]).abs()
        print(f"\n{type(engine).__name__} {truncation}: |log ratio| max {log_ratio.max():.3g}")
        assert log_ratio.max() <= self.logprob_max_tol and log_ratio.mean() <= self.logprob_mean_tol
        # Without the mask, every cut position carries the log of the kept mass (< 0).
        cut = (kept.any(-1) & (kept.sum(-1) < 64))[real]
        assert bool(((full - batch.rollout_logprobs[real])[cut] < -self.logprob_max_tol).any())

    def test_greedy_equals_a_hand_written_argmax_loop(self, engine, trainer_model):
        prompts = reverse_prompts(6, seed=7)
        greedy = SamplingConfig(max_new_tokens=10, samples_per_prompt=1, greedy=True)
        completions = engine.generate(prompts, greedy, seed=3)
        assert [c.prompt_index for c in completions] == list(range(6))
        for c in completions:
            assert c.token_ids == argmax_completion(trainer_model, prompts[c.prompt_index], 10, eos=2)
        assert [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in completions]

    def test_episode_turns_are_generated_from_the_ids_the_engine_sampled(self, engine, trainer_model):
        """Token in, token out over turns: each turn continues the context of the engine's own ids and the
        environment's appended ids, and its logprobs are the trainer's on exactly that context. An engine that
        serves concurrent calls (a vLLM server) plays the episodes independently, as the rollouter has it."""
        tokenizer = CharTokenizer()
        settings = EpisodeSettings(environment=functools.partial(Replies, 3), max_turns=3, max_episode_tokens=48)
        runner = EpisodeRunner(settings, tokenizer, stop_ids=[2])
        prompts = [tokenizer.decode(p) for p in reverse_prompts(4, seed=9)]
        prompt_ids = runner.prompt_ids(prompts)
        assert prompt_ids == reverse_prompts(4, seed=9)
        sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, samples_per_prompt=2)

        def generate(ids, cfg, seed):
            return engine.generate(ids, cfg, seed=seed)

        concurrent = getattr(engine, "concurrent_calls", 1)
        episodes = runner.run(prompts, [{}] * 4, prompt_ids, sampling, generate, 21, 0, concurrent_episodes=concurrent)
        assert [e.group for e in episodes] == [i for i in range(4) for _ in range(2)]
        assert max(len(e.turns) for e in episodes) >= 2
        contexts, completions = turn_contexts(episodes)
        for episode in episodes:
            for turn in episode.turns[:-1]:  # each answered turn is followed by exactly the rendered reply
                assert turn.observation_ids == tokenizer.encode(" again ", add_bos=False)
        reference = teacher_forced_logprobs(trainer_model, contexts, completions, 1.0)
        res = residuals([c.logprobs for c in completions], reference)
        assert res.max() <= self.logprob_max_tol and res.mean() <= self.logprob_mean_tol

    def test_seeded_generation_is_reproducible(self, engine):
        prompts = reverse_prompts(3, seed=4)
        prompts = prompts + [prompts[0]]  # the same prompt twice in one call
        cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, samples_per_prompt=4)

        def run(seed):
            return [(c.token_ids, c.logprobs) for c in engine.generate(prompts, cfg, seed=seed)]

        first, again, other = run(123), run(123), run(124)
        assert first == again
        assert first != other
        group0 = [t for t, _ in first[:4]]
        assert len({tuple(t) for t in group0}) > 1  # the samples of a group differ
        assert group0 != [t for t, _ in first[12:16]]  # a repeated prompt gets its own samples
        assert len(engine.generate(prompts, cfg)) == 16  # unseeded: the engine's own random state

    def test_stops_on_eos_token_id_only(self, engine, monkeypatch):
        """The stop id is the engine's eos_token_id, not the checkpoint's (2 here)."""
        monkeypatch.setattr(engine, "eos_token_id", 5)
        completions = engine.generate(reverse_prompts(16, seed=7), SamplingConfig(max_new_tokens=12), seed=3)
        for c in completions:
            assert (c.finish_reason, c.token_ids[-1]) == ("stop", 5) or (c.finish_reason, len(c.token_ids)) == (
                "length",
                12,
            )
            assert 5 not in c.token_ids[:-1]
        assert any(2 in c.token_ids for c in completions)  # the checkpoint's eos no longer stops

    def test_stops_on_every_stop_id_and_truncates_at_the_first(self, engine, monkeypatch):
        """Two stop ids (eos + a second id, as a generation config's eos list): each completion ends at the
        first of either. Reference: the same seeded samples with eos alone, cut by hand."""
        prompts = reverse_prompts(16, seed=7)
        cfg = SamplingConfig(max_new_tokens=12, temperature=1.5)
        monkeypatch.setattr(engine, "stop_token_ids", [])
        reference = engine.generate(prompts, cfg, seed=3)
        counts = torch.bincount(torch.tensor([t for c in reference for t in c.token_ids[:-1] if t != 2]))
        second = int(counts.argmax())  # the id the model samples most often before the end
        monkeypatch.setattr(engine, "stop_token_ids", [second])
        both = engine.generate(prompts, cfg, seed=3)
        ends = set()
        for got, ref in zip(both, reference, strict=True):
            cut = next((i + 1 for i, t in enumerate(ref.token_ids) if t in (2, second)), None)
            expected = ref.token_ids[:cut] if cut is not None else ref.token_ids
            assert got.token_ids == expected
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs[: len(expected)]))
            assert got.finish_reason == ("stop" if cut is not None else "length")
            if cut is not None:
                ends.add(got.token_ids[-1])
        assert ends == {2, second}

    def test_throughput(self, engine):
        prompts = reverse_prompts(64, seed=2)
        cfg = SamplingConfig(max_new_tokens=16, samples_per_prompt=1)
        engine.generate(prompts, cfg, seed=0)
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            engine.generate(prompts, cfg, seed=0)
            times.append(time.perf_counter() - begin)
        print(f"\n{type(engine).__name__}: 64 prompts x <=16 tokens in {min(times):.3f} s")
        assert min(times) < 60

    def test_update_weights_changes_generation_and_restoring_restores_it(self, engine, trainer_model):
        prompts = reverse_prompts(4, seed=3)
        cfg = SamplingConfig(max_new_tokens=8, samples_per_prompt=2)
        original = {k: v.clone() for k, v in trainer_model.state_dict().items()}
        before = engine.generate(prompts, cfg, seed=5)
        uniform = -math.log(trainer_model.config.vocab_size)
        with torch.no_grad():
            trainer_model.lm_head.weight.zero_()  # every token uniform over the vocabulary
        stale = engine.generate(prompts, cfg, seed=5)  # the engine holds its own weights until a sync
        assert [(c.token_ids, c.logprobs) for c in stale] == [(c.token_ids, c.logprobs) for c in before]
        try:
            engine.update_weights(trainer_model, 7)
            self.check_synced(engine, checked=True)
            assert engine.version == 7
            for temperature in (1.0, 0.7):
                completions = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=temperature))
                assert {c.policy_version for c in completions} == {7}
                lps = torch.tensor([lp for c in completions for lp in c.logprobs])
                torch.testing.assert_close(lps, torch.full_like(lps, uniform), atol=1e-4, rtol=0)
        finally:  # restore: a state dict this time (no module: a self-check cannot run)
            engine.update_weights(original, 8)
        self.check_synced(engine, checked=False)
        assert engine.version == 8
        restored = engine.generate(prompts, cfg, seed=5)
        assert [(c.token_ids, c.logprobs) for c in restored] == [(c.token_ids, c.logprobs) for c in before]
        assert {c.policy_version for c in restored} == {8}
        trainer_model.load_state_dict(original)
        engine.update_weights(trainer_model, 0)  # back to the fixture's state, from a module

    def check_synced(self, engine, checked: bool) -> None:
        """After ``update_weights``: engine-specific evidence that the sync was checked (or not)."""


class VLLMEngineContract(EngineContract):
    """The contract plus the weight-sync self-check of the vLLM engines."""

    def check_synced(self, engine, checked: bool) -> None:
        if checked:
            assert engine.last_sync_check_max_abs_diff <= 1e-3
            assert set(engine.stats()) >= {"vllm/sync_s", "vllm/sync_check_max_abs_diff", "vllm/tokens_per_s"}
        else:
            assert engine.last_sync_check_max_abs_diff is None

    def test_the_worker_records_each_tokens_nucleus_exactly_however_wide(self, engine, trainer_model):
        """The kept set of every token is the nucleus vLLM's rule gives on the trainer's float64 logits,
        wide nuclei included (far past the top logprobs a request could afford)."""
        prompts = reverse_prompts(4)
        completions = engine.generate(prompts, FLAT_TOP_P, seed=0)
        assert engine.records_kept_sets  # known once the engine started (or connected)
        widths = assert_kept_sets_are_nuclei(completions, prompts, trainer_model)
        print(f"kept-set widths: mean {sum(widths) / len(widths):.1f}, widest {max(widths)}")
        assert max(widths) > engine.support_logprobs  # nuclei top logprobs would not have shown

    def test_calls_side_by_side_each_get_their_own_kept_sets(self, engine, trainer_model):
        """Calls from several threads (episodes that go on alone) share the engine's batches; each takes the
        records of its own requests."""
        prompts = reverse_prompts(6, seed=11)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            calls = [pool.submit(engine.generate, prompts[2 * i : 2 * i + 2], FLAT_TOP_P, i) for i in range(3)]
            results = [call.result() for call in calls]
        for i, completions in enumerate(results):
            assert_kept_sets_are_nuclei(completions, prompts[2 * i : 2 * i + 2], trainer_model)

    def test_a_nucleus_wider_than_the_reported_top_logprobs_is_unknown(self, engine, monkeypatch):
        """Where the worker does not record kept sets, the top logprobs show them: the top token alone never
        shows a whole nucleus, so every support is unknown, unless top_k bounds it."""
        engine.generate(reverse_prompts(1), SamplingConfig(max_new_tokens=1))  # started (connected): then set
        monkeypatch.setattr(engine, "records_kept_sets", False)
        monkeypatch.setattr(engine, "support_logprobs", 1)
        sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, samples_per_prompt=2, top_p=0.99)
        completions = engine.generate(reverse_prompts(4), sampling, seed=0)
        assert all(kept is None for c in completions for kept in c.sampling_support)
        completions = engine.generate(reverse_prompts(4), dataclasses.replace(sampling, top_k=1), seed=0)
        assert all(c.sampling_support == [[t] for t in c.token_ids] for c in completions)

    def test_self_check_catches_a_sync_that_did_not_arrive(self, engine, trainer_model, tiny_ckpt, monkeypatch):
        engine.update_weights(trainer_model, 20)  # a good sync: the check's reference point
        lose_syncs(monkeypatch, engine)  # the peer bug: nothing arrives
        with torch.no_grad():
            trainer_model.lm_head.weight.zero_()
        with pytest.raises(RuntimeError, match="did not arrive"):
            engine.update_weights(trainer_model, 21)
        assert engine.version == 20
        # A small update (below the tolerance) that did not arrive: the engine did not move, the trainer did.
        monkeypatch.setattr(engine, "weight_sync_tolerance", 0.5)
        fresh = type(trainer_model).from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
        probe = engine._probe(fresh)
        before = trainer_probe_logprobs(fresh, probe)
        with torch.no_grad():
            fresh.lm_head.weight.add_(
                0.003 * torch.randn(fresh.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
            )
        moved = float((trainer_probe_logprobs(fresh, probe) - before).abs().max())
        assert 0.5 / 100 < moved < 0.5  # below the tolerance, above the "did it move" threshold
        with pytest.raises(RuntimeError, match="did not change at all"):
            engine.update_weights(fresh, 22)
        assert engine.version == 20
        monkeypatch.undo()
        engine.update_weights(type(trainer_model).from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval(), 0)
