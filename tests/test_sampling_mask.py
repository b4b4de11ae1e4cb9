"""top-k / top-p sampling masks: the engines report the support they kept, the trainer renormalizes over it.

References: a float64 re-derivation (the full logits of an unpadded row, ``log_softmax`` over the
kept ids only) for values and gradients; the engine's own logprobs for exactness (an engine that
holds exactly the trainer's weights must give log ratios of 0 at every token).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from lightning_offpolicy.rollout import HFEngine, HFProcessEngine, SamplingConfig
from lightning_offpolicy.rollout.engine import Completion
from lightning_offpolicy.rollout.hf.sampling import kept_support
from lightning_offpolicy.rollout.partial import _joined
from lightning_offpolicy.rollout.rollouter import Rollouter
from tests.engine_contract import batch_of

PAD, EOS = 0, 2
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
TRUNCATIONS = [dict(top_p=0.7), dict(top_k=5), dict(top_k=8, top_p=0.8)]


def sharp_model(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with its head scaled up: peaked distributions, so top-p cuts a real share."""
    model = build_tiny_llama(vocab_size=64, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def test_kept_support_lists_the_finite_scores_and_nothing_for_an_uncut_row():
    inf = float("-inf")
    scores = torch.tensor([[0.5, inf, 1.0, inf], [0.1, 0.2, 0.3, 0.4], [inf, inf, 2.0, inf]])
    assert kept_support(scores) == [[0, 2], [], [2]]


def _reference(double, prompt, response, support, temperature):
    """float64 log p_S(t) and H_S of one unpadded row: log_softmax over the kept ids only (with gradient)."""
    ids = torch.tensor([prompt + response])
    logits = double(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
    logprobs, entropies = [], []
    for t, token in enumerate(response):
        kept = support[t] or list(range(logits.shape[-1]))
        z = logits[t, kept]
        log_p = z - torch.logsumexp(z, dim=0)
        logprobs.append(log_p[kept.index(token)])
        entropies.append(-(log_p.exp() * log_p).sum())
    return torch.stack(logprobs), torch.stack(entropies)


def _batch(supports, responses, prompts=PROMPTS):
    return RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=[0.0] * len(prompts),
        advantages=torch.zeros(len(prompts)),
        group_ids=list(range(len(prompts))),
        policy_versions=[0] * len(prompts),
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        pad_token_id=PAD,
        sampling_supports=supports,
    )


@pytest.mark.parametrize("fused_head", [True, False])
def test_renormalized_logprobs_entropy_and_gradients_equal_a_float64_reference(fused_head):
    model = sharp_model()
    responses = [[20, 21, 22], [23], [24, 25]]
    supports = [
        [[20, 3, 40], [21], []],  # [] keeps the whole vocabulary
        [[50, 23, 1, 2, 4, 9]],
        [[24, 30], [7, 25, 8]],
    ]
    batch = _batch(supports, responses)
    temperature = 0.7
    logprobs, entropy = causal_lm_token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.prompt_length,
        temperature=temperature,
        return_entropy=True,
        fused_head=fused_head,
        sampling_support=batch.sampling_support,
    )
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
    ((logprobs * weights * batch.response_mask).sum() + (entropy * batch.response_mask).sum()).backward()
    got_grad = model.lm_head.weight.grad.clone()

    reference = copy.deepcopy(model).double()
    reference.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for i, (prompt, response, support) in enumerate(zip(PROMPTS, responses, supports, strict=True)):
        ref_lp, ref_h = _reference(reference, prompt, response, support, temperature)
        n = len(response)
        torch.testing.assert_close(logprobs[i, :n].double(), ref_lp.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(entropy[i, :n].double(), ref_h.detach(), atol=2e-5, rtol=0)
        total = total + (ref_lp * weights[i, :n].double()).sum() + ref_h.sum()
    total.backward()
    torch.testing.assert_close(got_grad.double(), reference.lm_head.weight.grad, atol=1e-5, rtol=1e-4)
    # Renormalizing changed the values: the full-vocabulary logprob of a cut position is lower.
    full = causal_lm_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length, temperature)
    assert bool((full[0, :2] < logprobs[0, :2].detach() - 1e-3).all())
    assert torch.equal(full[0, 2], logprobs[0, 2].detach())  # the uncut position: the same number


