"""Every example runs (short) in the suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_reward_example_runs_and_uses_its_reward(tmp_path):
    example = load("custom_reward")
    assert example.exact_match_reward(["rev ab="], ["ba"], [{"answer": "ba"}]) == [1.0]
    assert example.exact_match_reward(["rev ab="], ["bb"], [{"answer": "ba"}]) == [pytest.approx(0.2)]
    metrics = example.main(["--max-steps", "4", "--prompts-per-step", "4", "--logdir", str(tmp_path)])
    assert 0.0 <= metrics["train/reward"] <= 1.0
    assert (tmp_path / "custom_reward").is_dir()


def test_sft_then_rl_example_continues_the_sft_module_with_rl(tmp_path):
    example = load("sft_then_rl")
    metrics = example.main(
        ["--sft-steps", "40", "--rl-steps", "4", "--prompts-per-step", "4", "--logdir", str(tmp_path)]
    )
    # The same instance took 4 RL optimizer steps after its 40 SFT steps, with rollouts from the callback.
    assert metrics["policy_version"] == 40 + 4  # optimizer steps: 40 SFT, then 4 RL
    assert 0.0 <= metrics["train/reward"] <= 1.0
    assert metrics["greedy_reward_after_sft"] > 0.0  # 40 SFT steps already taught it something
    assert 1e-6 < metrics["rollout_corr/abs_logprob_diff_mean"] < 0.1  # the bf16 engine's gap, measured
    assert metrics["staleness/mean"] == 0.0
    assert (tmp_path / "sft_then_rl").is_dir()


def test_every_example_has_a_test():
    tested = {"custom_reward", "sft_then_rl", "own_model_and_data", "tool_use_agent"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_own_model_and_data_example_builds_a_chat_checkpoint_and_trains_it_on_reasoning_gym(tmp_path):
    example = load("own_model_and_data")
    checkpoint = tmp_path / "checkpoint"
    metrics = example.main(
        ["--checkpoint", str(checkpoint), "--sft-steps", "80", "--rl-steps", "4", "--logdir", str(tmp_path)]
    )
    # An ordinary Hugging Face directory: Qwen2 weights, a BPE tokenizer with a chat template.
    config = __import__("json").loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (
        "chat_template" in (checkpoint / "tokenizer_config.json").read_text()
        or (checkpoint / "chat_template.jinja").is_file()
    )
    # reasoning-gym's scorer on the model's own chat-format completions; that it learns (0.38 -> 0.64 over
    # the example's 200 steps) is the docs' figure, re-run by tests/test_docs_figures.py.
    assert metrics["steps"] == 4 and 0.0 <= metrics["reward_first"] <= 1.0 and 0.0 <= metrics["reward_last"] <= 1.0
    assert (tmp_path / "own_model_and_data").is_dir()


def test_tool_use_agent_example_trains_episodes_that_call_the_tool(tmp_path):
    """The example's path on a short warm-up (its learning at full length is measured by `make soak`'s
    configs/tool_use.yaml, the same run from YAML)."""
    example = load("tool_use_agent")
    metrics = example.main(["--sft-steps", "20", "--rl-steps", "1", "--logdir", str(tmp_path)])
    assert metrics["steps"] == 1 and 0.0 <= metrics["reward_last"] <= 1.0
    events = list((tmp_path / "tool_use_agent").rglob("events.out.tfevents.*"))
    assert events, "the example logs to TensorBoard"
