"""Episodes: one prompt's interaction with the policy, as turns, and the reward of the whole.

A single-turn rollout is an episode of one turn: the prompt's token ids and the completion the
engine sampled from them. The :class:`~lightning_offpolicy.rollout.rollouter.Rollouter` builds
episodes and turns them into the rows of a :class:`~lightning_offpolicy.batch.RolloutBatch`
(:func:`to_rollout_batch`); a multi-turn episode (tool calls, an environment's answers) adds turns
to the same record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.rollout.engine import Completion

__all__ = ["Episode", "Turn", "single_turn_episodes", "to_rollout_batch"]


@dataclass
class Turn:
    """One model turn.

    Attributes:
        context_ids: The token ids the turn was generated from (for the first turn: the prompt).
        completion: What the engine sampled.
    """

    context_ids: list[int]
    completion: Completion


@dataclass
class Episode:
    """One prompt's interaction with the policy.

    Attributes:
        group: The advantage group (the prompt's index in its generation call, offset per call).
        turns: The model turns, in order.
        reward: The reward of the whole episode.
        components: Each named part of the reward (weighted rewards, the overlong penalty).
    """

    group: int
    turns: list[Turn]
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)

    @property
    def completion(self) -> Completion:
        """The completion of the last turn (the only one of a single-turn episode)."""
        return self.turns[-1].completion


def single_turn_episodes(
    prompt_ids: list[list[int]],
    completions: list[Completion],
    rewards: torch.Tensor,
    components: dict[str, torch.Tensor],
    group_offset: int,
) -> list[Episode]:
    """One episode of one turn per completion of a generation call.

    Args:
        prompt_ids: Token ids of the call's prompts (a completion's ``prompt_index`` points here).
        completions: The call's completions.
        rewards: One reward per completion.
        components: Each named part of the rewards, one value per completion.
        group_offset: The group of the call's first prompt.

    Returns:
        The episodes, in the order of ``completions``.
    """
    return [
        Episode(
            group=group_offset + c.prompt_index,
            turns=[Turn(prompt_ids[c.prompt_index], c)],
            reward=float(rewards[i]),
            components={name: float(values[i]) for name, values in components.items()},
        )
        for i, c in enumerate(completions)
    ]


def to_rollout_batch(
    episodes: list[Episode],
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    pad_token_id: int,
    sampling_supports: list[list[list[int]]] | None = None,
) -> RolloutBatch:
    """The rows of ``episodes`` as a :class:`~lightning_offpolicy.batch.RolloutBatch`, one row per episode.

    Args:
        episodes: The episodes to train on.
        advantages: One advantage per episode.
        group_ids: The group of each row.
        pad_token_id: Padding of the batch.
        sampling_supports: Under top-k / top-p, the kept ids of each response token.

    Returns:
        The batch, with the episodes' reward components when they have any.

    Raises:
        NotImplementedError: An episode has more than one turn.
    """
    if any(len(e.turns) != 1 for e in episodes):
        raise NotImplementedError("to_rollout_batch: episodes of more than one turn are not trained yet.")
    completions = [e.completion for e in episodes]
    rollout = RolloutBatch.from_sequences(
        prompt_ids=[e.turns[0].context_ids for e in episodes],
        response_ids=[c.token_ids for c in completions],
        rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float64).float(),
        advantages=advantages,
        group_ids=group_ids,
        policy_versions=[c.token_versions() for c in completions],
        rollout_logprobs=None if any(c.logprobs is None for c in completions) else [c.logprobs for c in completions],
        pad_token_id=pad_token_id,
        sampling_supports=sampling_supports,
    )
    names = list(dict.fromkeys(name for e in episodes for name in e.components))
    if names:
        components = {
            name: torch.tensor([e.components[name] for e in episodes], dtype=torch.float64).float() for name in names
        }
        rollout = rollout.with_fields(reward_components=components)
    return rollout
