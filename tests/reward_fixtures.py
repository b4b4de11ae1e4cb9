"""Reward functions that tests name by import path (tests.reward_fixtures.<name>)."""

from __future__ import annotations


def exact_match(prompts, completions, metadata):
    return [float(c.strip() == str(m["answer"])) for c, m in zip(completions, metadata, strict=True)]


def length_bonus(prompts, completions, metadata):
    return [len(c) / 8 for c in completions]


def raises_on_z(prompts, completions, metadata):
    return [1 / 0 if "z" in c else 1.0 for c in completions]


def one_too_few(prompts, completions, metadata):
    return [0.0] * (len(completions) - 1)


def nan_on_second(prompts, completions, metadata):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


class Constant:
    def __init__(self, value: float = 1.0) -> None:
        self.value = value

    def __call__(self, prompts, completions, metadata):
        return [self.value] * len(completions)
