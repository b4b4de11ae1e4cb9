"""Rewards: import paths, weighted sums, the scoring checks, and the built-in verifiers on real answers."""

from __future__ import annotations

import logging
import math
import re
import threading
import time

import pytest
import reasoning_gym
import torch

from lightning_offpolicy.data.rewards import (
    MathAnswerReward,
    RegexFormatReward,
    RewardError,
    WeightedReward,
    math_answer,
    reasoning_gym_score,
    resolve_reward,
    score_completions,
)
from lightning_offpolicy.lightning.callback import RolloutCallback
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


# ------------------------------------------------------------------------------ limits: time, type, magnitude


def hangs_on_xyz(prompts, completions, metadata):
    rewards = []
    for completion in completions:
        while completion == "xyz":  # stuck on this input, as a reward stuck in a Python loop is
            time.sleep(0.01)
        rewards.append(1.0)
    return rewards


def slow_rows(prompts, completions, metadata):
    threads.append(threading.get_ident())
    rewards = []
    for completion in completions:
        time.sleep(0.4)
        rewards.append(float(len(completion)))
    return rewards


threads: list[int] = []


def test_a_hung_reward_is_abandoned_at_reward_timeout_s_naming_the_row():
    started = time.monotonic()
    with pytest.raises(
        RewardError,
        match=r"reward function tests\.test_rewards\.hangs_on_xyz did not return within reward_timeout_s=0\.5 s on a "
        r"batch of 3 completions, and was abandoned; it was scoring row 2 \(prompt 'p2', completion 'xyz'\)",
    ):
        score_completions(hangs_on_xyz, ["p0", "p1", "p2"], ["a", "b", "xyz"], [{}] * 3, timeout_s=0.5)
    assert time.monotonic() - started < 5
    # The abandoned call is stopped too (an exception raised into its thread), not left spinning.
    deadline = time.monotonic() + 5
    while any(t.name.startswith("reward ") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("reward ")]
    # Weighted: the part at fault is named, with the same limit.
    reward = WeightedReward(["tests.reward_fixtures.length_bonus", {"fn": hangs_on_xyz, "name": "stuck"}])
    with pytest.raises(RewardError, match=r"hangs_on_xyz did not return within reward_timeout_s=0\.3 s.*row 1"):
        score_completions(reward, ["p0", "p1"], ["a", "xyz"], [{}] * 2, timeout_s=0.3)


@pytest.mark.parametrize("timeout_s", [5.0, None], ids=["worker-thread", "no-limit"])
def test_a_slow_reward_call_is_reported_while_it_runs(caplog, timeout_s):
    threads.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_offpolicy.data.rewards.scoring"):
        scored = score_completions(
            slow_rows, ["p0", "p1", "p2"], ["a", "bb", "ccc"], [{}] * 3, timeout_s=timeout_s, report_every_s=0.1
        )
    assert scored.total.tolist() == [1.0, 2.0, 3.0]
    reports = [r.getMessage() for r in caplog.records if "is still running after" in r.getMessage()]
    assert reports, caplog.text
    assert "tests.test_rewards.slow_rows is still running after" in reports[0]
    assert "on a batch of 3 completions; now at row 0 (prompt 'p0', completion 'a')" in reports[0]
    limit = "reward_timeout_s=5 s abandons it at 5 s" if timeout_s else "no reward_timeout_s is set"
    assert limit in reports[0]
    # Reports at 0.1, 0.2, 0.4, 0.8 s: doubling intervals, not one line per tick.
    assert 2 <= len(reports) <= 5, reports
    # No limit: the reward runs on the calling thread (for rewards that must).
    assert (threads[0] == threading.get_ident()) is (timeout_s is None)


def test_the_reward_thread_has_the_callers_grad_mode():
    def grad_enabled(prompts, completions, metadata):
        return [float(torch.is_grad_enabled())] * len(completions)

    with torch.no_grad():
        assert score_completions(grad_enabled, ["p"], ["c"], [{}]).total.tolist() == [0.0]
    assert score_completions(grad_enabled, ["p"], ["c"], [{}]).total.tolist() == [1.0]


