"""Every data row is checked before the first step, named by file, line, field and what to do.

Real files in tmp_path read by the real ``datasets`` loaders; the length check runs in a real fit
(tiny Llama, HF engine, the kit's RolloutCallback) and must stop it before any training step.
"""

from __future__ import annotations

import gzip
import json
import time

import datasets
import lightning as L
import pytest

from lightning_offpolicy.data import DatasetDataModule
from lightning_offpolicy.data.tokenizers import HFTokenizer, encode_prompt, encode_prompts
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import SamplingConfig
from tests.module_helpers import TOKENIZER, tiny_model
from tests.tokenizer_builders import CHAT_TEMPLATE, save_char_tokenizer

#: A bad row this far into the file: found at setup, not when its batch comes up.
DEEP = 10_000


def rows(n: int = DEEP + 2000) -> list[dict]:
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)]


def write_jsonl(path, records, raw_line: bytes | None = None, at: int | None = None):
    with open(path, "wb") as f:
        for i, record in enumerate(records):
            if raw_line is not None and i == at:
                f.write(raw_line)
            f.write((json.dumps(record) + "\n").encode())
    return path


def test_a_null_prompt_deep_in_a_jsonl_file_fails_at_construction_naming_file_line_and_field(tmp_path):
    records = rows()
    records[DEEP]["prompt"] = None
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(ValueError) as info:
        DatasetDataModule(str(path), prompts_per_step=4)  # before: loaded; the row failed when its batch came up
    message = str(info.value)
    assert f"`source` row {DEEP} ({path} line {DEEP + 1})" in message
    assert "prompt_field 'prompt' is null" in message and f"1 of {len(records)} rows" in message
    assert "Fix or drop the row" in message


def test_empty_prompts_and_empty_chat_lists_are_counted_and_the_first_ones_named(tmp_path):
    records = rows(40)
    for i in (7, 21, 33):
        records[i]["prompt"] = ""
    with pytest.raises(ValueError, match=r"row 7 .*an empty text.* 3 of 40 rows .* rows 7, 21, 33"):
        DatasetDataModule(str(write_jsonl(tmp_path / "rows.jsonl", records)), prompts_per_step=4)
    chat = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": i} for i in range(6)]
    chat[4]["messages"] = []
    path = write_jsonl(tmp_path / "chat.jsonl", chat)
    with pytest.raises(ValueError, match=rf"row 4 \({path} line 5\): prompt_field 'messages' is an empty list"):
        DatasetDataModule(str(path), prompt_field="messages", prompts_per_step=2)


def test_a_non_utf8_byte_in_a_jsonl_file_names_file_line_column_and_byte(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", rows(), raw_line=b'{"prompt": "caf\xe9", "answer": "1"}\n', at=DEEP)
    with pytest.raises(ValueError) as info:
        # Before: construction passed, then a raw UnicodeDecodeError without file or row when the batch came.
        DatasetDataModule(str(path), prompts_per_step=4)
    message = str(info.value)
    assert f"`source` row {DEEP} ({path} line {DEEP + 1}): column 'prompt' is not valid UTF-8" in message
    assert "byte 0xe9" in message and "iconv -f latin1 -t utf-8" in message


def test_a_non_utf8_byte_inside_a_chat_list_is_found_in_its_own_batch(tmp_path, monkeypatch):
    from lightning_offpolicy.data import checks

    # Batches of 4 rows: a list column's slice shares the whole child array, so Arrow flags every batch.
    monkeypatch.setattr(checks, "BATCH_ROWS", 4)
    good = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "answer": i}) for i in range(10)]
    lines = [line.encode() + b"\n" for line in good]
    lines[7] = b'{"messages": [{"role": "user", "content": "caf\xe9"}], "answer": 7}\n'
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=rf"row 7 \({path} line 8\): column 'messages' is not valid UTF-8 \(a text"):
        DatasetDataModule(str(path), prompt_field="messages", prompts_per_step=2)


def test_a_non_utf8_byte_in_a_csv_file_names_its_line(tmp_path):
    path = tmp_path / "train.csv"
    lines = [b"prompt,answer\n"] + [f"{i}+{i}=,{2 * i}\n".encode() for i in range(DEEP)]
    lines.insert(DEEP - 1, b"caf\xe9,1\n")  # line DEEP: the header is line 1
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError) as info:
        DatasetDataModule(str(path), prompts_per_step=4)
    message = str(info.value)
    assert f"{path} line {DEEP}: byte 0xe9 at column 4 is not valid UTF-8" in message
    assert "DatasetGenerationError" not in message


