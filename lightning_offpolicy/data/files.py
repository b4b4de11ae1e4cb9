"""Data files: the reader a file takes, its decompressed bytes, the first line that is not UTF-8, where a row is.

Shared by :mod:`~lightning_offpolicy.data.sources` (which reads the files) and
:mod:`~lightning_offpolicy.data.checks` (whose messages name the file and line of a bad row).
"""

from __future__ import annotations

import bz2
import csv
import glob
import gzip
import io
import lzma
import os
from collections.abc import Callable, Sequence
from typing import IO, Any

__all__ = ["UTF8_ADVICE", "RowLocator", "file_builder", "find_invalid_utf8_line"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zip")


def file_builder(path: str) -> str:
    """The ``datasets`` builder that reads ``path`` (``json``, ``parquet`` or ``csv``), from its extension."""
    name = path.lower()
    for suffix in _COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    ext = os.path.splitext(name)[1]
    if ext not in _BUILDERS:
        raise ValueError(
            f"DatasetDataModule: cannot read {path!r}: unknown extension {ext or '(none)'!r}. Supported: "
            f"{', '.join(sorted(_BUILDERS))} (optionally compressed: {', '.join(_COMPRESSION)}), a directory "
            "written by Dataset.save_to_disk, or reasoning_gym:<task>."
        )
    return _BUILDERS[ext]


_OPENERS: dict[str, Callable[[str], IO[bytes]]] = {
    ".gz": lambda p: gzip.open(p, "rb"),
    ".bz2": lambda p: bz2.open(p, "rb"),
    ".xz": lambda p: lzma.open(p, "rb"),
}


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
