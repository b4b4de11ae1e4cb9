"""Smoke test: benchmarks/logprob_memory.py --quick runs and writes the expected table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "logprob_memory.py"


@pytest.mark.slow
@pytest.mark.bench("benchmarks/logprob_memory.py --quick")
def test_logprob_benchmark_quick(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for key in ("machine:", "torch:", "date:", "command:", "## Method", "fresh subprocess"):
        assert key in text, key
    assert "--quick" in text
    results = text.split("## Results", 1)[1].split("## Summary", 1)
    summary_text, fused_text = results[1].split("## Fused head", 1)
    rows = [line for line in results[0].splitlines() if re.match(r"^\| \d+ \|", line)]
    summary = [line for line in summary_text.splitlines() if re.match(r"^\| \d+ \|", line)]
    fused = [line for line in fused_text.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [tuple(c.strip() for c in row.strip("|").split("|")[:3]) for row in summary] == [
        ("2000", "256", "float32"),
        ("4000", "256", "bfloat16"),
    ]
    # quick: 2 cases x (1 lean chunk size + naive)
    got = [tuple(c.strip() for c in row.strip("|").split("|")[:6]) for row in rows]
    assert [(g[0], g[1], g[2], g[4], g[5]) for g in got] == [
        ("2000", "256", "float32", "lean", "16"),
        ("2000", "256", "float32", "naive", "-"),
        ("4000", "256", "bfloat16", "lean", "16"),
        ("4000", "256", "bfloat16", "naive", "-"),
    ]
    peaks = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 12, row
        assert "skipped" not in row, row
        ratio = float(cells[10].strip("*"))
        assert ratio > 0, row  # the gradient alone is one logits tensor
        peaks[(cells[2], cells[4])] = ratio
        if cells[4] == "lean":  # same logprobs as the naive path on the same seeded logits
            assert cells[11] != "-" and float(cells[11]) < 1e-5, row
    for dtype in ("float32", "bfloat16"):
        assert peaks[(dtype, "lean")] < peaks[(dtype, "naive")], peaks
    # The fused head: one row per case, a peak and a time, the same logprobs as the unfused head.
    assert [tuple(c.strip() for c in row.strip("|").split("|")[:4]) for row in fused] == [
        ("2000", "256", "float32", "32"),
        ("4000", "256", "bfloat16", "32"),
    ]
    for row in fused:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 15 and "skipped" not in row, row
        assert float(cells[5]) > 0 and float(cells[11].strip("*")) > 0, row
        assert float(cells[14]) < 1e-4, row
    for row in summary:  # the summary carries the fused peak and time ratio
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 8 and float(cells[6]) > 0 and float(cells[7]) > 0, row
