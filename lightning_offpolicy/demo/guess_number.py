"""The guess-my-number checkpoint: a tiny Qwen2 with a ChatML template, warmed up on played games.

The warm-up games are played against the real :class:`~lightning_offpolicy.data.environments.GuessNumber`
environment by a player that guesses uniformly among the numbers the feedback so far still allows
(or, in a share ``bisect_fraction`` of the games, bisects). Such a player always follows the feedback
but wastes turns; within :data:`GUESS_NUMBER_MAX_TURNS` turns it wins some games and not others, which
leaves RL the room to learn to bisect (docs/journeys.md, "A multi-turn game").

    >>> path = prepare_guess_number_checkpoint()       # doctest: +SKIP
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.data.environments.base import Message
from lightning_offpolicy.data.environments.guess_number import GuessNumber
from lightning_offpolicy.data.tasks.guess_number import GuessNumberTask
from lightning_offpolicy.demo.chat_sft import play_held_out, sft_on_conversations
from lightning_offpolicy.demo.checkpoint_cache import cached_build, chat_checkpoint_target
from lightning_offpolicy.demo.tiny_bpe import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    save_chat_checkpoint,
    seeded_model,
    tiny_config,
    train_bpe_tokenizer,
)
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings

__all__ = [
    "DEFAULT_GUESS_NUMBER_SETTINGS",
    "GUESS_NUMBER_MAX_TURNS",
    "build_guess_number_checkpoint",
    "guess_number_episodes",
    "guess_number_success",
    "played_game",
    "prepare_guess_number_checkpoint",
]

_RECIPE_VERSION = 1
#: Turns of an episode: bisection finds any number of 1..16 in at most 5 guesses.
GUESS_NUMBER_MAX_TURNS = 5
#: The warm-up of :func:`prepare_guess_number_checkpoint`: games of a player that wins about 9 in 10 (six
#: in ten bisect, the others guess at random among the numbers still allowed), which a tiny model
#: imitates to greedy success about 0.7 (sampled 0.6): room for RL.
DEFAULT_GUESS_NUMBER_SETTINGS: dict[str, Any] = {
    "sft_steps": 800,
    "sft_lr": 3e-3,
    "sft_batch_size": 16,
    "num_games": 2000,
    "bisect_fraction": 0.6,
    "vocab_size": 320,
    "low": 1,
    "high": 16,
}


def played_game(target: int, low: int, high: int, rng: random.Random, bisect: bool) -> list[Message]:
    """The turns after the prompt of one game against :class:`GuessNumber`, as chat messages.

    Each guess is the middle of the numbers still allowed (``bisect``) or one of them drawn uniformly;
    the environment's real answers come in between, up to :data:`GUESS_NUMBER_MAX_TURNS` guesses.
    """
    env = GuessNumber(low, high)
    env.reset("", {"target": target})
    lo, hi = low, high
    messages: list[Message] = []
    for _ in range(GUESS_NUMBER_MAX_TURNS):
        guess = (lo + hi) // 2 if bisect else rng.randint(lo, hi)
        messages.append({"role": "assistant", "content": str(guess)})
        result = env.step(str(guess))
        if result.done:
            break
        messages.extend(result.messages)
        if result.messages[0]["content"] == "Higher.":
            lo = guess + 1
        else:
            hi = guess - 1
    if messages[-1]["role"] != "assistant":
        messages.pop()  # a lost game ends at the last guess: the warm-up trains on the guesses
    return messages


def guess_number_episodes(low: int = 1, high: int = 16) -> EpisodeSettings:
    """The episode settings of the game: :class:`GuessNumber`, :data:`GUESS_NUMBER_MAX_TURNS` turns."""
    from functools import partial

    return EpisodeSettings(
        environment=partial(GuessNumber, low, high), max_turns=GUESS_NUMBER_MAX_TURNS, max_episode_tokens=96
    )


def guess_number_success(
    model: torch.nn.Module,
    tokenizer: Any,
    num_games: int = 200,
    greedy: bool = True,
    seed: int = 0,
    low: int = 1,
    high: int = 16,
) -> float:
    """The share of ``num_games`` held-out games the model wins within :data:`GUESS_NUMBER_MAX_TURNS` guesses."""
    task = GuessNumberTask(low, high)
    rng = random.Random(f"held-out:{seed}")
    samples = [task.sample(rng) for _ in range(num_games)]
    settings = guess_number_episodes(low, high)
    episodes = play_held_out(model, tokenizer, settings, samples, task.max_new_tokens, greedy, seed)
    return sum(e.environment_reward for e in episodes) / max(len(episodes), 1)


def build_guess_number_checkpoint(directory: str | os.PathLike, seed: int = 0, **settings: Any) -> dict[str, Any]:
    """Build the guess-my-number checkpoint into ``directory`` (the keys of :data:`DEFAULT_GUESS_NUMBER_SETTINGS`)."""
    chosen = {**DEFAULT_GUESS_NUMBER_SETTINGS, **settings}
    low, high = chosen["low"], chosen["high"]
    task = GuessNumberTask(low, high)
    rng = random.Random(seed)
    conversations = []
    for _ in range(chosen["num_games"]):
        prompt, metadata = task.sample(rng)
        bisect = rng.random() < chosen["bisect_fraction"]
        game = played_game(metadata["target"], low, high, rng, bisect)
        conversations.append([{"role": "user", "content": prompt}, *game])
    render = train_bpe_tokenizer(["-"], vocab_size=300, chat_template=CHATML_TEMPLATE)
    corpus = [render.apply_chat_template(c, tokenize=False) for c in conversations[:256]]
    tokenizer = train_bpe_tokenizer(
        corpus, vocab_size=chosen["vocab_size"], chat_template=CHATML_TEMPLATE, pre_tokenizer="qwen2"
    )
    end_of_text, _, end_of_turn = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    padded_vocab = -(-len(tokenizer) // 64) * 64
    config = tiny_config(
        "qwen2",
        padded_vocab,
        pad_token_id=end_of_text,
        eos_token_id=end_of_turn,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    model = seeded_model(config, seed)
    losses = sft_on_conversations(
        model,
        tokenizer,
        conversations,
        steps=chosen["sft_steps"],
        batch_size=chosen["sft_batch_size"],
        lr=chosen["sft_lr"],
        seed=seed,
    )
    save_chat_checkpoint(model, tokenizer, directory, end_of_turn, end_of_text)
    return {"final_loss": losses[-1] if losses else None, "model": model, "tokenizer": tokenizer}


def prepare_guess_number_checkpoint(seed: int = 0, directory: str | os.PathLike | None = None, **settings: Any) -> Path:
    """:func:`build_guess_number_checkpoint`, cached
    (:func:`~lightning_offpolicy.demo.checkpoint_cache.cached_build`)."""
    chosen, target = chat_checkpoint_target(
        "prepare_guess_number_checkpoint", "tiny-guess-number", seed, directory, DEFAULT_GUESS_NUMBER_SETTINGS, settings
    )
    spec = {"recipe": _RECIPE_VERSION, "seed": seed, **chosen}

    def build(path: Path) -> dict[str, Any]:
        built = build_guess_number_checkpoint(path, seed=seed, **chosen)
        success = guess_number_success(built["model"], built["tokenizer"], low=chosen["low"], high=chosen["high"])
        return {"final_loss": built["final_loss"], "greedy_success": success}

    return cached_build(target, spec, build)
