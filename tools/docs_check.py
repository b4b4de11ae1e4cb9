#!/usr/bin/env python
"""Re-run the cheap figures of the docs and compare them with what the docs say (``make docs-check``).

A figure is checked when a marker comment precedes it in a Markdown file; the marker names the
figure's kind and the command that produced it, the same command the visible text states::

    <!-- docs-check: quickstart `lightning-offpolicy fit --config configs/quickstart.yaml` -->
    | batches | 1-30 | 31-60 | ...
    |---|---|---| ...
    | `train/reward` | 0.402 | 0.446 | ...

    <!-- docs-check: selfcheck `lightning-offpolicy selfcheck --logdir ''` -->
    ```text
    (the table the command prints)
    ```

Kinds and tolerances (the numbers are parsed from the docs, never copied here):

* ``quickstart``: the fit is re-run (logger and ``default_root_dir`` moved to a temporary folder,
  no checkpoint, no progress bar: nothing that changes what is trained); the mean of the
  per-batch ``train/reward`` over each block of batches in the header (``1-30`` ...) must be
  within ``QUICKSTART_TOLERANCE`` of the table. Only ``train/reward`` is read: other keys (a
  validation loop's ``val/*``) may come and go. README's "from **a** (first 30 batches) to **b**
  (last 30)" is compared with the first and last block of the same run (``README_TOLERANCE``:
  the tolerance plus the rounding to 2 decimals). Wall times are stated in the docs, not checked:
  they follow the machine's load.
* ``selfcheck``: every number of every row but the ``ms`` (timing) column must be within
  ``SELFCHECK_REL_TOLERANCE`` (relative) or ``SELFCHECK_ABS_TOLERANCE`` (absolute) of the table.
* ``output``, ``report``, ``quote``: single figures stated in the marker after its command, checked
  against a line an example prints, a JSON report, or the source document of a figure too costly to
  re-measure here (tools/docs_check_figures.py)::

    <!-- docs-check: output `python examples/<name>.py` reward, first {10} batches {0.22} -> last {10} {0.44} -->
    <!-- docs-check: report `docs/reports/performance_gpu.json` 20.6=parts.lora.peak_allocated_bytes:GiB -->
    <!-- docs-check: quote `docs/async.md` 0.44 0.65 -->

Usage::

    python tools/docs_check.py                      # every marked figure of README.md and docs/*.md
    python tools/docs_check.py --only selfcheck     # one kind
    python tools/docs_check.py --files docs/getting_started.md

Exit status 0 when every figure matches, 1 on a mismatch (each one listed, with the measured
table to paste), 2 when no figure was found. It takes minutes (the quickstart's 300 batches and the
two examples dominate): not part of ``make test``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from docs_check_figures import check_figure

ROOT = Path(__file__).resolve().parent.parent
#: Largest |measured - documented| mean train/reward of a block of batches.
QUICKSTART_TOLERANCE = 0.02
#: README's figures are the first / last block rounded to 2 decimals.
README_TOLERANCE = QUICKSTART_TOLERANCE + 0.005
#: A selfcheck number matches within this relative or this absolute difference.
SELFCHECK_REL_TOLERANCE = 0.02
SELFCHECK_ABS_TOLERANCE = 2e-3
#: Columns of the selfcheck table that are timings (not compared).
SELFCHECK_TIMING_COLUMNS = ("ms",)
#: The table kinds are checked here, the single figures by docs_check_figures.py.
FIGURE_KINDS = ("output", "report", "quote")
KINDS = ("quickstart", "selfcheck", *FIGURE_KINDS)

_MARKER = re.compile(r"<!--\s*docs-check:\s*(?P<kind>[\w-]+)\s+`(?P<command>[^`]+)`(?P<spec>.*?)\s*-->")
_BLOCK = re.compile(r"^(\d+)-(\d+)$")
_README = re.compile(
    r"from \*\*(?P<first>\d+\.\d+)\*\*\s+\(first (?P<n1>\d+) batches\)\s+to \*\*(?P<last>\d+\.\d+)\*\*\s+"
    r"\(last (?P<n2>\d+)\)"
)


@dataclass
class Figure:
    """One marked figure: where it is, the command next to it, and the text that follows the marker."""

    path: Path
    line: int
    kind: str
    command: str
    body: str
    #: The figures a single-figure marker states (after its command).
    spec: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


# ---------------------------------------------------------------------- parsing the docs


def find_figures(path: Path) -> list[Figure]:
    """The marked figures of one Markdown file."""
    text = path.read_text(encoding="utf-8")
    figures = []
    for match in _MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        figure = Figure(path, line, match["kind"], match["command"].strip(), text[match.end() :], match["spec"].strip())
        figures.append(figure)
    return figures


def parse_reward_table(body: str) -> list[tuple[int, int, float]]:
    """``(first batch, last batch, mean train/reward)`` per column of the Markdown table that starts ``body``."""
    rows = [line.strip() for line in body.strip().splitlines()]
    table = []
    for row in rows:
        if not row.startswith("|"):
            break
        table.append([cell.strip() for cell in row.strip("|").split("|")])
    header = next((r for r in table if r and r[0] == "batches"), None)
    values = next((r for r in table if r and r[0].strip("`") == "train/reward"), None)
    if header is None or values is None:
        raise ValueError("expected a Markdown table with a `batches` header row and a `train/reward` row")
    blocks = []
    for span, value in zip(header[1:], values[1:], strict=True):
        match = _BLOCK.match(span)
        if match is None:
            raise ValueError(f"a header cell must be a batch range like 1-30, got {span!r}")
        blocks.append((int(match[1]), int(match[2]), float(value)))
    return blocks


def parse_selfcheck_table(text: str) -> dict[str, dict[str, float]]:
    """``{preset: {column: value}}`` of the table ``lightning-offpolicy selfcheck`` prints (in a doc or its output)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.split()[:1] == ["preset"]), None)
    if start is None:
        raise ValueError("expected the selfcheck table (a header line starting with 'preset')")
    columns = lines[start].split()[1:]
    table: dict[str, dict[str, float]] = {}
    for line in lines[start + 1 :]:
        words = line.split()
        if set(line.strip()) == {"-"}:
            continue
        row = _numbers(words[1:]) if len(words) == len(columns) + 1 else None
        if row is None:  # the end of the table (a blank line, a fence, the line after it in the output)
            break
        table[words[0]] = dict(zip(columns, row, strict=True))
    if not table:
        raise ValueError("the selfcheck table has no rows")
    return table


