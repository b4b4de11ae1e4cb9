"""benchmarks/vs_trl_long_tail.py: its task, its end-of-turn prior, its FLOP count and its packed / padded probe,
against hand computations.

The whole benchmark (a ~10M-parameter model, completions up to 512 tokens) takes minutes per step on
this machine and runs under ``make bench``; here its pieces run on tiny models.
"""

from __future__ import annotations

import math
import statistics
import string
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
import long_tail_probe  # noqa: E402  (benchmarks/ is not a package)
import long_tail_task  # noqa: E402
import vs_trl_long_tail  # noqa: E402


def test_score_by_hand():
    # 2 "b" among 8 characters, target 16: share 2/8, length factor 8/16.
    assert long_tail_task.score("bca 16:", "bxxbxxxx") == pytest.approx(2 / 8 * 8 / 16)
    # Longer than the target: the factor is target / length.
    assert long_tail_task.score("zz 20:", "z" * 40) == pytest.approx(1.0 * 20 / 40)
    assert long_tail_task.score("abc 30:", "") == 0.0
    assert long_tail_task.kit_reward(["ab 4:"], ["aaaa"], [{}]) == [1.0]
    assert long_tail_task.trl_reward(prompts=["ab 2:"], completions=["ab"], completion_ids=[[3]]) == [0.5]


def test_prompts_are_seeded_and_their_targets_spread_over_the_range():
    prompts = long_tail_task.make_prompts(400, seed=3)
    assert prompts == long_tail_task.make_prompts(400, seed=3) and prompts != long_tail_task.make_prompts(400, seed=4)
    low, high = long_tail_task.TARGET_RANGE
    targets = []
    for prompt in prompts:
        letters, target = prompt.rstrip(":").split(" ")
        assert letters.isalpha() and letters.islower() and 3 <= len(letters) <= 6
        targets.append(int(target))
    assert low <= min(targets) and max(targets) <= high
    # Log-uniform: the median is near the geometric mean of the range (128 for 16..1024).
    assert 90 < statistics.median(targets) < 180


def test_the_end_of_turn_prior_sets_the_chance_to_end_a_turn():
    from transformers import AutoModelForCausalLM

    from lightning_offpolicy.demo.tiny_bpe import tiny_config

    config = tiny_config("qwen2", 320, pad_token_id=0, eos_token_id=2, **long_tail_task.MODEL_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    embedding = model.get_input_embeddings().weight.detach().clone()
    chance = long_tail_task.add_end_of_turn_prior(model, end_of_turn=2, mean_length=64)
    assert chance == pytest.approx(1 / 64, rel=1e-6)  # bisection on the calibration sequences
    after = model.get_input_embeddings().weight.detach()
    dim = long_tail_task.PRIOR_DIM
    assert torch.equal(after[:, dim + 1 :], embedding[:, dim + 1 :])  # nothing else in the embeddings moved
    assert torch.all(after[:, dim] == long_tail_task.PRIOR_COMPONENT)
    # Held out from the calibration, and about the same at every position (not a mixture of rows that end
    # at once and rows that never end).
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        probs = model(input_ids=torch.randint(3, 320, (64, 40), generator=generator)).logits.softmax(-1)[..., 2]
    assert float(probs.mean()) == pytest.approx(1 / 64, rel=0.2)
    assert float(probs.std() / probs.mean()) < 0.5


def qwen2_dir(tmp_path: Path) -> Path:
    from lightning_offpolicy.demo.tiny_bpe import build_bpe_checkpoint

    texts = [f"{w} {n}:" for w in ("abc", "hello", "zq") for n in range(40)]
    return build_bpe_checkpoint(tmp_path / "model", texts, architecture="qwen2", vocab_size=300, chat_template=None)


def test_model_flops_by_hand(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir(tmp_path))
    c = model.config
    heads, kv, dim, h, i = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size
    # One Qwen2 layer: q / k / v with biases, o without, the gated MLP, two RMSNorm weights; then the final norm.
    layer = (h * heads * dim + heads * dim) + 2 * (h * kv * dim + kv * dim) + heads * dim * h + 3 * h * i + 2 * h
    body = c.num_hidden_layers * layer + h
    head = c.vocab_size * h
    lengths, responses = [7, 70], 60
    expected = (
        6 * body * 77 + 6 * head * responses + sum(6 * n * n * heads * dim * c.num_hidden_layers for n in lengths)
    )
    assert long_tail_probe.model_flops(model, lengths, responses) == expected


def test_the_probe_times_packed_and_padded_updates_of_the_same_batch(tmp_path):
    from lightning_offpolicy.batch import RolloutBatch

    model_dir = qwen2_dir(tmp_path)
    prompts, responses = [[5, 6, 7], [8, 9, 10, 11], [12, 13]], [[20] * 4, [21] * 40, [22] * 6]
    batch = RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=torch.tensor([0.0, 1.0, 0.5]),
        advantages=torch.tensor([-1.0, 1.0, 0.0]),
        group_ids=[0, 0, 0],
        policy_versions=[0, 0, 0],
        rollout_logprobs=[[-5.0] * len(r) for r in responses],
        pad_token_id=0,
    )
    torch.save(batch, tmp_path / "00001.pt")
    result = long_tail_probe.probe(model_dir, [tmp_path / "00001.pt"], threads=1, repeats=1)
    (one,) = result["batches"]
    real = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    assert one["real_tokens"] == one["packed_positions"] == sum(real) == 59
    # One padded micro-batch: 3 rows x (longest prompt 4 + longest response 40).
    assert one["padded_positions"] == 3 * 44
    assert result["padding_share"] == pytest.approx(1 - 59 / 132)
    assert result["predicted_speedup"] == pytest.approx(132 / 59)
    assert one["packed_s"] > 0 and one["padded_s"] > 0
    assert result["mfu"] == pytest.approx(one["model_gflop"] / one["packed_s"] / max(result["matmul_gflops"].values()))
    assert math.isfinite(result["speedup"])
    assert result["gemm_gflops"] > 0 and result["gemm_share_of_peak"] == pytest.approx(
        result["gemm_gflops"] / max(result["matmul_gflops"].values())
    )


