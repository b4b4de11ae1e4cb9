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


def test_every_example_has_a_test():
    tested = {"custom_reward"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested
