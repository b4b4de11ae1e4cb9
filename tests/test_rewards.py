"""Rewards: import paths, weighted sums, the scoring checks, and the built-in verifiers on real answers."""

from __future__ import annotations

import math

import pytest
import reasoning_gym

from lightning_offpolicy.rewards import (
    MathAnswerReward,
    RegexFormatReward,
    RewardError,
    WeightedReward,
    math_answer,
    reasoning_gym_score,
    resolve_reward,
    score_completions,
)
from tests import reward_fixtures


def test_import_paths_in_both_spellings_and_classes_with_init_args():
    assert resolve_reward("tests.reward_fixtures.exact_match") is reward_fixtures.exact_match
    assert resolve_reward("tests.reward_fixtures:exact_match") is reward_fixtures.exact_match
    built = resolve_reward({"fn": "tests.reward_fixtures.Constant", "init_args": {"value": 0.25}})
    assert built(["p"], ["c"], [{}]) == [0.25]
    assert resolve_reward(reward_fixtures.length_bonus) is reward_fixtures.length_bonus
    assert resolve_reward(None) is None


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (
            "tests.reward_fixtures.no_such_fn",
            r"'tests.reward_fixtures.no_such_fn' could not be imported .*no attribute",
        ),
        ("no_such_pkg.rewards.f", r"'no_such_pkg.rewards.f' could not be imported .*no module 'no_such_pkg'"),
        ("exact_match", "is not an import path"),
        ("math.pi", r"'math.pi' is a float, not a callable"),
        ({"fn": "tests.reward_fixtures.Constant", "weight": 2.0}, r"only 'fn' and 'init_args'"),
        ([], "empty list"),
        ([{"fn": "tests.reward_fixtures.exact_match", "wieght": 2}], r"unknown keys \['wieght'\]"),
        (["tests.reward_fixtures.exact_match", "tests.reward_fixtures:exact_match"], r"names \['exact_match'\] appear"),
        ([{"fn": "tests.reward_fixtures.exact_match", "weight": float("nan")}], "finite number"),
    ],
)
def test_bad_specs_name_the_path_and_what_is_wrong(spec, match):
    with pytest.raises((ImportError, ValueError, TypeError), match=match):
        resolve_reward(spec)


def test_weighted_sum_and_components_against_a_hand_computation():
    reward = resolve_reward(
        [
            {"fn": "tests.reward_fixtures.exact_match", "weight": 2.0, "name": "acc"},
            {"fn": "tests.reward_fixtures:length_bonus", "weight": -0.5},
        ]
    )
    assert isinstance(reward, WeightedReward) and [c.name for c in reward.components] == ["acc", "length_bonus"]
    completions, metadata = ["4", "five", "12345678"], [{"answer": "4"}, {"answer": "5"}, {"answer": "8"}]
    scored = score_completions(reward, [None] * 3, completions, metadata)
    assert scored.components["acc"].tolist() == [1.0, 0.0, 0.0]
    assert scored.components["length_bonus"].tolist() == [1 / 8, 4 / 8, 1.0]
    assert scored.total.tolist() == pytest.approx([2 - 0.5 / 8, -0.25, -0.5], abs=1e-12)
    assert reward([None] * 3, completions, metadata) == scored.total.tolist()


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (
            reward_fixtures.raises_on_z,
            r"reward function tests.reward_fixtures.raises_on_z raised ZeroDivisionError: division by zero at row 2 "
            r"\(prompt 'p2', completion 'xyz'\)",
        ),
        (reward_fixtures.one_too_few, r"tests.reward_fixtures.one_too_few returned 2 rewards for 3 completions"),
        (
            reward_fixtures.nan_on_second,
            r"tests.reward_fixtures.nan_on_second returned nan at row 1 \(prompt 'p1', completion 'b'\)",
        ),
        (
            lambda p, c, m: [0.0, math.inf, 0.0],
            r"returned inf at row 1 .*rewards must be finite",
        ),
        (lambda p, c, m: [0.0, "high", 0.0], r"returned 'high' \(a str, not a number\) at row 1"),
    ],
    ids=["raises", "count", "nan", "inf", "not-a-number"],
)
def test_a_broken_reward_names_the_function_and_the_row(fn, match):
    with pytest.raises(RewardError, match=match):
        score_completions(fn, ["p0", "p1", "p2"], ["a", "b", "xyz"], [{}, {}, {}])


def test_a_broken_component_is_named_inside_a_weighted_reward():
    reward = WeightedReward(["tests.reward_fixtures.exact_match", "tests.reward_fixtures.nan_on_second"])
    with pytest.raises(RewardError, match="nan_on_second returned nan at row 1"):
        reward(["p0", "p1"], ["a", "b"], [{"answer": "a"}, {"answer": "b"}])


def test_math_answer_checks_equivalence_with_math_verify():
    completions = ["$\\frac{1}{2}$", "The answer is \\boxed{0.5}", "0.5", "1/3", "no idea"]
    metadata = [{"answer": "0.5"}, {"answer": "\\frac{1}{2}"}, {"answer": "1/2"}, {"answer": "0.5"}, {"answer": "2"}]
    assert math_answer([None] * 5, completions, metadata) == [1.0, 1.0, 1.0, 0.0, 0.0]
    keyed = MathAnswerReward(answer_key="solution")
    assert keyed([None], ["x = 3"], [{"solution": "3"}]) == [1.0]
    with pytest.raises(KeyError, match="no 'solution'"):
        keyed([None], ["3"], [{"answer": "3"}])


def test_regex_format_reward():
    reward = RegexFormatReward(r"<answer>\d+</answer>")
    assert reward([None] * 3, ["so <answer>12</answer>", "<answer>x</answer>", "12"], [{}] * 3) == [1.0, 0.0, 0.0]
    strict = RegexFormatReward(r"\d+", full_match=True)
    assert strict([None] * 2, [" 12\n", "12 apples"], [{}] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"`pattern`='\(' is not a valid regular expression"):
        RegexFormatReward("(")


def test_reasoning_gym_score_uses_the_tasks_scorer_and_extracts_tagged_answers():
    task = reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=11)
    entries = [task[i] for i in range(3)]
    prompts = [e["question"] for e in entries]
    metadata = [{k: v for k, v in e.items() if k != "question"} for e in entries]
    answers = [e["answer"] for e in entries]
    completions = [answers[0], f"thinking... <answer>{answers[1]}</answer>", f"<answer>{answers[2]}9</answer>"]
    expected = [task.score_answer(answers[0], entries[0]), 1.0, task.score_answer(answers[2] + "9", entries[2])]
    assert reasoning_gym_score(prompts, completions, metadata) == expected
    assert expected[:2] == [1.0, 1.0] and expected[2] < 1.0
    with pytest.raises(KeyError, match="source_dataset"):
        reasoning_gym_score(["q"], ["1"], [{"answer": "1"}])