def test_support_ids_are_checked():
    model = sharp_model()
    batch = _batch([[[20]], [[23]], [[24]]], [[20], [23], [24]])
    with pytest.raises(ValueError, match=r"sampling_support must have shape \(3, 1\)"):
        causal_lm_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_length,
            sampling_support=torch.zeros(3, 2, 1).long(),
        )
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 64\)"):
        causal_lm_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_length,
            sampling_support=torch.full((3, 1, 1), 99),
        )


def _engine_and_trainer_logprobs(engine, model, truncation, seed=0):
    sampling = SamplingConfig(max_new_tokens=12, samples_per_prompt=4, temperature=0.9, **truncation)
    completions = engine.generate(PROMPTS, sampling, seed=seed)
    assert all(c.sampling_support is not None and len(c.sampling_support) == len(c.token_ids) for c in completions)
    batch = batch_of(PROMPTS, completions, pad_token_id=PAD)
    with torch.no_grad():
        masked = causal_lm_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_length,
            0.9,
            sampling_support=batch.sampling_support,
        )
        full = causal_lm_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length, 0.9)
    real = batch.response_mask.bool()
    return batch, (masked - batch.rollout_logprobs)[real], (full - batch.rollout_logprobs)[real]


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("sampler", ["lean", "generate"])
def test_an_engine_with_the_trainers_weights_gives_log_ratios_of_zero(sampler, truncation):
    model = sharp_model()
    engine = HFEngine(pad_token_id=PAD, eos_token_id=EOS, sampler=sampler)
    engine.update_weights(model, version=0)
    batch, log_ratio, unmasked = _engine_and_trainer_logprobs(engine, model, truncation)
    assert log_ratio.abs().max() < 2e-5, log_ratio.abs().max()
    # What the trainer measured before the mask: the log of the mass cut off, at the cut positions.
    cut = (batch.sampling_support >= 0).any(-1)[batch.response_mask.bool()]
    assert bool(cut.any())
    assert float(unmasked[cut].max()) < -1e-3


def test_the_process_engine_reports_the_support_too():
    model = sharp_model()
    engine = HFProcessEngine(pad_token_id=PAD, eos_token_id=EOS)
    try:
        engine.update_weights(model, version=0)
        _, log_ratio, _ = _engine_and_trainer_logprobs(engine, model, dict(top_p=0.7))
        assert log_ratio.abs().max() < 2e-5
    finally:
        engine.close()


def test_no_support_without_truncation_or_with_the_mask_off():
    model = sharp_model()
    engine = HFEngine(pad_token_id=PAD, eos_token_id=EOS)
    engine.update_weights(model, version=0)
    for sampling in (
        SamplingConfig(max_new_tokens=4, samples_per_prompt=2),
        SamplingConfig(max_new_tokens=4, samples_per_prompt=2, top_p=0.7, sampling_mask=False),
    ):
        assert all(c.sampling_support is None for c in engine.generate(PROMPTS, sampling, seed=0))