def _numbers(words: list[str]) -> list[float] | None:
    try:
        return [float(w) for w in words]
    except ValueError:
        return None


def parse_readme_summary(text: str) -> tuple[int, float, float] | None:
    """README's "from **a** (first N batches) to **b** (last N)": ``(N, a, b)``, or ``None`` when absent."""
    match = _README.search(text)
    if match is None:
        return None
    return int(match["n1"]), float(match["first"]), float(match["last"])


# ---------------------------------------------------------------------- comparing


def compare_blocks(
    documented: list[tuple[int, int, float]], rewards: list[float], tolerance: float = QUICKSTART_TOLERANCE
) -> list[str]:
    """Mismatches between a documented reward table and the per-batch rewards of a run."""
    problems = []
    for first, last, value in documented:
        if last > len(rewards):
            problems.append(f"batches {first}-{last}: the run has only {len(rewards)} batches")
            continue
        measured = block_mean(rewards, first, last)
        if abs(measured - value) > tolerance:
            problems.append(
                f"batches {first}-{last}: documented {value:.3f}, measured {measured:.3f} (tol {tolerance})"
            )
    return problems


def block_mean(rewards: list[float], first: int, last: int) -> float:
    """Mean of batches ``first..last`` (1-based, inclusive)."""
    chunk = rewards[first - 1 : last]
    return math.fsum(chunk) / len(chunk)


def compare_selfcheck(
    documented: dict[str, dict[str, float]],
    measured: dict[str, dict[str, float]],
    rel: float = SELFCHECK_REL_TOLERANCE,
    abs_: float = SELFCHECK_ABS_TOLERANCE,
) -> list[str]:
    """Mismatches between a documented selfcheck table and a fresh one (timing columns skipped)."""
    problems = []
    for preset in documented.keys() - measured.keys():
        problems.append(f"{preset}: documented, but the selfcheck no longer prints it")
    for preset in measured.keys() - documented.keys():
        problems.append(f"{preset}: printed by the selfcheck, missing from the docs")
    for preset in documented.keys() & measured.keys():
        for column, value in documented[preset].items():
            if column in SELFCHECK_TIMING_COLUMNS:
                continue
            new = measured[preset].get(column)
            if new is None:
                problems.append(f"{preset}.{column}: documented, not printed any more")
            elif not math.isclose(new, value, rel_tol=rel, abs_tol=abs_):
                problems.append(f"{preset}.{column}: documented {value:g}, measured {new:g} (rel {rel}, abs {abs_})")
    return problems


# ---------------------------------------------------------------------- running the commands


def command_argv(command: str) -> list[str]:
    """The documented command as this interpreter runs it (``lightning-offpolicy`` -> ``python -m ...cli``)."""
    words = shlex.split(command)
    if not words or words[0] != "lightning-offpolicy":
        raise ValueError(f"docs-check runs `lightning-offpolicy ...` commands only, got {command!r}")
    return [sys.executable, "-m", "lightning_offpolicy.cli", *words[1:]]