def test_math_answer_keeps_its_timeout_off_the_main_thread():
    # A continued fraction 18 levels deep: sympy's evalf in verify() takes minutes (exponential).
    deep = "$" + "\\frac{1}{1+" * 18 + "1" + "}" * 18 + "$"
    reward = MathAnswerReward(timeout_seconds=0.5)
    out: list[list[float]] = []
    worker = threading.Thread(target=lambda: out.append(reward([None] * 2, [deep, "$1$"], [{"answer": "1"}] * 2)))
    started = time.monotonic()
    worker.start()
    worker.join(15)
    assert not worker.is_alive(), "math_answer ran past its timeout_seconds off the main thread"
    assert out == [[0.0, 1.0]]  # the one past the limit scores 0, as math-verify's own timeout does
    assert time.monotonic() - started < 10
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathAnswerReward(timeout_seconds=0)


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ("1.0", r"returned a str \('1\.0'\); expected a list of 2 floats \(one per completion, in order\)"),
        (0.5, r"returned a float \(0\.5\); expected a list of 2 floats"),
        ({"a": 1.0, "b": 0.0}, r"returned a dict \(\{'a': 1\.0, 'b': 0\.0\}\); expected a list of 2 floats"),
        ([1.0, 0.0, 1.0], r"returned 3 rewards for 2 completions \(first value 1\.0 \(float\)\); expected a list of 2"),
        ([None, 1.0], r"returned None \(a NoneType, not a number\) at row 0 .*; expected a list of 2 floats"),
    ],
    ids=["str", "float", "dict", "too-many", "none"],
)
def test_a_reward_of_the_wrong_type_names_what_it_returned_and_what_is_expected(returned, match):
    with pytest.raises(RewardError, match=r"reward function tests\.test_rewards\.\S*<lambda> " + match):
        score_completions(lambda p, c, m: returned, ["p0", "p1"], ["a", "b"], [{}, {}])


@pytest.mark.parametrize("value", [1e30, -1e39, 2e6])
def test_a_reward_too_large_for_float32_training_names_the_reward_row_and_value(value):
    # 1e30 trained with grad_norm=inf and reward_std=nan; 1e39 failed later as "rewards holds NaN/inf".
    shown = re.escape(f"{value:g}")
    with pytest.raises(
        RewardError,
        match=rf"tests\.test_rewards\.\S*<lambda> returned {shown} at row 1 \(prompt 'p1', completion 'b'\); rewards "
        r"must lie within \+-1e\+06",
    ):
        score_completions(lambda p, c, m: [0.5, value], ["p0", "p1"], ["a", "b"], [{}, {}])
    assert score_completions(lambda p, c, m: [-1e6, 1e6], ["p0", "p1"], ["a", "b"], [{}, {}]).total.tolist() == [
        -1e6,
        1e6,
    ]
    # A weighted sum past the bound names the parts and their weights.
    reward = WeightedReward([{"fn": "tests.reward_fixtures.Constant", "init_args": {"value": 100.0}, "weight": 1e5}])
    with pytest.raises(RewardError, match=r"sums to 1e\+07 at row 0 .*\(Constant=100 x weight 100000\).*weights"):
        reward(["p"], ["c"], [{}])


def test_all_zero_reward_weights_are_refused_at_setup():
    spec = [
        {"fn": "tests.reward_fixtures.exact_match", "weight": 0},
        {"fn": "tests.reward_fixtures.length_bonus", "weight": 0.0},
    ]
    with pytest.raises(ValueError, match=r"every reward weight is 0 \(exact_match=0, length_bonus=0\).*nothing"):
        resolve_reward(spec)
    with pytest.raises(ValueError, match="every reward weight is 0"):
        RolloutCallback(reward_fn=spec)
    # One non-zero weight is enough; a weight-0 part is only logged.
    assert resolve_reward([spec[0], {**spec[1], "weight": 0.5}]).components[0].weight == 0.0


@pytest.mark.parametrize("value", [0, -1, float("inf"), "60", True])
def test_bad_reward_timeout_names_the_setting(value):
    with pytest.raises(ValueError, match=r"RolloutCallback\.reward_timeout_s=.* must be > 0"):
        RolloutCallback(reward_timeout_s=value)
