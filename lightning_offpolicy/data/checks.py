"""Every row of a prompt table checked before the first step, not when its batch comes up.

A bad row 10 000 rows into a file used to fail only when its batch was drawn, minutes or hours into
a run, and some failed without a row at all (a raw ``UnicodeDecodeError``). Here:

* :func:`check_rows`, when the data is loaded: every text cell is valid UTF-8, and every prompt is
  a non-empty text or a chat ``messages`` list (not null). One vectorized pass over the Arrow
  table (the validation is Arrow's own); only chat-list prompts are looked at row by row.
* :func:`check_prompt_lengths`, before the first step, when the tokenizer and the context are
  known (``RolloutCallback.on_fit_start``): every prompt + ``max_new_tokens`` fits the model's /
  engine's context. One pass, the texts tokenized a batch at a time.

Errors name the setting, the row (0-based, as ``dataset[i]``), the file and its line where the
source is a file, the field and what is wrong, and what to do.
:class:`~lightning_offpolicy.data.files.RowLocator` finds the file and the line, only when there is
an error to report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning_offpolicy.data.files import UTF8_ADVICE, RowLocator
from lightning_offpolicy.data.prompts import encode_prompt, encode_prompts

__all__ = ["check_prompt_lengths", "check_rows", "is_prompt"]

#: Rows per Arrow batch of the checks: small enough to keep memory flat, large enough to stay vectorized.
BATCH_ROWS = 65_536
#: Prompts tokenized per call of the length check.
TOKENIZE_ROWS = 1_024
#: Bad rows named one by one in a message (the count covers them all).
SHOWN = 5

_FIX_ROW = "Fix or drop the row(s) in the data (every row is checked before the first step)."


def is_prompt(value: Any) -> bool:
    """A non-empty text, or a non-empty chat ``messages`` list of ``{"role", "content"}`` dicts."""
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


# ------------------------------------------------------------------------------ rows at load


def check_rows(rows: Any, field: str, locate: RowLocator, owner: str = "DatasetDataModule") -> None:
    """``ValueError`` naming the first bad rows when a text cell is not UTF-8 or a prompt is not one.

    Args:
        rows: a ``datasets.Dataset`` (checked as Arrow batches) or a sequence of dicts.
        field: the prompt column.
        locate: names a row in the message.
        owner: the class named in the message.
    """
    import datasets

    if isinstance(rows, datasets.Dataset):
        _check_table(rows, field, locate, owner)
        return
    bad = [i for i in range(len(rows)) if not is_prompt(rows[i].get(field) if isinstance(rows[i], dict) else None)]
    if bad:
        _raise_bad_prompts(bad, len(bad), len(rows), field, lambda i: rows[i].get(field), locate, owner)


def _arrow_batches(rows: Any, batch_rows: int) -> Iterator[tuple[int, Any]]:
    start = 0
    for batch in rows.with_format("arrow").iter(batch_size=batch_rows):
        yield start, batch
        start += batch.num_rows


def _check_table(rows: Any, field: str, locate: RowLocator, owner: str) -> None:
    import pyarrow as pa

    bad: list[int] = []
    count = 0
    for start, batch in _arrow_batches(rows, BATCH_ROWS):
        try:
            batch.validate(full=True)
        except pa.ArrowInvalid:
            found = _first_undecodable(batch)
            if found is not None:
                _raise_invalid_utf8(batch, *found, start, locate, owner)
        indices, batch_count = _bad_prompts(batch.column(field))
        bad.extend(start + i for i in indices)
        del bad[SHOWN:]
        count += batch_count
    if count:
        _raise_bad_prompts(bad, count, len(rows), field, lambda i: rows[i][field], locate, owner)


def _is_text_type(kind: Any) -> bool:
    import pyarrow as pa

    checks = [pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None)]
    return any(check is not None and check(kind) for check in checks)


def _bad_prompts(column: Any) -> tuple[list[int], int]:
    """(the first few bad rows, how many) of one batch's prompt column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if _is_text_type(column.type):
        bad = pc.or_kleene(pc.is_null(column), pc.equal(pc.utf8_length(column), 0))
        count = int(pc.sum(bad).as_py() or 0)
        if not count:
            return [], 0
        return pc.indices_nonzero(pc.fill_null(bad, True)).to_pylist()[:SHOWN], count
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        flags = [not is_prompt(value) for value in column.to_pylist()]
        return [i for i, flag in enumerate(flags) if flag][:SHOWN], sum(flags)
    # A column of numbers, or all nulls: no row holds a prompt.
    return list(range(min(SHOWN, len(column)))), len(column)


def _describe_value(value: Any) -> str:
    if value is None:
        return "null (missing or None)"
    if isinstance(value, str):
        return "an empty text" if not value else f"{value[:60]!r}"
    if isinstance(value, list):
        if not value:
            return "an empty list"
        return f"a list without role / content in every message ({str(value)[:80]})"
    return f"{repr(value)[:60]} (of type {type(value).__name__})"