def test_a_batch_keeps_the_support_through_select_trim_and_micro_batches():
    batch = _batch([[[20, 3, 40], [21], []], [[50, 23]], [[24, 30], [7, 25, 8]]], [[20, 21, 22], [23], [24, 25]])
    assert batch.sampling_support.shape == (3, 3, 3)
    assert batch.sampling_support[0].tolist() == [[20, 3, 40], [21, -1, -1], [-1, -1, -1]]
    one = batch.select([1]).trim()
    assert one.sampling_support.tolist() == [[[50, 23]]]  # K trimmed to the widest kept set
    micro = batch.micro_batches(max_tokens=100, num_micro_batches=2)
    assert [m.sampling_support.shape[:2] for m in micro] == [(3, 3), (1, 3)]  # padding: row 0, as_padding
    with pytest.raises(ValueError, match="misses the sampled token at 1 response position"):
        _batch([[[20], [3], []], [[23]], [[24], [25]]], [[20, 21, 22], [23], [24, 25]]).validate()
    with pytest.raises(ValueError, match="lists a token twice at 1 response position"):
        _batch([[[20], [21, 4, 21], []], [[23]], [[24], [25]]], [[20, 21, 22], [23], [24, 25]]).validate()


def test_partial_rollouts_join_the_supports_of_their_segments():
    first = Completion(0, [4, 5], [-0.1, -0.2], "interrupted", 0, sampling_support=[[4, 9], []])
    more = Completion(0, [6], [-0.3], "length", 1, sampling_support=[[6]])
    assert _joined(first, more).sampling_support == [[4, 9], [], [6]]


class _NoSupportEngine:
    """An engine that samples with top-p but does not say what it kept."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner

    def generate(self, prompt_ids, sampling, seed=None):
        completions = self.inner.generate(prompt_ids, sampling, seed)
        for c in completions:
            c.sampling_support = None
        return completions


def test_top_p_with_an_engine_that_reports_no_support_is_refused_before_training():
    from lightning_offpolicy.batch import PromptBatch

    model = sharp_model()
    inner = HFEngine(pad_token_id=PAD, eos_token_id=EOS)
    inner.update_weights(model, version=0)
    tokenizer = CharTokenizer()
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2, top_p=0.7)
    rollouter = Rollouter(_NoSupportEngine(inner), tokenizer, lambda p, c, m: [0.0] * len(c), sampling)
    with pytest.raises(ValueError, match=r"_NoSupportEngine did not report which tokens it kept.*HFEngine"):
        rollouter.rollout(PromptBatch(["ab", "cd"]), index=0)
    rollouter.sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2, top_p=0.7, sampling_mask=False)
    assert rollouter.rollout(PromptBatch(["ab", "cd"]), index=0)[0].sampling_support is None


def _quickstart_mismatch(tmp_path, name: str, *overrides: str) -> dict[str, float]:
    """Mean |rollout_corr/kl| and rollout_corr/abs_logprob_diff_mean of a short quickstart fit."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_offpolicy.cli import main

    root = tmp_path / name
    main(
        [
            "fit",
            "--config",
            "configs/quickstart.yaml",
            "--trainer.max_steps=12",
            f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.default_root_dir={root}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.val_check_interval=1000",
            "--data.init_args.num_val_prompts=0",
            # The figures below were set at this lr (the quickstart's before it moved to 5e-4): 12 steps at
            # 1e-3 sharpen the policy enough that top_p 0.7 cuts off a large mass, the case the test is about.
            "--model.optimizer.init_args.lr=0.001",
            *overrides,
        ]
    )
    (version,) = list((root / "quickstart").iterdir())
    events = EventAccumulator(str(version))
    events.Reload()

    def mean(tag: str) -> float:
        values = [abs(e.value) for e in events.Scalars(tag)]
        return sum(values) / len(values)

    return {"kl": mean("rollout_corr/kl"), "abs_diff": mean("rollout_corr/abs_logprob_diff_mean")}


