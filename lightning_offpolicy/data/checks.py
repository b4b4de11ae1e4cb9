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
source is a file, the field and what is wrong, and what to do. :class:`RowLocator` finds the file
and the line, only when there is an error to report.
"""

from __future__ import annotations

import bz2
import csv
import glob
import gzip
import io
import lzma
import os
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

__all__ = ["UTF8_ADVICE", "RowLocator", "check_prompt_lengths", "check_rows", "find_invalid_utf8_line", "is_prompt"]

#: Rows per Arrow batch of the checks: small enough to keep memory flat, large enough to stay vectorized.
BATCH_ROWS = 65_536
#: Prompts tokenized per call of the length check.
TOKENIZE_ROWS = 1_024
#: Bad rows named one by one in a message (the count covers them all).
SHOWN = 5

_OPENERS: dict[str, Callable[[str], IO[bytes]]] = {
    ".gz": lambda p: gzip.open(p, "rb"),
    ".bz2": lambda p: bz2.open(p, "rb"),
    ".xz": lambda p: lzma.open(p, "rb"),
}
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


def _open_bytes(path: str) -> IO[bytes] | None:
    """``path`` opened for reading its (decompressed) bytes; ``None`` for a compression we cannot read here."""
    for suffix, opener in _OPENERS.items():
        if path.lower().endswith(suffix):
            return opener(path)
    if path.lower().endswith((".zst", ".zip")):
        return None
    return open(path, "rb")


def find_invalid_utf8_line(files: Sequence[str]) -> str | None:
    """``"<file> line N: byte 0x.. at column C ..."`` for the first line of ``files`` that is not UTF-8, else ``None``.

    Reads the files once, line by line (only called once a read has failed on a decoding error).
    """
    for path in files:
        handle = _open_bytes(path)
        if handle is None:
            continue
        with handle:
            for number, line in enumerate(handle, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    snippet = line[max(0, err.start - 20) : err.start + 20]
                    return (
                        f"{path} line {number}: byte 0x{line[err.start]:02x} at column {err.start + 1} is not valid "
                        f"UTF-8 ({err.reason}; near {snippet!r})"
                    )
    return None


#: What to do about a file that is not UTF-8.
UTF8_ADVICE = (
    "Data files are read as UTF-8: convert the file (a Latin-1 one: `iconv -f latin1 -t utf-8 old.jsonl > "
    "new.jsonl`), or fix that row."
)


class RowLocator:
    """Names row ``index`` of a loaded source in messages: ``"`source` row 41 (data/a.jsonl line 42)"``.

    Files are only read again when a row is to be named: to find which file of a glob holds the
    row, and the row's line in a JSON-lines or CSV file (Parquet rows have no line: the row within
    the file is given).

    Args:
        setting: the setting the rows come from (``source`` / ``val_source``).
        files: the files the rows were read from, in the order they were read; ``None`` for a
            ``datasets`` object, a ``save_to_disk`` directory or generated rows.
    """

    def __init__(self, setting: str, files: Sequence[str] | None = None) -> None:
        self.setting = setting
        self.files = [os.path.abspath(f) for f in files] if files else None
        self._counts: list[int] = []

    @classmethod
    def for_source(cls, source: Any, setting: str) -> RowLocator:
        """The locator of ``source`` as :func:`~lightning_offpolicy.data.sources.load_source` reads it."""
        if not isinstance(source, (str, os.PathLike)):
            return cls(setting)
        path = os.path.expanduser(os.fspath(source))
        if os.path.isdir(path):
            return cls(setting)
        files = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        return cls(setting, [f for f in files if os.path.isfile(f)])

    def __call__(self, index: int) -> str:
        where = f"`{self.setting}` row {index}"
        if not self.files:
            return where
        try:
            path, row = self._file_row(index)
            line = _line_of_row(path, row)
        except Exception:  # naming the place must never hide the error being reported
            return where
        if path is None:
            return where
        place = f"line {line}" if line is not None else f"row {row} of the file"
        return f"{where} ({path} {place})"

    def _file_row(self, index: int) -> tuple[str | None, int]:
        assert self.files
        if len(self.files) == 1:
            return self.files[0], index
        start = 0
        for number, path in enumerate(self.files):
            if number == len(self._counts):
                self._counts.append(_rows_in_file(path))
            if index < start + self._counts[number]:
                return path, index - start
            start += self._counts[number]
        return None, index


def _rows_in_file(path: str) -> int:
    """Rows ``datasets`` reads from ``path`` (JSON lines / CSV counted here, Parquet from its metadata)."""
    from lightning_offpolicy.data.sources import file_builder

    builder = file_builder(path)
    if builder == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    if builder == "json" and _is_json_lines(path):
        handle = _open_bytes(path)
        assert handle is not None
        with handle:
            return sum(1 for line in handle if line.strip())
    if builder == "csv":
        text = _open_text(path)
        if text is not None:
            with text:
                return max(0, sum(1 for _ in csv.reader(text)) - 1)
    import datasets

    return datasets.load_dataset(builder, data_files=[path], split="train").num_rows


def _is_json_lines(path: str) -> bool:
    handle = _open_bytes(path)
    if handle is None:
        return False
    with handle:
        head = handle.read(4096).lstrip()
    return head.startswith(b"{")


def _open_text(path: str) -> io.TextIOWrapper | None:
    handle = _open_bytes(path)
    return None if handle is None else io.TextIOWrapper(handle, encoding="utf-8", errors="replace", newline="")


def _line_of_row(path: str, row: int) -> int | None:
    """The 1-based line where row ``row`` of ``path`` starts (JSON lines, CSV), else ``None``."""
    from lightning_offpolicy.data.sources import file_builder

    builder = file_builder(path)
    if builder == "json" and _is_json_lines(path):
        handle = _open_bytes(path)
        assert handle is not None
        with handle:
            seen = -1
            for number, line in enumerate(handle, 1):
                if line.strip():
                    seen += 1
                    if seen == row:
                        return number
        return None
    if builder == "csv":
        text = _open_text(path)
        if text is None:
            return None
        with text:
            reader = csv.reader(text)
            ended = 0  # the line the previous record ended on
            for record, _ in enumerate(reader):
                if record == row + 1:  # record 0 is the header
                    return ended + 1
                ended = reader.line_num
        return None
    return None


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
    from lightning_offpolicy.data.tokenizers import encode_prompt, encode_prompts

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
            "max_model_len)."
        )
    return longest[0]
