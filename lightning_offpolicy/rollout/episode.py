"""Episodes: one prompt's interaction with the policy, as turns, and the reward of the whole.

An episode is the prompt's token ids, then model turns, each followed by the token ids the
environment appended (a tool's result, feedback, the chat template's glue between turns). A
single-turn rollout is an episode of one turn with nothing appended. Its batch row
(:func:`to_rollout_batch`) holds exactly the ids the engine sampled; the appended ids are context
with ``response_mask`` 0, so they carry no weight in the correction, the loss or the metrics
(docs/multi_turn.md, "Which tokens train").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.rollout.engine import Completion

__all__ = ["Episode", "Turn", "single_turn_episodes", "to_rollout_batch"]


@dataclass
class Turn:
    """One model turn and what the environment appended after it.

    Attributes:
        completion: What the engine sampled (token ids, logprobs, versions, kept supports).
        observation_ids: Token ids appended after the turn (never trained); ``[]`` after the last.
    """

    completion: Completion
    observation_ids: list[int] = field(default_factory=list)


@dataclass
class Episode:
    """One prompt's interaction with the policy.

    Attributes:
        group: The advantage group (the prompt's index in its generation call, offset per call).
        prompt_ids: The ids the first turn was generated from.
        turns: The model turns, in order.
        reward: The reward of the whole episode.
        components: Each named part of the reward (weighted rewards, the overlong penalty).
        truncated: Whether a limit ended the episode (a turn cut at its token budget, ``max_turns``,
            the episode's token budget) rather than the model or the environment.
        environment_reward: The sum of the environment's step rewards.
        tool_calls: Tool calls the model made.
        tool_errors: Of those, how many failed.
        tool_seconds: Seconds spent in tools.
    """

    group: int
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    truncated: bool = False
    environment_reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0

    @property
    def completion(self) -> Completion:
        """The completion of the last turn (the only one of a single-turn episode)."""
        return self.turns[-1].completion

    @property
    def response_ids(self) -> list[int]:
        """Every id after the prompt: model turns and what was appended after each, in order."""
        return [t for turn in self.turns for t in (*turn.completion.token_ids, *turn.observation_ids)]

    @property
    def context_ids(self) -> list[int]:
        """The ids the next turn is generated from."""
        return self.prompt_ids + self.response_ids

    @property
    def model_tokens(self) -> int:
        """How many of the response ids the model sampled."""
        return sum(len(turn.completion.token_ids) for turn in self.turns)

    @property
    def environment_tokens(self) -> int:
        """How many of the response ids the environment appended."""
        return sum(len(turn.observation_ids) for turn in self.turns)

    def model_mask(self) -> list[float]:
        """1.0 at each response id the model sampled, 0.0 at each one the environment appended."""
        return [m for turn in self.turns for m in _spans(turn, 1.0, 0.0)]

    def rollout_logprobs(self) -> list[float] | None:
        """The engine's logprob of each model token, 0.0 at appended ids; ``None`` if a turn has none."""
        if any(turn.completion.logprobs is None for turn in self.turns):
            return None
        return [lp for turn in self.turns for lp in (*turn.completion.logprobs, *[0.0] * len(turn.observation_ids))]

    def token_versions(self) -> list[int]:
        """The policy version of each response id; an appended id takes that of the model token before it,
        so the oldest version of an episode is that of its oldest model token."""
        versions: list[int] = []
        for turn in self.turns:
            own = turn.completion.token_versions()
            before = own[-1] if own else (versions[-1] if versions else 0)
            versions += own + [before] * len(turn.observation_ids)
        return versions

    def sampling_supports(self) -> list[list[int] | None] | None:
        """Under top-k / top-p, the kept ids of each model token (``[]`` at appended ids); ``None`` if a
        turn has none."""
        if any(turn.completion.sampling_support is None for turn in self.turns):
            return None
        return [
            s for turn in self.turns for s in (*turn.completion.sampling_support, *[[]] * len(turn.observation_ids))
        ]


def _spans(turn: Turn, model: float, appended: float) -> list[float]:
    return [model] * len(turn.completion.token_ids) + [appended] * len(turn.observation_ids)


def single_turn_episodes(
    prompt_ids: list[list[int]], completions: list[Completion], group_offset: int
) -> list[Episode]:
    """One episode of one turn per completion of a generation call (rewards not yet set).

    Args:
        prompt_ids: Token ids of the call's prompts (a completion's ``prompt_index`` points here).
        completions: The call's completions.
        group_offset: The group of the call's first prompt.

    Returns:
        The episodes, in the order of ``completions``; one that stopped at its length is truncated.
    """
    return [
        Episode(
            group=group_offset + c.prompt_index,
            prompt_ids=prompt_ids[c.prompt_index],
            turns=[Turn(c)],
            truncated=c.finish_reason == "length",
        )
        for c in completions
    ]


def to_rollout_batch(
    episodes: list[Episode],
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    pad_token_id: int,
    sampling_supports: list[list[list[int]]] | None = None,
) -> RolloutBatch:
    """The rows of ``episodes`` as a :class:`~lightning_offpolicy.batch.RolloutBatch`, one row per episode.

    Each row is the prompt, then the episode's response ids; ``response_mask`` is 1 at the model's
    tokens only, so appended ids get no advantage, no weight and no metric.

    Args:
        episodes: The episodes to train on.
        advantages: One advantage per episode.
        group_ids: The group of each row.
        pad_token_id: Padding of the batch.
        sampling_supports: Under top-k / top-p, the kept ids of each response id (``[]`` at appended ids).

    Returns:
        The batch, with the episodes' reward components when they have any.
    """
    logprobs = [e.rollout_logprobs() for e in episodes]
    rollout = RolloutBatch.from_sequences(
        prompt_ids=[e.prompt_ids for e in episodes],
        response_ids=[e.response_ids for e in episodes],
        rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float64).float(),
        advantages=advantages,
        group_ids=group_ids,
        policy_versions=[e.token_versions() for e in episodes],
        rollout_logprobs=None if any(lp is None for lp in logprobs) else logprobs,
        pad_token_id=pad_token_id,
        sampling_supports=sampling_supports,
        response_masks=[e.model_mask() for e in episodes],
    )
    names = list(dict.fromkeys(name for e in episodes for name in e.components))
    if names:
        components = {
            name: torch.tensor([e.components[name] for e in episodes], dtype=torch.float64).float() for name in names
        }
        rollout = rollout.with_fields(reward_components=components)
    return rollout