@pytest.mark.slow
def test_the_quickstart_with_top_p_measures_the_engine_not_the_truncation(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    full = _quickstart_mismatch(tmp_path, "full")
    masked = _quickstart_mismatch(tmp_path, "masked", "--rollout.sampling.top_p=0.7")
    unmasked = _quickstart_mismatch(
        tmp_path, "unmasked", "--rollout.sampling.top_p=0.7", "--rollout.sampling.sampling_mask=false"
    )
    # With the mask the bf16 engine's gap reads at the top_p=1.0 level (lower: top-p cuts the tail,
    # where bf16 rounding moves logprobs most); without it, the log of the mass cut off dominates.
    for key in ("kl", "abs_diff"):
        assert masked[key] <= 3 * full[key], (key, masked, full)
        assert unmasked[key] > 30 * full[key], (key, unmasked, full)


class _PartlyUnknownEngine(_NoSupportEngine):
    """Reports the support of every other token as unknown (a nucleus wider than its top logprobs)."""

    def generate(self, prompt_ids, sampling, seed=None):
        completions = self.inner.generate(prompt_ids, sampling, seed)
        for c in completions:
            c.sampling_support = [None if t % 2 else kept for t, kept in enumerate(c.sampling_support)]
        return completions


def test_tokens_whose_support_the_engine_could_not_tell_leave_the_loss(monkeypatch):
    import lightning_offpolicy.rollout.rollouter as rollouter_module
    from lightning_offpolicy.batch import PromptBatch

    monkeypatch.setattr(rollouter_module, "_warned", set())  # once per process: this test's own

    model = sharp_model()
    inner = HFEngine(pad_token_id=PAD, eos_token_id=EOS)
    inner.update_weights(model, version=0)
    sampling = SamplingConfig(max_new_tokens=5, samples_per_prompt=2, top_p=0.7)
    reward = lambda p, c, m: [float(len(x)) for x in c]  # noqa: E731 (varied rewards: nonzero advantages)
    known, _ = Rollouter(inner, CharTokenizer(), reward, sampling).rollout(PromptBatch(["ab", "cd"]), index=0)
    rollouter = Rollouter(_PartlyUnknownEngine(inner), CharTokenizer(), reward, sampling)
    with pytest.warns(UserWarning, match=r"\d+% of a batch's sampled tokens have no known kept set .* leave the loss"):
        partly, _ = rollouter.rollout(PromptBatch(["ab", "cd"]), index=0)
    odd = torch.zeros_like(known.response_mask, dtype=torch.bool)
    odd[:, 1::2] = True
    assert torch.equal(partly.response_mask, known.response_mask * (~odd).float())
    assert torch.equal(partly.advantages, known.advantages * (~odd).float())
    assert torch.equal(partly.input_ids, known.input_ids)  # still in the context
    unknown = int((known.response_mask.bool() & odd).sum())
    assert rollouter.last_stats["support_unknown_frac"] == pytest.approx(unknown / known.num_response_tokens)


def test_a_one_token_support_is_refused_or_named(monkeypatch):
    """top_k=1 is refused at set-up; a top_p that keeps one token everywhere (1e-9) trains nothing under the
    sampling mask (every kept logprob is 0) and is named once, at its first batch."""
    import warnings

    import lightning_offpolicy.rollout.rollouter as rollouter_module
    from lightning_offpolicy.batch import PromptBatch
    from lightning_offpolicy.lightning.callback import RolloutCallback

    with pytest.raises(ValueError, match=r"RolloutCallback\.sampling\.top_k=1 keeps one token"):
        RolloutCallback(sampling=SamplingConfig(top_k=1))
    monkeypatch.setattr(rollouter_module, "_warned", set())
    inner = HFEngine(pad_token_id=PAD, eos_token_id=EOS)
    inner.update_weights(sharp_model(), version=0)
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2, top_p=1e-9)
    rollouter = Rollouter(inner, CharTokenizer(), lambda p, c, m: [0.0] * len(c), sampling)
    with pytest.warns(UserWarning, match=r"Every sampled token of a batch was the only one its sampler kept"):
        batch, _ = rollouter.rollout(PromptBatch(["ab", "cd"]), index=0)
    assert all(len(kept) == 1 for support in batch.sampling_support for kept in support if kept is not None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rollouter.rollout(PromptBatch(["ab", "cd"]), index=1)  # once