def _raise_bad_prompts(
    bad: list[int], count: int, total: int, field: str, value_of: Callable[[int], Any], locate: RowLocator, owner: str
) -> None:
    first = bad[0]
    others = f"; the first {len(bad)}: rows {', '.join(map(str, bad))}" if len(bad) > 1 else ""
    raise ValueError(
        f"{owner}: {locate(first)}: prompt_field {field!r} is {_describe_value(value_of(first))}; every prompt must "
        f"be a non-empty text or a chat messages list of {{'role': ..., 'content': ...}}. {count} of {total} rows "
        f"of `{locate.setting}` are bad{others}. {_FIX_ROW}"
    )


def _first_undecodable(batch: Any) -> tuple[int, str] | None:
    """``(row, column)`` of the batch's first cell holding text that is not UTF-8, or ``None``.

    Converting a slice to Python decodes exactly its rows (a nested column's slice shares its
    parent's child arrays, whose Arrow validation covers every row), so the row is bisected by
    conversion: only once a batch failed validation.
    """
    first: tuple[int, str] | None = None
    for name in batch.column_names:
        column = batch.column(name)
        if _decodes(column):
            continue
        low, high = 0, len(column)  # the first undecodable row lies in [low, high)
        while high - low > 1:
            middle = (low + high) // 2
            if _decodes(column.slice(low, middle - low)):
                low = middle
            else:
                high = middle
        if first is None or low < first[0]:
            first = (low, name)
    return first


def _decodes(column: Any) -> bool:
    try:
        column.to_pylist()
    except UnicodeDecodeError:
        return False
    return True


def _raise_invalid_utf8(batch: Any, row: int, name: str, start: int, locate: RowLocator, owner: str) -> None:
    import pyarrow as pa

    column = batch.column(name)
    detail = " (a text inside it)"
    binary = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}.get(column.type)
    if binary is not None:
        cell = column.slice(row, 1)
        cell = cell.combine_chunks() if isinstance(cell, pa.ChunkedArray) else cell
        raw = cell.view(binary)[0].as_py()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            detail = f": byte 0x{raw[err.start]:02x} at position {err.start} ({err.reason}; near {raw[:60]!r})"
    raise ValueError(
        f"{owner}: {locate(start + row)}: column {name!r} is not valid UTF-8{detail}. {UTF8_ADVICE} Rows after "
        "it may have the same problem."
    )


# ------------------------------------------------------------------------------ lengths before the first step


def _prompt_batches(rows: Any, field: str, batch_rows: int) -> Iterator[tuple[int, list[Any]]]:
    import datasets

    if isinstance(rows, datasets.Dataset):
        start = 0
        for batch in rows.select_columns([field]).iter(batch_size=batch_rows):
            yield start, batch[field]
            start += len(batch[field])
        return
    for start in range(0, len(rows), batch_rows):
        yield start, [rows[i][field] for i in range(start, min(len(rows), start + batch_rows))]


def check_prompt_lengths(
    rows: Any,
    field: str,
    locate: RowLocator,
    tokenizer: Any,
    max_new_tokens: int,
    limit: tuple[int, str],
    owner: str = "DatasetDataModule",
) -> int:
    """``ValueError`` naming the prompts whose tokens + ``max_new_tokens`` exceed ``limit``; else the longest prompt.

    Args:
        rows: a ``datasets.Dataset`` or a sequence of dicts.
        field: the prompt column.
        locate: names a row in the message.
        tokenizer: what the rollouts encode prompts with (its own rule: bos, chat template).
        max_new_tokens: ``rollout.sampling.max_new_tokens``.
        limit: ``(tokens, description)`` of the context, as :func:`lightning_offpolicy.preflight.context_limit`.
        owner: the class named in the message.
    """
    budget = limit[0] - max_new_tokens
    too_long: list[tuple[int, int]] = []
    count = 0
    longest = (0, -1)
    for start, prompts in _prompt_batches(rows, field, TOKENIZE_ROWS):
        try:
            lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts)]
        except Exception:
            lengths = []
            for offset, prompt in enumerate(prompts):
                try:
                    lengths.append(len(encode_prompt(tokenizer, prompt)))
                except Exception as err:
                    raise ValueError(
                        f"{owner}: {locate(start + offset)}: the tokenizer cannot encode prompt_field {field!r} = "
                        f"{str(prompt)[:80]!r}: {type(err).__name__}: {err}. {_FIX_ROW}"
                    ) from err
        for offset, length in enumerate(lengths):
            longest = max(longest, (length, -(start + offset)))
            if length > budget:
                count += 1
                if len(too_long) < SHOWN:
                    too_long.append((start + offset, length))
    if count:
        row, length = too_long[0]
        longest_row = -longest[1]
        others = ", ".join(f"row {r} ({n})" for r, n in too_long[1:])
        raise ValueError(
            f"{owner}: {locate(row)}: prompt_field {field!r} is {length} tokens, and with "
            f"rollout.sampling.max_new_tokens={max_new_tokens} that is {length + max_new_tokens} > {limit[1]} "
            f"({limit[0]} tokens): a prompt may "
            f"have at most {budget} tokens. {count} of {len(rows)} prompts of `{locate.setting}` are too long"
            + (f" (others: {others})" if others else "")
            + f"; the longest is row {longest_row} ({longest[0]} tokens). Drop or shorten those rows, lower "
            "rollout.sampling.max_new_tokens, or use a model / engine with a longer context (vLLM: a larger "
            "start.max_model_len)."
        )
    return longest[0]
