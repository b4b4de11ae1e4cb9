"""HFEngine's lean sampling loop: the same tokens and logprobs as ``generate`` for the same seed."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.rollout.engine import SamplingConfig
from lightning_offpolicy.rollout.hf.engine import HFEngine
from lightning_offpolicy.rollout.hf.sampling import lean_unsupported
from tests.module_helpers import tiny_model

# Varying lengths: left padding, and position ids that differ per row.
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 13, 14, 15, 16], [1, 20, 21]]


def _run(model, sampler: str, sampling: SamplingConfig, seed: int = 0, **engine_kwargs):
    engine = HFEngine(pad_token_id=0, sampler=sampler, **{"eos_token_id": 2, **engine_kwargs})
    engine.update_weights(model, version=3)
    return engine.generate(PROMPTS, sampling, seed=seed)


def _assert_same(lean, reference) -> None:
    assert len(lean) == len(reference)
    for a, b in zip(lean, reference, strict=True):
        assert (a.prompt_index, a.token_ids, a.finish_reason, a.policy_version) == (
            b.prompt_index,
            b.token_ids,
            b.finish_reason,
            b.policy_version,
        )
        # Bitwise equal where measured (same ops on the same shapes); 1e-6 leaves room for other kernels.
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)


SAMPLINGS = {
    "t1": SamplingConfig(max_new_tokens=12, samples_per_prompt=3),
    "t0.7": SamplingConfig(max_new_tokens=12, temperature=0.7, samples_per_prompt=3),
    "t1.3-topk5": SamplingConfig(max_new_tokens=12, temperature=1.3, top_k=5, samples_per_prompt=2),
    "topp0.8": SamplingConfig(max_new_tokens=12, top_p=0.8, samples_per_prompt=2),
    "t0.9-topk8-topp0.9": SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=8, top_p=0.9, samples_per_prompt=2),
    "greedy": SamplingConfig(max_new_tokens=12, greedy=True, samples_per_prompt=1),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_lean_equals_generate(name):
    sampling = SAMPLINGS[name]
    model = tiny_model()
    for seed in (0, 1):
        _assert_same(_run(model, "lean", sampling, seed), _run(model, "generate", sampling, seed))


def test_lean_equals_generate_with_stops_and_chunks():
    # A flat random-init model stops at random points; eos and an extra stop id, and chunks of 3 rows:
    # rows that stopped get pad, chunks end early when all their rows stopped, the RNG stream carries over.
    model = build_tiny_llama(vocab_size=64, seed=0)
    sampling = SamplingConfig(max_new_tokens=24, temperature=1.5, samples_per_prompt=4)
    kwargs = {"eos_token_id": 2, "stop_token_ids": [3, 4, 5, 6, 7, 8], "max_batch_size": 3}
    lean = _run(model, "lean", sampling, **kwargs)
    _assert_same(lean, _run(model, "generate", sampling, **kwargs))
    reasons = {c.finish_reason for c in lean}
    assert reasons == {"stop", "length"}, reasons
    assert any(len(c.token_ids) < 24 for c in lean)


def test_lean_equals_generate_bfloat16_copy():
    model = tiny_model()
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=10, samples_per_prompt=3)
    lean = _run(model, "lean", sampling, dtype="bfloat16")
    _assert_same(lean, _run(model, "generate", sampling, dtype="bfloat16"))


def test_lean_seed_reproducible_and_rng_untouched():
    model = tiny_model()
    sampling = SamplingConfig(max_new_tokens=8, samples_per_prompt=4)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = _run(model, "lean", sampling, seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    second = _run(model, "lean", sampling, seed=5)
    other = _run(model, "lean", sampling, seed=6)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_lean_leaves_the_training_mode():
    model = tiny_model().train()
    _run(model, "lean", SamplingConfig(max_new_tokens=4, samples_per_prompt=1))
    assert model.training


def test_training_after_lean_sampling_with_shared_weights():
    # The lean loop runs under inference_mode: nothing it makes may leak into the module's autograd.
    model = tiny_model().train()
    sampling = SamplingConfig(max_new_tokens=6, samples_per_prompt=2)
    completions = _run(model, "lean", sampling)
    ids = torch.tensor([PROMPTS[0] + completions[0].token_ids])
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # an optimizer step, in place
    _assert_same(_run(model, "lean", sampling), _run(model, "generate", sampling))


def test_generation_benchmark_quick(tmp_path):
    import json

    from benchmarks.generation import main

    output = tmp_path / "generation.md"
    assert main(["--quick", "--shapes", "vs_trl", "--output", str(output)]) == 0
    report = json.loads(output.with_suffix(".json").read_text())
    result = report["results"]["vs_trl"]
    assert result["rows"] == 64 and result["max_new_tokens"] == 16
    assert result["equal_to_generate"] == {
        "lean": True,
        "generate": True,
        "lean, no_grad": True,
        "generate, static cache": result["equal_to_generate"]["generate, static cache"],
    }
    assert "| lean |" in output.read_text()


def test_unsupported_models_fall_back_to_generate(caplog):
    model = tiny_model()
    assert lean_unsupported(model) is None
    model.generation_config.repetition_penalty = 1.2
    assert "repetition_penalty" in lean_unsupported(model)
    sampling = SamplingConfig(max_new_tokens=6, samples_per_prompt=2)
    with caplog.at_level(logging.DEBUG, logger="lightning_offpolicy.rollout.hf.engine"):
        lean = _run(model, "lean", sampling)
    assert "repetition_penalty" in caplog.text
    _assert_same(lean, _run(model, "generate", sampling))
    assert "no config" in lean_unsupported(torch.nn.Linear(2, 2))


def test_sampler_is_checked():
    with pytest.raises(ValueError, match="sampler"):
        HFEngine(sampler="fast")


@pytest.mark.parametrize("family", ["llama-tied", "qwen2-tied", "gemma2", "gemma3", "qwen3-moe"])
def test_rows_that_stopped_leave_the_forward_passes_and_the_tokens_stay_generates(family):
    """Rows leave the batch as they stop (their KV cache rows with them, sliding-window layers included);
    the other rows' tokens and logprobs are still ``generate``'s for the same seed."""
    from lightning_offpolicy.modelcheck.families import build_tiny, family_config

    model = build_tiny(family_config(family))
    batch_sizes = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    # A fifth of the vocabulary stops a row: rows end at every step.
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.3, samples_per_prompt=4)
    kwargs = {"eos_token_id": 2, "stop_token_ids": list(range(3, 100))}
    lean = _run(model, "lean", sampling, **kwargs)
    lean_sizes, batch_sizes[:] = list(batch_sizes), []
    _assert_same(lean, _run(model, "generate", sampling, **kwargs))
    rows = len(PROMPTS) * sampling.samples_per_prompt
    lengths = sorted(len(c.token_ids) for c in lean)
    assert lengths[0] < lengths[-1], lengths
    # One prefill of every row, then one step per token of the longest row, each over the rows still going.
    assert lean_sizes[0] == rows and len(lean_sizes) == lengths[-1]
    assert lean_sizes[1:] == [sum(n > step for n in lengths) for step in range(1, lengths[-1])]
