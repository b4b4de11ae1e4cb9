"""Smoke test of benchmarks/correction_bench.py: it runs, and its report has the expected shape.

Not a timed test: only that every preset gets one row with positive, finite numbers.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from lightning_offpolicy.correction import PRESETS

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "correction_bench.py"


def _first_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| preset |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return header, rows


def test_correction_bench_quick(tmp_path):
    out = tmp_path / "perf.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for needed in ("nproc=", "torch ", "threads=", "**Date**", "**Command**", "## Method"):
        assert needed in text
    assert "Non-finite results" not in text, text

    header, rows = _first_table(text)
    names = [row[0] for row in rows]
    assert sorted(names) == sorted(PRESETS), names
    assert len(names) == len(set(names))

    def column(name: str) -> int:
        return next(i for i, h in enumerate(header) if h.startswith(name))

    numeric = ["step ms", "x bound (hot)", "bound ms", "distinct MiB", "peak extra MiB"]
    for row in rows:
        assert len(row) == len(header), row
        for name in numeric:
            value = float(row[column(name)].split()[0])
            assert math.isfinite(value) and value > 0, (row[0], name, value)
    # The table also goes to stdout.
    assert "| preset |" in proc.stdout


ASYNC_BENCH = BENCH.parent / "async_overlap.py"


def test_async_overlap_bench_quick(tmp_path):
    out = tmp_path / "async.md"
    proc = subprocess.run(
        [sys.executable, str(ASYNC_BENCH), "--quick", "--engines", "hf", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    (row,) = json.loads(out.with_suffix(".json").read_text())
    assert row["engine"] == "hf" and row["batches_counted"] == 4
    for key in ("sync_step_s", "async_step_s", "generation_s", "training_s", "async_wait_s"):
        assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
    # The components add up: ideal = max(generation, training), and sync = generation + training.
    assert row["ideal_step_s"] == max(row["generation_s"], row["training_s"])
    assert math.isclose(row["generation_s"] + row["training_s"], row["sync_step_s"], rel_tol=1e-9)
    assert "| hf |" in out.read_text()
