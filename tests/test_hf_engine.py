"""HFEngine: its logprobs are those of the distribution it sampled from."""

from __future__ import annotations

import pytest
import torch

from lightning_offpolicy.rollout.engine import RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.hf.engine import HFEngine
from tests.engine_contract import EngineContract
from tests.module_helpers import tiny_model

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13, 14, 15, 16]]


def teacher_forced(model, prompt, tokens, sampling: SamplingConfig) -> torch.Tensor:
    """float64 logprobs of ``tokens`` with temperature, top-k and top-p applied as the sampler does."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the top token always stays).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=10, temperature=1.0, samples_per_prompt=3),
        SamplingConfig(max_new_tokens=10, temperature=0.6, samples_per_prompt=2),
        SamplingConfig(max_new_tokens=10, temperature=1.3, top_k=5, samples_per_prompt=2),
        SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.8, samples_per_prompt=2),
    ],
    ids=["t1", "t0.6", "t1.3-topk5", "topp0.8"],
)
def test_logprobs_equal_a_teacher_forced_computation(sampling):
    model = tiny_model()
    engine = HFEngine(pad_token_id=0, eos_token_id=2)
    assert isinstance(engine, RolloutEngine)
    engine.update_weights(model, version=7)
    completions = engine.generate(PROMPTS, sampling, seed=0)
    assert len(completions) == len(PROMPTS) * sampling.samples_per_prompt
    assert [c.prompt_index for c in completions] == [
        i for i in range(len(PROMPTS)) for _ in range(sampling.samples_per_prompt)
    ]
    for c in completions:
        assert c.policy_version == 7
        assert len(c.logprobs) == len(c.token_ids) > 0
        expected = teacher_forced(model, PROMPTS[c.prompt_index], c.token_ids, sampling)
        # float32 batched generation with left padding vs a float64 unpadded forward.
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, atol=2e-5, rtol=0)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 2
        else:
            assert len(c.token_ids) == sampling.max_new_tokens and 2 not in c.token_ids


def test_same_seed_same_samples_and_rng_untouched():
    model = tiny_model()
    engine = HFEngine(pad_token_id=0, eos_token_id=2, max_batch_size=2)
    engine.update_weights(model, version=0)
    sampling = SamplingConfig(max_new_tokens=6, samples_per_prompt=2)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, sampling, seed=5)
    after = torch.rand(1)
    b = engine.generate(PROMPTS, sampling, seed=5)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert before.item() == after.item()  # the global RNG of the trainer is not consumed


def test_errors():
    engine = HFEngine(pad_token_id=0, eos_token_id=2)
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, SamplingConfig())
    with pytest.raises(ValueError, match="dtype"):
        HFEngine(dtype="int8")
    no_ids = HFEngine()
    no_ids.update_weights(tiny_model(), 0)
    with pytest.raises(RuntimeError, match="pad_token_id"):
        no_ids.generate(PROMPTS, SamplingConfig())
    engine.update_weights(tiny_model(), 0)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingConfig())
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_bfloat16_engine_is_a_real_precision_mismatch():
    model = tiny_model()
    engine = HFEngine(dtype="bfloat16", pad_token_id=0, eos_token_id=2)
    engine.update_weights(model, version=0)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the trainer's module is untouched
    sampling = SamplingConfig(max_new_tokens=8, samples_per_prompt=4)
    gaps = []
    for c in engine.generate(PROMPTS, sampling, seed=0):
        expected = teacher_forced(model, PROMPTS[c.prompt_index], c.token_ids, sampling)
        gaps.append((torch.tensor(c.logprobs, dtype=torch.float64) - expected).abs().max().item())
    assert 1e-4 < max(gaps) < 0.5  # bf16 rounding: visible, small


class TestHFEngineContract(EngineContract):
    """The engine contract (tests/engine_contract.py) on the embedded engine, float32 as the trainer."""

    logprob_max_tol = 1e-4  # the same float32 model in the same process: only padding and batching differ

    @pytest.fixture
    def engine(self, trainer_model):
        engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=2)
        engine.update_weights(trainer_model, version=0)
        return engine