def test_goals_are_judged_from_the_summary_and_the_probe():
    summary = [
        {"side": "trl", "final_reward": 0.10, "median_step_s": 40.0},
        {"side": "kit", "final_reward": 0.12, "median_step_s": 19.0},
        {"side": "kit-async", "final_reward": 0.09, "median_step_s": 15.0},
    ]
    probe = {
        "speedup": 2.5,
        "predicted_speedup": 3.0,
        "padding_share": 2 / 3,
        "mfu": 0.55,
        "mfu_padded": 0.5,
        "packed_gflops": 22.0,
        "matmul_gflops": {"1024": 40.0},
    }
    goals = vs_trl_long_tail.goals(summary, [probe])
    assert [g["met"] for g in goals] == [True, False, True, True]  # async: faster but a lower reward
    assert goals[0]["speed"] == pytest.approx(40 / 19)
    assert "0.83" in goals[2]["figure"]  # 2.5 / 3.0


def test_the_warm_up_rows_end_their_turns_after_a_geometric_number_of_tokens(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir(tmp_path))
    rows = long_tail_task.warm_up_rows(tokenizer, 2000, seed=0)
    assert rows == long_tail_task.warm_up_rows(tokenizer, 2000, seed=0)
    cap = long_tail_task.SETTINGS["max_new_tokens"] - 1
    lengths = []
    for prompt_ids, completion in rows:
        assert tokenizer.decode(prompt_ids) in long_tail_task.make_prompts(2000, seed=2)
        assert completion[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in completion[:-1]
        assert set(tokenizer.decode(completion[:-1])) <= set(string.ascii_lowercase + " ")
        lengths.append(len(completion) - 1)
    # Geometric with mean MEAN_LENGTH (1 + floor of an exponential), cut at the cap: mean and median by hand.
    mean, q = long_tail_task.MEAN_LENGTH, 1 - math.exp(-1 / long_tail_task.MEAN_LENGTH)
    assert 1 <= min(lengths) and max(lengths) <= cap
    assert statistics.mean(lengths) == pytest.approx(mean * (1 - math.exp(-cap / mean)) + 0.5, rel=0.08)
    assert statistics.median(lengths) == pytest.approx(1 + math.log(2) / q, rel=0.12)
