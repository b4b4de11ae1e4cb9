"""DatasetDataModule: real JSONL / Parquet / CSV files, datasets objects and reasoning-gym tasks; every error path."""

from __future__ import annotations

import json

import datasets
import pytest
import reasoning_gym
import torch

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.data import DatasetDataModule, PromptRows, ResumableSampler
from lightning_offpolicy.data.rewards import ReasoningGymReward

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(12)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def all_items(dataset):
    return [dataset[i] for i in range(len(dataset))]


def test_jsonl_parquet_and_csv_give_the_same_prompts_and_metadata(tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer,level\n" + "".join(f"{r['prompt']},{r['answer']},{r['level']}\n" for r in ROWS))
    expected = [(r["prompt"], {"answer": r["answer"], "level": r["level"]}) for r in ROWS]
    for path in (jsonl, parquet):
        assert all_items(DatasetDataModule(str(path), prompts_per_step=4).train_dataset) == expected
    # CSV cells are typed by the csv reader: the answers "0", "2", ... read back as ints.
    from_csv = all_items(DatasetDataModule(str(csv), prompts_per_step=4).train_dataset)
    assert [(p, {"answer": str(m["answer"]), "level": m["level"]}) for p, m in from_csv] == expected


def test_glob_reads_every_matching_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:5])
    write_jsonl(tmp_path / "b.jsonl", ROWS[5:])
    data = DatasetDataModule(str(tmp_path / "*.jsonl"), prompts_per_step=4)
    assert sorted(p for p, _ in all_items(data.train_dataset)) == sorted(r["prompt"] for r in ROWS)


def test_chat_messages_and_a_custom_prompt_field(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "target": i} for i in range(4)]
    data = DatasetDataModule(
        str(write_jsonl(tmp_path / "chat.jsonl", rows)), prompt_field="messages", prompts_per_step=2
    )
    assert all_items(data.train_dataset) == [(r["messages"], {"target": r["target"]}) for r in rows]
    batch = next(iter(data.train_dataloader()))
    assert isinstance(batch, PromptBatch) and batch.prompts[0][0]["role"] == "user"


def test_datasets_objects_from_python():
    table = datasets.Dataset.from_list(ROWS)
    assert len(DatasetDataModule(table, prompts_per_step=4).train_dataset) == 12
    splits = datasets.DatasetDict({"train": table.select(range(8)), "test": table.select(range(8, 12))})
    data = DatasetDataModule(splits, split="test", prompts_per_step=2)
    assert [p for p, _ in all_items(data.train_dataset)] == [r["prompt"] for r in ROWS[8:]]
    with pytest.raises(ValueError, match="without the split 'validation'; it has train, test"):
        DatasetDataModule(splits, split="validation")


def test_held_out_split_is_seeded_disjoint_and_served_in_order(tmp_path):
    path = str(write_jsonl(tmp_path / "rows.jsonl", ROWS))
    data = DatasetDataModule(path, val_size=0.25, prompts_per_step=4, val_prompts_per_step=2, seed=7)
    held_out = torch.randperm(12, generator=torch.Generator().manual_seed(7))[:3].sort().values.tolist()
    assert data.val_dataset.indices == held_out
    assert sorted(data.train_dataset.indices + held_out) == list(range(12))
    rng_before = torch.get_rng_state()
    batches = list(data.val_dataloader())
    # An evaluation must not move the global RNG, or it would change the training that follows.
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert [len(b) for b in batches] == [2, 1]
    assert [p for b in batches for p in b.prompts] == [ROWS[i]["prompt"] for i in held_out]
    assert DatasetDataModule(path, val_size=5, prompts_per_step=4).val_dataset.__len__() == 5
    other = DatasetDataModule(path, val_source=str(write_jsonl(tmp_path / "val.jsonl", ROWS[:3])), prompts_per_step=4)
    assert len(other.train_dataset) == 12 and [p for p, _ in all_items(other.val_dataset)] == ["0+0=", "1+1=", "2+2="]
    assert DatasetDataModule(path, prompts_per_step=4).val_dataloader() == []


def test_train_order_is_the_seeded_permutation_of_each_epoch(tmp_path):
    data = DatasetDataModule(str(write_jsonl(tmp_path / "rows.jsonl", ROWS)), prompts_per_step=4, seed=3)
    loader = data.train_dataloader()
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        order = torch.randperm(12, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        assert [p for b in loader for p in b.prompts] == [ROWS[i]["prompt"] for i in order]
    unshuffled = DatasetDataModule(str(tmp_path / "rows.jsonl"), prompts_per_step=4, shuffle=False)
    assert [p for b in unshuffled.train_dataloader() for p in b.prompts] == [r["prompt"] for r in ROWS]


def test_sampler_shards_ranks_and_resumes_mid_epoch():
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5 + 2)).tolist()
    ranks = [ResumableSampler(10, batch_size=2, seed=5, num_replicas=2, rank=r) for r in (0, 1)]
    for sampler in ranks:
        sampler.set_epoch(2)
    assert [list(s) for s in ranks] == [order[0:10:2], order[1:10:2]]
    assert len(ranks[0]) == 5
    ranks[1].resume_at(epoch=2, batches_done=1)
    assert list(ranks[1]) == order[1:10:2][2:]
    assert list(ranks[1]) == order[1:10:2]  # the skip applies once
    odd = ResumableSampler(7, batch_size=1, seed=0, num_replicas=2, rank=1)
    assert len(odd) == 3 and len(list(odd)) == 3  # the tail that does not split evenly is dropped


