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


def test_single_turn_episodes_keep_each_completion_with_its_prompt_and_group():
    prompts = [[1, 2], [3, 4, 5]]
    episodes = single_turn_episodes(prompts, _completions(), 10)
    assert [e.group for e in episodes] == [11, 10]
    assert [len(e.turns) for e in episodes] == [1, 1]
    assert [e.prompt_ids for e in episodes] == [[3, 4, 5], [1, 2]]
    assert [e.truncated for e in episodes] == [False, True]  # the second one stopped at its length
    assert [e.response_ids for e in episodes] == [[7, 8, 2], [9]]


def test_to_rollout_batch_equals_the_batch_built_from_the_sequences():
    completions = _completions()
    prompts = [[3, 4, 5], [1, 2]]
    episodes = [
        Episode(group=g, prompt_ids=p, turns=[Turn(c)], reward=r)
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


def test_an_episode_of_two_turns_trains_only_the_ids_the_engine_sampled():
    first = Completion(
        prompt_index=0,
        token_ids=[7, 8, 2],
        logprobs=[-0.5, -0.25, -0.125],
        finish_reason="stop",
        policy_version=[3, 3, 4],
        sampling_support=[[7, 1], [8], None],
    )
    second = Completion(
        prompt_index=0,
        token_ids=[9, 2],
        logprobs=[-1.0, -2.0],
        finish_reason="stop",
        policy_version=5,
        sampling_support=[[9], [2, 3]],
    )
    episode = Episode(group=0, prompt_ids=[1, 6], turns=[Turn(first, observation_ids=[11, 12, 13]), Turn(second)])
    assert episode.response_ids == [7, 8, 2, 11, 12, 13, 9, 2]
    assert episode.context_ids == [1, 6, 7, 8, 2, 11, 12, 13, 9, 2]
    assert (episode.model_tokens, episode.environment_tokens) == (5, 3)
    # The appended ids take the version of the model token before them: the oldest version is a model token's.
    assert episode.token_versions() == [3, 3, 4, 4, 4, 4, 5, 5]
    assert episode.sampling_supports() == [[7, 1], [8], None, [], [], [], [9], [2, 3]]
    rollout = to_rollout_batch([episode], torch.tensor([2.0]), torch.zeros(1, dtype=torch.long), pad_token_id=0)
    mask = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert rollout.input_ids[0].tolist() == [1, 6, 7, 8, 2, 11, 12, 13, 9, 2]
    assert rollout.response_mask[0].tolist() == mask
    assert rollout.advantages[0].tolist() == [2.0 * m for m in mask]
    assert rollout.rollout_logprobs[0].tolist() == [-0.5, -0.25, -0.125, 0.0, 0.0, 0.0, -1.0, -2.0]
    assert rollout.policy_version[0].tolist() == [3, 3, 4, 4, 4, 4, 5, 5]


def test_a_response_mask_of_another_length_than_the_response_is_refused():
    with pytest.raises(ValueError, match="row 0 has 2 response tokens but 3 mask values"):
        RolloutBatch.from_sequences(
            prompt_ids=[[1]],
            response_ids=[[2, 3]],
            rewards=[0.0],
            advantages=torch.zeros(1),
            group_ids=[0],
            policy_versions=[0],
            rollout_logprobs=None,
            pad_token_id=0,
            response_masks=[[1.0, 0.0, 1.0]],
        )
