"""Games of multi-turn episodes: GuessNumber, its task, and the TextArena adapter against the real library."""

from __future__ import annotations

import functools
import math
import random
import re

import pytest

from lightning_offpolicy.data.environments import (
    Environment,
    GuessNumber,
    StepResult,
    bisection_dialogue,
    environment_tools,
)
from lightning_offpolicy.data.environments.guess_number import last_integer
from lightning_offpolicy.data.tasks import GuessNumberTask, TaskReward, get_task


def _started(target: int, low: int = 1, high: int = 16) -> Environment:
    env = GuessNumber(low, high)
    env.reset(f"Guess my number between {low} and {high}.", {"target": target})
    return env


# ---------------------------------------------------------------------------- GuessNumber
def test_guess_number_is_an_environment_without_tools():
    env = GuessNumber()
    assert isinstance(env, Environment)
    assert environment_tools(GuessNumber) == []


def test_guess_number_answers_every_kind_of_reply():
    env = _started(7, low=1, high=16)
    assert env.step("3") == StepResult(messages=[{"role": "user", "content": "Higher."}])
    assert env.step("I think 12") == StepResult(messages=[{"role": "user", "content": "Lower."}])
    no_number = StepResult(messages=[{"role": "user", "content": "Reply with one number between 1 and 16."}])
    assert env.step("no idea") == no_number
    assert env.step("") == no_number
    # The last integer counts: 7 then 9 is a guess of 9, 9 then 7 a guess of 7.
    assert env.step("7? no, 9") == StepResult(messages=[{"role": "user", "content": "Lower."}])
    assert env.step("9? no, 7") == StepResult(reward=1.0, done=True)


def test_guess_number_reads_signs_and_ranges_as_a_reader_would():
    assert last_integer("between 1-16 I say 4.") == 4
    assert last_integer("1-16") == 16  # a dash between digits is not a minus sign
    assert last_integer("x -3") == -3
    assert last_integer("<|im_end|> 12 <tool_call>") == 12
    assert last_integer("none") is None
    env = _started(-2, low=-5, high=5)
    assert env.step("-4").messages[0]["content"] == "Higher."
    assert env.step("-1").messages[0]["content"] == "Lower."
    assert env.step("say -2").done


def test_guess_number_has_no_step_before_reset_or_after_the_win():
    env = GuessNumber()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("3")
    env.reset("", {"target": 3})
    assert env.step("3").done
    with pytest.raises(RuntimeError, match="after the number was found"):
        env.step("3")
    env.reset("", {"target": 4})  # a new game after reset
    assert env.step("3").messages[0]["content"] == "Higher."


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({}, r"no 'target'"),
        ({"answer": 3}, r"no 'target'.*answer"),
        ({"target": 0}, r"metadata\['target'\] must be an int in \[low, high\] = \[1, 16\], got 0"),
        ({"target": 17}, r"got 17"),
        ({"target": "5"}, r"got '5'"),
        ({"target": True}, r"got True"),
    ],
)
def test_guess_number_rejects_a_missing_or_out_of_range_target(metadata, match):
    with pytest.raises(ValueError, match=match):
        GuessNumber().reset("Guess my number between 1 and 16.", metadata)


@pytest.mark.parametrize(("low", "high"), [(5, 4), (1.0, 16), (1, "16"), (False, 3)])
def test_guess_number_range_errors_name_the_setting(low, high):
    with pytest.raises(ValueError, match="`(low|high)`"):
        GuessNumber(low, high)
    with pytest.raises(ValueError, match="`(low|high)`"):
        GuessNumberTask(low, high)


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 2), (1, 16), (1, 17), (-7, 100)])
def test_a_binary_search_player_always_wins_within_the_bound(low, high):
    """A player that halves the range from the feedback alone wins every game in <= ceil(log2 n) + 1 turns."""
    bound = math.ceil(math.log2(high - low + 1)) + 1
    for target in range(low, high + 1):
        env = _started(target, low, high)
        lo, hi, turns = low, high, 0
        while True:
            guess = (lo + hi + 1) // 2  # rounded up: a different path from bisection_dialogue's
            turns += 1
            result = env.step(f"My guess: {guess}")
            if result.done:
                break
            assert turns < bound, f"target {target}: not found in {bound} turns"
            (message,) = result.messages
            if message["content"] == "Higher.":
                lo = guess + 1
            else:
                assert message["content"] == "Lower."
                hi = guess - 1
        assert guess == target and result.reward == 1.0 and turns <= bound


