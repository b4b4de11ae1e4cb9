"""Built-in tasks, rewards, registry and the prompt DataModule."""

from __future__ import annotations

import random

import pytest

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.data.tasks import (
    TASKS,
    AdditionTask,
    CopyTask,
    PromptDataModule,
    ReverseTask,
    RewardFn,
    Task,
    TaskReward,
    get_task,
)
from lightning_offpolicy.data.tokenizers import CharTokenizer


def test_registry_and_errors():
    assert {"reverse", "addition", "copy", "guess_number", "multiply"} <= set(TASKS)
    assert isinstance(get_task("reverse"), ReverseTask)
    assert get_task("reverse", letters="ab", min_len=2, max_len=2).letters == "ab"
    with pytest.raises(ValueError, match="addition, copy, guess_number, multiply, reverse"):
        get_task("nope")
    with pytest.raises(ValueError, match="min_len"):
        ReverseTask(min_len=4, max_len=3)
    with pytest.raises(ValueError, match="max_operand"):
        AdditionTask(max_operand=0)


# The character-level single-turn tasks (guess_number: tests/test_environments.py).
@pytest.mark.parametrize("name", ["addition", "copy", "reverse"])
def test_samples_fit_the_tokenizer_and_reference_scores_one(name):
    task = get_task(name)
    tok = CharTokenizer()
    rng = random.Random(0)
    for _ in range(200):
        prompt, meta = task.sample(rng)
        assert prompt.endswith("=")
        reference = task.reference_completion(meta)
        tok.encode(prompt + reference)  # every character is in the default alphabet
        assert len(reference) + 1 <= task.max_new_tokens
        assert task.reward(reference, meta) == 1.0
        assert task.reward("", meta) == 0.0
        assert 0.0 <= task.reward("zz9", meta) < 1.0
    # Deterministic for a seed.
    assert [task.sample(random.Random(3)) for _ in range(3)] == [task.sample(random.Random(3)) for _ in range(3)]


def test_reverse_rewards_by_hand():
    task = ReverseTask()
    prompt, meta = task.sample(random.Random(1))
    assert prompt == f"rev {meta['input']}=" and meta["answer"] == meta["input"][::-1]
    meta = {"input": "abcd", "answer": "dcba"}
    assert task.reward("dcba", meta) == 1.0
    assert task.reward(" dcba ", meta) == 1.0  # surrounding whitespace is ignored
    assert task.reward("dcbb", meta) == 0.75
    assert task.reward("dcb", meta) == 0.75  # missing character
    assert task.reward("dcbaa", meta) == 0.8  # extra character: 4 of 5
    assert task.reward("abcd", meta) == 0.0
    assert task.reward("", meta) == 0.0
    assert task.max_new_tokens == 7


def test_copy_rewards_by_hand():
    task = CopyTask()
    prompt, meta = task.sample(random.Random(2))
    assert prompt == f"copy {meta['input']}=" and meta["answer"] == meta["input"]
    meta = {"input": "abc", "answer": "abc"}
    assert task.reward("abc", meta) == 1.0
    assert task.reward("abd", meta) == pytest.approx(2 / 3)
    assert task.reward("cba", meta) == pytest.approx(1 / 3)
    assert task.reward("xyz", meta) == 0.0
    assert task.reward("", meta) == 0.0


def test_addition_rewards_by_hand():
    task = AdditionTask()
    prompt, meta = task.sample(random.Random(0))
    assert prompt == f"{meta['a']}+{meta['b']}=" and meta["answer"] == str(meta["a"] + meta["b"])
    assert task.max_new_tokens == 4  # up to "198" + eos
    meta = {"a": 12, "b": 34, "answer": "46"}
    assert task.reward("46", meta) == 1.0
    assert task.reward("47", meta) == 0.5
    assert task.reward("36", meta) == 0.5
    assert task.reward("146", meta) == pytest.approx(2 / 3)  # digits align from the units
    assert task.reward("6", meta) == 0.5
    assert task.reward("99", meta) == 0.0
    assert task.reward("x", meta) == 0.0
    assert task.reward("", meta) == 0.0
    assert task.reward("108", {"answer": "108"}) == 1.0


def test_task_reward_is_a_reward_fn():
    fn = TaskReward(ReverseTask())
    assert isinstance(fn, RewardFn)
    metas = [{"answer": "cba"}, {"answer": "cba"}, {"answer": "cba"}]
    assert fn(["rev abc="] * 3, ["cba", "cbb", ""], metas) == [1.0, pytest.approx(2 / 3), 0.0]
    with pytest.raises(ValueError, match="must match"):
        fn(["rev abc="], ["cba", "cba"], metas[:1])
    with pytest.raises(TypeError):
        TaskReward("reverse")


def test_custom_task_plugs_in():
    class Echo(Task):
        name = "echo"
        max_new_tokens = 2

        def sample(self, rng):
            return "e=", {"answer": "e"}

        def reward(self, completion, metadata):
            return float(completion == metadata["answer"])

    assert TaskReward(Echo())(["e="], ["e"], [{"answer": "e"}]) == [1.0]


def test_datamodule_yields_prompt_batches():
    dm = PromptDataModule(task="addition", prompts_per_step=8, num_train_prompts=40, seed=3)
    assert isinstance(dm.task, AdditionTask)
    assert isinstance(dm.reward_fn, TaskReward) and dm.reward_fn.task is dm.task
    batches = list(dm.train_dataloader())
    assert len(batches) == 5
    for batch in batches:
        assert isinstance(batch, PromptBatch)
        assert len(batch) == len(batch.metadata) == 8
        for prompt, meta in zip(batch.prompts, batch.metadata, strict=True):
            assert prompt == f"{meta['a']}+{meta['b']}="
    rewards = dm.reward_fn(batches[0].prompts, [m["answer"] for m in batches[0].metadata], batches[0].metadata)
    assert rewards == [1.0] * 8
    # drop_last: 40 prompts, batches of 16 -> 2 full batches.
    assert len(list(PromptDataModule(prompts_per_step=16, num_train_prompts=40).train_dataloader())) == 2


def test_datamodule_is_deterministic_for_a_seed():
    def prompts(seed):
        dm = PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=16, seed=seed)
        return [b.prompts for b in dm.train_dataloader()]

    assert prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)
    dm = PromptDataModule(prompts_per_step=4, num_train_prompts=16)
    assert sorted(p for b in dm.train_dataloader() for p in b.prompts) == sorted(p for p, _ in dm.train_dataset.items)
    assert dm.hparams["task"] == "reverse"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"task": "nope"}, "task"),
        ({"prompts_per_step": 0}, "prompts_per_step"),
        ({"num_train_prompts": -1}, "num_train_prompts"),
        ({"prompts_per_step": 32, "num_train_prompts": 16}, "prompts_per_step"),
    ],
)
def test_datamodule_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PromptDataModule(**kwargs)