def test_reasoning_gym_task_is_generated_locally_and_scored_by_its_own_scorer():
    data = DatasetDataModule("reasoning_gym:basic_arithmetic", reasoning_gym_size=6, prompts_per_step=2, seed=4)
    reference = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=4)
    items = all_items(data.train_dataset)
    assert [p for p, _ in items] == [reference[i]["question"] for i in range(6)]
    assert items[0][1] == {k: v for k, v in reference[0].items() if k != "question"}
    assert isinstance(data.reward_fn, ReasoningGymReward) and data.reward_fn.dataset is data.procedural
    prompts, metadata = [p for p, _ in items], [m for _, m in items]
    right = [m["answer"] for m in metadata]
    assert data.reward_fn(prompts, right, metadata) == [1.0] * 6
    wrong = [str(int(a) + 1) for a in right]
    assert data.reward_fn(prompts, wrong, metadata) == [
        reference.score_answer(w, reference[i]) for i, w in enumerate(wrong)
    ]
    configured = DatasetDataModule(
        "reasoning_gym:basic_arithmetic",
        reasoning_gym_size=4,
        prompts_per_step=2,
        reasoning_gym_config={"min_terms": 2, "max_terms": 2},
    )
    assert all(m["metadata"]["num_terms"] == 2 for _, m in all_items(configured.train_dataset))


def test_reward_fn_setting_overrides_the_default():
    data = DatasetDataModule(
        "reasoning_gym:basic_arithmetic",
        reasoning_gym_size=4,
        prompts_per_step=2,
        reward_fn="lightning_offpolicy.data.rewards.math_answer",
    )
    assert type(data.reward_fn).__name__ == "MathAnswerReward"


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda tmp: DatasetDataModule(str(tmp / "nope.jsonl")), FileNotFoundError, r"'.*nope.jsonl': no such file"),
        (lambda tmp: DatasetDataModule(str(tmp / "*.parquet")), FileNotFoundError, "the glob matches nothing"),
        (
            lambda tmp: DatasetDataModule(str(write_jsonl(tmp / "rows.txt", ROWS))),
            ValueError,
            "unknown extension '.txt'",
        ),
        (
            lambda tmp: DatasetDataModule(str(write_jsonl(tmp / "rows.jsonl", ROWS)), prompt_field="question"),
            ValueError,
            "`prompt_field`='question' is not a column .* its columns: prompt, answer, level",
        ),
        (
            lambda tmp: DatasetDataModule("reasoning_gym:basic_arithmetc"),
            ValueError,
            "unknown reasoning-gym task 'basic_arithmetc'.*basic_arithmetic",
        ),
        (
            # A typo late in the alphabet: no substring of any name, so only a spelling match finds it.
            lambda tmp: DatasetDataModule("reasoning_gym:word_sortng"),
            ValueError,
            r"unknown reasoning-gym task 'word_sortng' .*\. Did you mean reasoning_gym:word_sorting\? Similar tasks",
        ),
        (lambda tmp: DatasetDataModule(str(write_empty(tmp))), ValueError, "has no rows"),
        (
            lambda tmp: DatasetDataModule(str(write_jsonl(tmp / "rows.jsonl", ROWS)), val_size=1.5),
            ValueError,
            r"`val_size`=1.5 as a fraction must lie in \(0, 1\)",
        ),
        (
            lambda tmp: DatasetDataModule(str(write_jsonl(tmp / "rows.jsonl", ROWS)), prompts_per_step=13),
            ValueError,
            "12 training prompts .* fewer than prompts_per_step=13",
        ),
        (
            lambda tmp: DatasetDataModule(str(write_jsonl(tmp / "rows.jsonl", ROWS)), prompts_per_step=0),
            ValueError,
            "`prompts_per_step` must be a positive int, got 0",
        ),
    ],
    ids=[
        "missing",
        "empty-glob",
        "extension",
        "prompt-field",
        "gym-task",
        "gym-task-typo",
        "empty",
        "val-size",
        "too-few",
        "per-step",
    ],
)
def test_bad_input_fails_at_construction_naming_the_setting(tmp_path, make, error, match):
    with pytest.raises(error, match=match):
        make(tmp_path)


def write_empty(tmp):
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(tmp / "empty.parquet"))
    return tmp / "empty.parquet"


def test_a_bad_prompt_cell_names_its_row(tmp_path):
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": "", "answer": "2"}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    # At construction, not when the row's batch comes up (tests/test_data_checks.py: every case).
    with pytest.raises(ValueError, match=rf"`source` row 1 \({path} line 2\): prompt_field 'prompt' is an empty text"):
        DatasetDataModule(str(path), prompts_per_step=1)
    # Rows handed to PromptRows some other way are still checked when served.
    with pytest.raises(ValueError, match="row 1 has prompt_field 'prompt' = ''"):
        PromptRows(rows, "prompt")[1]
