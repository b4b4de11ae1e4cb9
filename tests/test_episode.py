"""Episodes: a single-turn rollout is an episode of one turn, and its batch row is the one
``RolloutBatch.from_sequences`` builds from the prompt and the completion directly."""

import pytest
import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.rollout.engine import Completion
from lightning_offpolicy.rollout.episode import Episode, Turn, single_turn_episodes, to_rollout_batch


def _completions() -> list[Completion]:
    return [
        Completion(
            prompt_index=1, token_ids=[7, 8, 2], logprobs=[-0.5, -0.25, -0.125], finish_reason="stop", policy_version=3
        ),
        Completion(prompt_index=0, token_ids=[9], logprobs=[-1.0], finish_reason="length", policy_version=[4]),
    ]


def test_single_turn_episodes_keep_each_completion_with_its_prompt_group_and_reward():
    prompts = [[1, 2], [3, 4, 5]]
    rewards = torch.tensor([0.75, -0.5], dtype=torch.float64)
    episodes = single_turn_episodes(prompts, _completions(), rewards, {"exact": torch.tensor([1.0, 0.0])}, 10)
    assert [e.group for e in episodes] == [11, 10]
    assert [len(e.turns) for e in episodes] == [1, 1]
    assert [e.turns[0].context_ids for e in episodes] == [[3, 4, 5], [1, 2]]
    assert [e.reward for e in episodes] == [0.75, -0.5]
    assert [e.components for e in episodes] == [{"exact": 1.0}, {"exact": 0.0}]


def test_to_rollout_batch_equals_the_batch_built_from_the_sequences():
    completions = _completions()
    prompts = [[3, 4, 5], [1, 2]]
    episodes = [
        Episode(group=g, turns=[Turn(p, c)], reward=r)
        for g, p, c, r in zip([0, 1], prompts, completions, [0.75, -0.5], strict=True)
    ]
    advantages, groups = torch.tensor([0.5, -0.5]), torch.tensor([0, 1])
    rollout = to_rollout_batch(episodes, advantages, groups, pad_token_id=0)
    expected = RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=[c.token_ids for c in completions],
        rewards=torch.tensor([0.75, -0.5]),
        advantages=advantages,
        group_ids=groups,
        policy_versions=[c.token_versions() for c in completions],
        rollout_logprobs=[c.logprobs for c in completions],
        pad_token_id=0,
    )
    for name in (
        "input_ids",
        "attention_mask",
        "response_mask",
        "rewards",
        "advantages",
        "policy_version",
        "rollout_logprobs",
    ):
        torch.testing.assert_close(getattr(rollout, name), getattr(expected, name), rtol=0, atol=0)
    assert rollout.reward_components is None or not rollout.reward_components


def test_an_episode_of_two_turns_is_not_trained_yet():
    completion = _completions()[0]
    episode = Episode(group=0, turns=[Turn([1], completion), Turn([1, 7, 8, 2, 5], completion)])
    with pytest.raises(NotImplementedError, match="more than one turn"):
        to_rollout_batch([episode], torch.zeros(1), torch.zeros(1, dtype=torch.long), pad_token_id=0)
