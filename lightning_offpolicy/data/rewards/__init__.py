"""Rewards: named by import path in a config, combined with weights, checked when called; built-in verifiers.

A reward function maps ``(prompts, completions, metadata) -> list[float]`` (one float per
completion; ``metadata`` is each row's dict of extra data columns). Each call runs under a time
limit (``reward_timeout_s``, in a worker thread; :mod:`~lightning_offpolicy.data.rewards.scoring`) and
what it returns is checked: one finite number per completion, within ``MAX_ABS_REWARD``.

>>> from lightning_offpolicy.data.rewards import resolve_reward
>>> reward = resolve_reward([{"fn": "lightning_offpolicy.data.rewards.math_answer", "name": "acc"},
...                          {"fn": "lightning_offpolicy.data.rewards.RegexFormatReward", "weight": 0.1,
...                           "name": "format", "init_args": {"pattern": "^[0-9.]+$"}}])
>>> reward([None, None], ["0.5", "1/2"], [{"answer": "\\\\frac{1}{2}"}] * 2)
[1.1, 1.0]
"""

from lightning_offpolicy.data.rewards.episode import environment_reward
from lightning_offpolicy.data.rewards.gym import ReasoningGymReward, reasoning_gym_score
from lightning_offpolicy.data.rewards.named import import_object, reward_name
from lightning_offpolicy.data.rewards.resolve import RewardSpec, resolve_reward
from lightning_offpolicy.data.rewards.scoring import (
    DEFAULT_REWARD_TIMEOUT_S,
    MAX_ABS_REWARD,
    RewardError,
    ScoredRewards,
    score_completions,
)
from lightning_offpolicy.data.rewards.verifiable import MathAnswerReward, RegexFormatReward, math_answer
from lightning_offpolicy.data.rewards.weighted import RewardComponent, WeightedReward

__all__ = [
    "DEFAULT_REWARD_TIMEOUT_S",
    "MAX_ABS_REWARD",
    "MathAnswerReward",
    "ReasoningGymReward",
    "RegexFormatReward",
    "RewardComponent",
    "RewardError",
    "RewardSpec",
    "ScoredRewards",
    "WeightedReward",
    "environment_reward",
    "import_object",
    "math_answer",
    "reasoning_gym_score",
    "resolve_reward",
    "reward_name",
    "score_completions",
]