def test_a_glob_names_the_file_and_line_of_the_bad_row(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", rows(30))
    records = rows(20)
    records[12]["prompt"] = None
    second = write_jsonl(tmp_path / "b.jsonl", records)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b"".join((json.dumps(r) + "\n").encode() for r in rows(5))))
    with pytest.raises(ValueError, match=rf"`source` row 42 \({second} line 13\)"):
        DatasetDataModule(str(tmp_path / "*.jsonl*"), prompts_per_step=4)


def test_a_parquet_row_is_named_by_its_row_in_the_file_and_a_val_source_by_its_setting(tmp_path):
    records = rows(50)
    records[44]["prompt"] = None
    path = tmp_path / "val.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(path))
    good = write_jsonl(tmp_path / "train.jsonl", rows(8))
    with pytest.raises(ValueError, match=rf"`val_source` row 44 \({path} row 44 of the file\): prompt_field"):
        DatasetDataModule(str(good), val_source=str(path), prompts_per_step=4)


def test_a_column_of_numbers_is_no_prompt_column(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": i, "answer": i} for i in range(5)])
    with pytest.raises(ValueError, match=r"row 0 .* is 0 \(of type int\).* 5 of 5 rows"):
        DatasetDataModule(str(path), prompts_per_step=1)


def test_checking_a_big_file_costs_little_next_to_reading_it(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"question {i} " * 8, "answer": i} for i in range(200_000)])
    begin = time.perf_counter()
    DatasetDataModule(str(path), prompts_per_step=4)
    assert time.perf_counter() - begin < 10.0  # ~1 s on 2 busy cores: one Arrow pass, no Python per row


# ---------------------------------------------------------------------------- prompt lengths, before the first step


def fit(data, max_new_tokens: int = 8, max_steps: int = 1) -> L.Trainer:
    module = OffPolicyRLModule(model=tiny_model(), tokenizer=TOKENIZER, num_minibatches=1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[
            RolloutCallback(
                sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=max_new_tokens),
                reward_fn=lambda p, c, m: [0.0] * len(c),
            )
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return trainer


def test_a_prompt_longer_than_the_context_fails_before_the_first_step_naming_its_line(tmp_path):
    records = rows(300)
    records[250]["prompt"] = "1+" * 130 + "="  # 261 characters + bos > the tiny model's 256 positions
    records[270]["prompt"] = "2*" * 150 + "="
    path = write_jsonl(tmp_path / "train.jsonl", records)
    data = DatasetDataModule(str(path), prompts_per_step=4, shuffle=False)  # row 250 is in batch 63
    with pytest.raises(ValueError) as info:
        fit(data)  # before: one step trained, the long row never came up; on a long run it fails hours in
    message = str(info.value)
    assert f"`source` row 250 ({path} line 251): prompt_field 'prompt' is 262 tokens" in message
    assert (
        "rollout.sampling.max_new_tokens=8 that is 270 > the model's context (max_position_embeddings=256)" in message
    )
    assert "2 of 300 prompts of `source` are too long (others: row 270 (302)); the longest is row 270" in message


def test_a_prompt_the_tokenizer_cannot_encode_is_named_before_the_first_step(tmp_path):
    records = rows(40)
    records[33]["prompt"] = "What is 2+2?"  # capitals: not in the char tokenizer's alphabet
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(ValueError, match=rf"row 33 \({path} line 34\): the tokenizer cannot encode .*'W'"):
        fit(DatasetDataModule(str(path), prompts_per_step=4, shuffle=False))


def test_prompts_that_fit_train_as_before(tmp_path):
    trainer = fit(DatasetDataModule(str(write_jsonl(tmp_path / "train.jsonl", rows(40))), prompts_per_step=4))
    assert trainer.global_step >= 1


def test_batched_encoding_gives_the_ids_of_one_prompt_at_a_time(tmp_path):
    directory = save_char_tokenizer(tmp_path / "tok", bos_rule=True, chat_template=CHAT_TEMPLATE)
    texts = ["ab", "a+b=", "", "0123"]
    chats = [[{"role": "user", "content": t or "x"}] for t in texts]
    for options in ({}, {"add_bos": True}, {"add_bos": False}, {"chat_template": True}):
        tokenizer = HFTokenizer(directory, **options)
        assert encode_prompts(tokenizer, texts) == [encode_prompt(tokenizer, t) for t in texts], options
        assert encode_prompts(tokenizer, chats) == [encode_prompt(tokenizer, c) for c in chats], options
    raw = HFTokenizer(directory).tokenizer  # a bare transformers tokenizer
    assert encode_prompts(raw, texts) == [encode_prompt(raw, t) for t in texts]
    assert encode_prompts(TOKENIZER, texts) == [encode_prompt(TOKENIZER, t) for t in texts]