def test_bisection_dialogue_replays_against_the_environment():
    assert [m["content"] for m in bisection_dialogue(1, 1, 16)] == ["8", "Lower.", "4", "Lower.", "2", "Lower.", "1"]
    for target in range(1, 17):
        dialogue = bisection_dialogue(target)
        assert [m["role"] for m in dialogue] == ["assistant", "user"] * (len(dialogue) // 2) + ["assistant"]
        assert len(dialogue) // 2 + 1 <= 5  # a bisection of 16 numbers takes floor(log2(16)) + 1 guesses at most
        env = _started(target)
        for reply, answer in zip(dialogue[::2], [*dialogue[1::2], None], strict=True):
            result = env.step(reply["content"])
            assert result.done == (answer is None)
            assert result.messages == ([] if answer is None else [answer])
    with pytest.raises(ValueError, match="target"):
        bisection_dialogue(20)


# ---------------------------------------------------------------------------- the guess_number task
def test_guess_number_task_prompts_and_metadata():
    task = get_task("guess_number", low=3, high=9)
    assert isinstance(task, GuessNumberTask)
    rng = random.Random(0)
    samples = [task.sample(rng) for _ in range(2000)]
    assert {prompt for prompt, _ in samples} == {"Guess my number between 3 and 9."}
    targets = [meta["target"] for _, meta in samples]
    assert set(targets) == set(range(3, 10))  # every secret in range, none outside
    assert all(type(t) is int for t in targets)
    # Uniform: each of the 7 values about 2000/7 = 286 times (binomial sd 15.6; 6 sd apart).
    assert all(abs(targets.count(v) - 2000 / 7) < 95 for v in range(3, 10))
    assert [task.sample(random.Random(4)) for _ in range(3)] == [task.sample(random.Random(4)) for _ in range(3)]
    assert get_task("guess_number").sample(random.Random(0))[0] == "Guess my number between 1 and 16."
    # Every sampled target is a valid secret of the environment of the same range.
    for _, meta in samples[:50]:
        GuessNumber(3, 9).reset("", meta)


def test_guess_number_task_reward_single_turn_and_from_the_environment():
    task = GuessNumberTask()
    meta = {"target": 11}
    assert task.reward("11", meta) == 1.0
    assert task.reward("maybe 3, no: 11", meta) == 1.0
    assert task.reward("11 or 12", meta) == 0.0
    assert task.reward("", meta) == 0.0
    assert task.reward(task.reference_completion(meta), meta) == 1.0
    assert task.reference_completion(meta) == "11"
    assert len(task.reference_completion({"target": 16})) + 1 <= task.max_new_tokens
    # Multi-turn: the environment's reward wins over the last turn's text.
    assert task.reward("11", {**meta, "environment_reward": 0.0}) == 0.0
    assert task.reward("3", {**meta, "environment_reward": 1.0}) == 1.0
    assert TaskReward(task)(["p", "p"], ["11", "11"], [meta, {**meta, "environment_reward": 0.0}]) == [1.0, 0.0]


def test_a_played_game_scores_as_the_environment_said():
    """The runner's metadata (environment_reward = sum of step rewards) gives the episode's reward."""
    task = GuessNumberTask()
    _, meta = task.sample(random.Random(1))
    env = GuessNumber()
    env.reset("", meta)
    rewards = [env.step(reply["content"]).reward for reply in bisection_dialogue(meta["target"])[::2]]
    assert task.reward("whatever", {**meta, "environment_reward": sum(rewards), "turns": len(rewards)}) == 1.0


# ---------------------------------------------------------------------------- TextArena adapter
def _hint(message: str) -> str:
    found = re.search(r"The target number is (higher|lower)\.", message)
    assert found, message
    return found.group(1)


def test_textarena_game_is_played_to_the_win_by_binary_search():
    pytest.importorskip("textarena")
    from lightning_offpolicy.data.environments import TextArenaGame

    factory = functools.partial(TextArenaGame, "GuessTheNumber-v0")
    assert environment_tools(factory) == []
    rows = factory().rows(range(12))
    assert rows[0]["seed"] == 0 and "between 1 and 20" in rows[0]["prompt"]
    targets = set()
    for row in rows:
        env = factory()
        env.reset(row["prompt"], {"seed": row["seed"]})
        lo, hi, turns = 1, 20, 0
        while True:
            guess = (lo + hi) // 2
            turns += 1
            result = env.step(f"I guess [{guess}]")
            if result.done:
                break
            (message,) = result.messages
            assert message["role"] == "user"
            if _hint(message["content"]) == "higher":
                lo = guess + 1
            else:
                hi = guess - 1
        assert result.reward == 1.0 and turns <= math.ceil(math.log2(20)) + 1
        targets.add(guess)
        with pytest.raises(RuntimeError, match="after the game ended"):
            env.step("[1]")
    assert len(targets) > 3  # the seeds give different secrets


def test_textarena_game_is_reproducible_from_its_seed_and_leaves_global_random_alone():
    pytest.importorskip("textarena")
    from lightning_offpolicy.data.environments import TextArenaGame

    factory = functools.partial(TextArenaGame, "GuessTheNumber-v0")

    def transcript(seed: int, interleave: bool) -> list[str]:
        env = factory()
        env.reset("", {"seed": seed})
        out = []
        for guess in (10, 5, 15):
            if interleave:  # another game stepping in between must not change this one
                other = factory()
                other.reset("", {"seed": seed + 100})
                other.step("[7]")
            result = env.step(f"[{guess}]")
            out.append("done" if result.done else result.messages[0]["content"])
        return out

    random.seed(123)
    state = random.getstate()
    assert transcript(3, interleave=False) == transcript(3, interleave=True)
    assert random.getstate() == state


def test_textarena_invalid_moves_and_the_turn_limit_end_as_the_library_scores_them():
    pytest.importorskip("textarena")
    from lightning_offpolicy.data.environments import TextArenaGame
    from lightning_offpolicy.data.environments.textarena import _core

    env = TextArenaGame("GuessTheNumber-v0", env_kwargs={"max_turns": 2})
    env.reset("", {"seed": 0})
    target = _core(env.game).game_number
    result = env.step("[x]")  # not a number: one invalid move is forgiven with a notice
    assert not result.done and "invalid move" in result.messages[0]["content"]
    far = [g for g in (1, 20, 2, 19, 3, 18) if abs(g - target) > 1]
    # Wrong guesses until the game's turn limit ends it.
    for turns, guess in enumerate(far, start=1):  # noqa: B007 (read after the loop)
        result = env.step(f"[{guess}]")
        if result.done:
            break
        assert result.messages[0]["content"] == f"The target number is {'higher' if guess < target else 'lower'}."
    assert result.done and turns <= 3  # max_turns=2; TextArena checks the limit before counting the turn
    assert result.reward == pytest.approx(1 - abs(guess - target) / 19)  # the game's closeness of the last guess
    # Two invalid moves in a row end the game (the library forgives one).
    env.reset("", {"seed": 1})
    assert not env.step("no number").done
    assert env.step("still none").done


def test_textarena_errors_name_what_to_do():
    pytest.importorskip("textarena")
    from lightning_offpolicy.data.environments import TextArenaGame

    with pytest.raises(ValueError, match="unknown `env_id` 'GuessTheNumber-v9'; close: GuessTheNumber-v0"):
        TextArenaGame("GuessTheNumber-v9")
    with pytest.raises(ValueError, match="int 'seed'"):
        TextArenaGame().reset("", {"target": 3})
    with pytest.raises(RuntimeError, match="before reset"):
        TextArenaGame().step("[3]")
    with pytest.raises(ValueError, match="not a single-player game"):
        TextArenaGame("TicTacToe-v0").rows([0])


def test_textarena_game_names_the_extra_when_the_library_is_missing(monkeypatch):
    import sys

    from lightning_offpolicy.data.environments import TextArenaGame

    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena raises ImportError
    with pytest.raises(ImportError, match=r"lightning-offpolicy\[games\]"):
        TextArenaGame()


def test_guess_number_prompts_serve_training_and_held_out_games():
    """All prompts are alike, so held-out games are fresh secrets from their own stream, not new texts."""
    from lightning_offpolicy.data.tasks import PromptDataModule

    data = PromptDataModule(task="guess_number", prompts_per_step=4, num_train_prompts=32, seed=2, num_val_prompts=64)
    batch = next(iter(data.train_dataloader()))
    assert batch.prompts == ["Guess my number between 1 and 16."] * 4
    assert all(1 <= m["target"] <= 16 for m in batch.metadata)
    held_out = [m["target"] for _, m in data.val_dataset.items]
    rng = random.Random("held-out:2")
    assert held_out == [rng.randint(1, 16) for _ in range(64)]  # the task's draws from the held-out stream
    train = PromptDataModule(task="guess_number", prompts_per_step=4, num_train_prompts=32, seed=2).train_dataset
    assert train.items == data.train_dataset.items  # validation leaves the training prompts as they were
