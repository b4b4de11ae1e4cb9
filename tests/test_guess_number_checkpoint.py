"""The guess-my-number checkpoint: games played against the real environment, a build that loads."""

from __future__ import annotations

import json
import random

import pytest

from lightning_offpolicy.demo.guess_number import (
    GUESS_NUMBER_MAX_TURNS,
    build_guess_number_checkpoint,
    guess_number_success,
    played_game,
    prepare_guess_number_checkpoint,
)


@pytest.mark.parametrize("bisect", [True, False])
def test_played_games_follow_the_feedback(bisect):
    rng = random.Random(0)
    wins = 0
    for target in range(1, 17):
        game = played_game(target, 1, 16, rng, bisect)
        guesses = [int(m["content"]) for m in game if m["role"] == "assistant"]
        answers = [m["content"] for m in game if m["role"] == "user"]
        assert len(guesses) <= GUESS_NUMBER_MAX_TURNS and len(answers) == len(guesses) - 1
        lo, hi = 1, 16
        for guess, answer in zip(guesses, answers, strict=False):
            assert lo <= guess <= hi  # never a number the feedback already ruled out
            assert answer == ("Higher." if guess < target else "Lower.")
            lo, hi = (guess + 1, hi) if answer == "Higher." else (lo, guess - 1)
        wins += guesses[-1] == target
    if bisect:
        assert wins == 16  # bisection finds every number of 1..16 within 5 guesses


def test_a_small_build_loads_and_plays_episodes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    built = build_guess_number_checkpoint(tmp_path / "gn", sft_steps=20, num_games=64)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gn")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "gn")
    assert json.loads((tmp_path / "gn" / "config.json").read_text())["model_type"] == "qwen2"
    # The loaded tokenizer encodes as the one the warm-up used.
    text = "Guess my number between 1 and 16."
    assert tokenizer(text)["input_ids"] == built["tokenizer"](text)["input_ids"]
    success = guess_number_success(model, tokenizer, num_games=8)
    assert 0.0 <= success <= 1.0


def test_unknown_settings_are_named():
    with pytest.raises(ValueError, match="unknown settings \\['steps'\\]"):
        prepare_guess_number_checkpoint(steps=3)