def _run(argv: list[str], timeout_s: float) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_quickstart(command: str, timeout_s: float = 3600.0) -> list[float]:
    """Per-batch ``train/reward`` of the documented fit, its outputs kept in a temporary folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory(prefix="docs_check_") as tmp:
        argv = command_argv(command) + [
            f"--trainer.logger.init_args.save_dir={tmp}",
            f"--trainer.default_root_dir={tmp}",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
        ]
        _run(argv, timeout_s)
        runs = sorted({p.parent for p in Path(tmp).rglob("events.out.tfevents*")})
        if len(runs) != 1:
            raise RuntimeError(f"expected the events of one run under {tmp}, found {len(runs)}")
        events = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
        events.Reload()
        scalars = sorted(events.Scalars("train/reward"), key=lambda s: s.step)
        return [float(s.value) for s in scalars]


def run_selfcheck(command: str, timeout_s: float = 1800.0) -> dict[str, dict[str, float]]:
    """The table the documented selfcheck command prints."""
    return parse_selfcheck_table(_run(command_argv(command), timeout_s))


# ---------------------------------------------------------------------- the check


def reward_table_markdown(documented: list[tuple[int, int, float]], rewards: list[float]) -> str:
    """The measured table in the docs' format, for pasting."""
    spans = [(a, b) for a, b, _ in documented if b <= len(rewards)]
    header = "| batches | " + " | ".join(f"{a}-{b}" for a, b in spans) + " |"
    rule = "|---|" + "---|" * len(spans)
    row = "| `train/reward` | " + " | ".join(f"{block_mean(rewards, a, b):.3f}" for a, b in spans) + " |"
    return "\n".join((header, rule, row))


def check(files: list[Path], only: tuple[str, ...] = KINDS) -> int:
    """Re-run every marked figure of ``files`` (of the kinds in ``only``); 0 when all match, 1 otherwise."""
    figures = [f for path in files for f in find_figures(path) if f.kind in only]
    unknown = [f for f in figures if f.kind not in KINDS]
    if unknown:
        raise ValueError(f"{unknown[0].where}: unknown docs-check kind {unknown[0].kind!r}; known: {', '.join(KINDS)}")
    if not figures:
        print(f"docs-check: no marked figure of kinds {', '.join(only)} in {', '.join(map(str, files))}")
        return 2
    failures = 0
    quickstart_runs: dict[str, list[float]] = {}
    for figure in figures:
        print(f"docs-check: {figure.where}: {figure.kind}: `{figure.command}`", flush=True)
        if figure.kind in FIGURE_KINDS:
            problems = check_figure(
                figure.kind, figure.command, figure.spec, figure.body, partial(_run, timeout_s=1800)
            )
            measured = ""
        elif figure.kind == "quickstart":
            documented = parse_reward_table(figure.body)
            if figure.command not in quickstart_runs:
                quickstart_runs[figure.command] = run_quickstart(figure.command)
            rewards = quickstart_runs[figure.command]
            problems = compare_blocks(documented, rewards)
            problems += _readme_problems(files, documented, rewards)
            measured = reward_table_markdown(documented, rewards)
        else:
            documented_table = parse_selfcheck_table(figure.body)
            fresh = run_selfcheck(figure.command)
            problems = compare_selfcheck(documented_table, fresh)
            measured = "\n".join(f"{k}: {v}" for k, v in fresh.items())
        if problems:
            failures += 1
            print("  MISMATCH:\n    " + "\n    ".join(problems) + ("\n  measured:\n" + measured if measured else ""))
        else:
            print("  ok" + (f", measured:\n{measured}" if figure.kind == "quickstart" else ""))
    print(f"docs-check: {len(figures) - failures} of {len(figures)} figures match")
    return 1 if failures else 0


def _readme_problems(files: list[Path], documented: list[tuple[int, int, float]], rewards: list[float]) -> list[str]:
    """README's first / last block figures against the same run."""
    problems = []
    for path in files:
        if path.name != "README.md":
            continue
        summary = parse_readme_summary(path.read_text(encoding="utf-8"))
        if summary is None:
            continue
        size, first, last = summary
        if len(rewards) < size:
            problems.append(f"README: the run has {len(rewards)} batches, fewer than {size}")
            continue
        for label, value, measured in (
            ("first", first, block_mean(rewards, 1, size)),
            ("last", last, block_mean(rewards, len(rewards) - size + 1, len(rewards))),
        ):
            if abs(measured - value) > README_TOLERANCE:
                problems.append(
                    f"README {label} {size} batches: documented {value:.2f}, measured {measured:.3f} "
                    f"(tol {README_TOLERANCE})"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--files",
        nargs="+",
        type=Path,
        default=[ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
        help="Markdown files to scan for docs-check markers (default: README.md and docs/*.md)",
    )
    parser.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS), help="kinds of figures to check")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        parser.error(f"--files: no such file: {', '.join(missing)}")
    return check([p.resolve() for p in args.files], tuple(args.only))


if __name__ == "__main__":
    sys.exit(main())
