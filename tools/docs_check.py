#!/usr/bin/env python
"""Re-run the cheap figures of the docs and compare them with what the docs say (``make docs-check``).

A figure is checked when a marker comment precedes it in a Markdown file; the marker names the
figure's kind and the command that produced it, the same command the visible text states::

    <!-- docs-check: quickstart `lightning-offpolicy fit --config configs/quickstart.yaml` -->
    | `--seed_everything` | 1-30 | 31-60 | ...
    |---|---|---| ...
    | 0 | 0.402 | 0.446 | ...
    | mean | 0.410 | 0.451 | ...

    <!-- docs-check: selfcheck `lightning-offpolicy selfcheck --logdir ''` -->
    ```text
    (the table the command prints)
    ```

Kinds and tolerances (the numbers are parsed from the docs, never copied here):

* ``quickstart``: the fit is re-run once per seed row of the table (``--seed_everything=N`` added;
  logger and ``default_root_dir`` moved to a temporary folder, no checkpoint, no progress bar:
  nothing that changes what is trained), two seeds at a time; the mean of the per-batch
  ``train/reward`` over each block of batches in the header (``1-30`` ...) must be within
  ``QUICKSTART_TOLERANCE`` of the seed's row, and a ``mean`` row within it of the seeds' mean.
  Only ``train/reward`` is read: other keys (a validation loop's ``val/*``) may come and go.
  README's "from **a** (first N batches) to **b** (last N), averaged over `--seed_everything` s to
  t; every one of those seeds gains between **lo** and **hi**" is compared with the same runs
  (``README_TOLERANCE``: the tolerance plus the rounding to 2 decimals), and every seed must gain
  at least ``MIN_GAIN`` (the README's promise that the demo learns on every seed). ``--seeds``
  re-runs some rows only (what ``make test`` does with seed 0) and skips the README's seed-range.
  Wall times are stated in the docs, not checked: they follow the machine's load.
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
    python tools/docs_check.py --only quickstart --seeds 0   # one seed's row of the quickstart table
    python tools/docs_check.py --files docs/getting_started.md

Exit status 0 when every figure matches, 1 on a mismatch (each one listed, with the measured
table to paste), 2 when no figure was found. It takes minutes (the quickstart's 300 batches per seed
and the two examples dominate). ``make test`` re-runs every figure but the quickstart's other seeds
(tests/test_docs_figures.py).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from docs_check_figures import check_figure

ROOT = Path(__file__).resolve().parent.parent
#: Largest |measured - documented| mean train/reward of a block of batches.
QUICKSTART_TOLERANCE = 0.02
#: README's figures are the first / last block rounded to 2 decimals.
README_TOLERANCE = QUICKSTART_TOLERANCE + 0.005
#: Least rise of the mean train/reward, first block to last, of every documented quickstart seed.
MIN_GAIN = 0.1
#: Quickstart fits run at once (one OpenMP thread each).
QUICKSTART_JOBS = 2
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
    r"\(last (?P<n2>\d+)\),\s+averaged\s+over\s+`--seed_everything`\s+(?P<s0>\d+)\s+to\s+(?P<s1>\d+);\s+"
    r"every\s+one\s+of\s+those\s+seeds\s+gains\s+between\s+\*\*(?P<lo>\d+\.\d+)\*\*\s+and\s+\*\*(?P<hi>\d+\.\d+)\*\*"
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


@dataclass
class RewardTable:
    """A documented quickstart table: its blocks of batches, a row per seed, and the optional mean row."""

    blocks: list[tuple[int, int]]
    seeds: dict[int, list[float]]
    mean: list[float] | None = None

    def documented(self, values: list[float]) -> list[tuple[int, int, float]]:
        """``(first batch, last batch, value)`` per block of one row."""
        return [(first, last, value) for (first, last), value in zip(self.blocks, values, strict=True)]


def parse_reward_table(body: str) -> RewardTable:
    """The Markdown table that starts ``body``: a ``--seed_everything`` header of batch ranges, a row per seed.

    Raises:
        ValueError: no such table, a header cell that is not a batch range, a row that is not a seed or ``mean``.
    """
    table = []
    for row in (line.strip() for line in body.strip().splitlines()):
        if not row.startswith("|"):
            break
        table.append([cell.strip().strip("`") for cell in row.strip("|").split("|")])
    if not table or table[0][0] != "--seed_everything" or len(table) < 3:
        raise ValueError("expected a Markdown table with a `--seed_everything` header row and a row per seed")
    blocks = []
    for span in table[0][1:]:
        match = _BLOCK.match(span)
        if match is None:
            raise ValueError(f"a header cell must be a batch range like 1-30, got {span!r}")
        blocks.append((int(match[1]), int(match[2])))
    reward_table = RewardTable(blocks, {})
    for row in table[2:]:
        values = _numbers(row[1:])
        if values is None or len(values) != len(blocks):
            raise ValueError(f"a row needs a number per block of batches, got {row!r}")
        if row[0] == "mean":
            reward_table.mean = values
        elif row[0].isdigit():
            reward_table.seeds[int(row[0])] = values
        else:
            raise ValueError(f"a row starts with a seed or `mean`, got {row[0]!r}")
    if not reward_table.seeds:
        raise ValueError("the quickstart table has no seed row")
    return reward_table


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


@dataclass
class ReadmeSummary:
    """README's quickstart sentence: the seeds' mean first and last block, their seeds, the range of their gains."""

    size: int
    first: float
    last: float
    seeds: list[int]
    gain_low: float
    gain_high: float


def parse_readme_summary(text: str) -> ReadmeSummary | None:
    """README's "from **a** (first N batches) to **b** (last N), averaged over ... gains between ...", or ``None``."""
    match = _README.search(text)
    if match is None:
        return None
    seeds = list(range(int(match["s0"]), int(match["s1"]) + 1))
    return ReadmeSummary(
        int(match["n1"]), float(match["first"]), float(match["last"]), seeds, float(match["lo"]), float(match["hi"])
    )


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


def _run(argv: list[str], timeout_s: float, cwd: Path = ROOT) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_quickstart(command: str, seed: int | None = None, timeout_s: float = 3600.0) -> list[float]:
    """Per-batch ``train/reward`` of the documented fit (at ``--seed_everything=seed`` when given), its outputs
    kept in a temporary folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory(prefix="docs_check_") as tmp:
        argv = (
            command_argv(command)
            + ([] if seed is None else [f"--seed_everything={seed}"])
            + [
                f"--trainer.logger.init_args.save_dir={tmp}",
                f"--trainer.default_root_dir={tmp}",
                "--trainer.enable_checkpointing=false",
                "--trainer.enable_progress_bar=false",
            ]
        )
        _run(argv, timeout_s)
        runs = sorted({p.parent for p in Path(tmp).rglob("events.out.tfevents*")})
        if len(runs) != 1:
            raise RuntimeError(f"expected the events of one run under {tmp}, found {len(runs)}")
        events = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
        events.Reload()
        scalars = sorted(events.Scalars("train/reward"), key=lambda s: s.step)
        return [float(s.value) for s in scalars]


def run_quickstart_seeds(command: str, seeds: list[int], jobs: int = QUICKSTART_JOBS) -> dict[int, list[float]]:
    """:func:`run_quickstart` per seed, ``jobs`` fits at a time."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return dict(zip(seeds, pool.map(partial(run_quickstart, command), seeds), strict=True))


def run_selfcheck(command: str, timeout_s: float = 1800.0) -> dict[str, dict[str, float]]:
    """The table the documented selfcheck command prints."""
    return parse_selfcheck_table(_run(command_argv(command), timeout_s))


# ---------------------------------------------------------------------- the check


def reward_table_markdown(table: RewardTable, runs: dict[int, list[float]]) -> str:
    """The measured table in the docs' format (a row per seed run, and their mean), for pasting."""
    spans = [(a, b) for a, b in table.blocks if all(b <= len(rewards) for rewards in runs.values())]
    series = {str(seed): rewards for seed, rewards in sorted(runs.items())}
    if len(runs) > 1 and (mean := mean_rewards(runs)) is not None:
        series["mean"] = mean
    rows = {name: [block_mean(rewards, a, b) for a, b in spans] for name, rewards in series.items()}
    header = "| `--seed_everything` | " + " | ".join(f"{a}-{b}" for a, b in spans) + " |"
    lines = [header, "|---|" + "---|" * len(spans)]
    lines += [f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + " |" for name, values in rows.items()]
    return "\n".join(lines)


def compare_quickstart(table: RewardTable, runs: dict[int, list[float]]) -> list[str]:
    """Mismatches between the documented rows of the seeds in ``runs`` and those runs (and the mean row, when
    every documented seed was run)."""
    problems = []
    for seed, rewards in sorted(runs.items()):
        problems += [f"seed {seed}: {p}" for p in compare_blocks(table.documented(table.seeds[seed]), rewards)]
    mean = mean_rewards(runs)
    if table.mean is not None and set(runs) == set(table.seeds) and mean is not None:
        problems += [f"mean, {p}" for p in compare_blocks(table.documented(table.mean), mean)]
    return problems


def mean_rewards(runs: dict[int, list[float]]) -> list[float] | None:
    """The per-batch mean over the runs (a block's mean of it is the runs' mean of that block), or ``None`` when
    the runs differ in length (each run's own comparison names the short one)."""
    if len({len(rewards) for rewards in runs.values()}) != 1:
        return None
    return [math.fsum(batch) / len(runs) for batch in zip(*runs.values(), strict=True)]


def check_quickstart(figure: Figure, files: list[Path], seeds: list[int] | None = None) -> tuple[list[str], str]:
    """Re-run a quickstart table's seeds (all, or ``seeds``) and compare: ``(problems, measured table)``.

    With every seed re-run, README's sentence is compared too (its seeds must be the table's).
    """
    table = parse_reward_table(figure.body)
    unknown = sorted(set(seeds or ()) - set(table.seeds))
    if unknown:
        return [f"--seeds {unknown}: the table has no row for them (rows: {sorted(table.seeds)})"], ""
    runs = run_quickstart_seeds(figure.command, seeds or sorted(table.seeds))
    problems = compare_quickstart(table, runs)
    if seeds is None:
        problems += _readme_problems(files, table, runs)
    return problems, reward_table_markdown(table, runs)


def check(files: list[Path], only: tuple[str, ...] = KINDS, seeds: list[int] | None = None) -> int:
    """Re-run every marked figure of ``files`` (of the kinds in ``only``; of a quickstart table, the rows of
    ``seeds`` only when given); 0 when all match, 1 otherwise."""
    figures = [f for path in files for f in find_figures(path) if f.kind in only]
    unknown = [f for f in figures if f.kind not in KINDS]
    if unknown:
        raise ValueError(f"{unknown[0].where}: unknown docs-check kind {unknown[0].kind!r}; known: {', '.join(KINDS)}")
    if not figures:
        print(f"docs-check: no marked figure of kinds {', '.join(only)} in {', '.join(map(str, files))}")
        return 2
    failures = 0
    for figure in figures:
        print(f"docs-check: {figure.where}: {figure.kind}: `{figure.command}`", flush=True)
        problems, measured = check_one(figure, files, seeds)
        if problems:
            failures += 1
            print("  MISMATCH:\n    " + "\n    ".join(problems) + ("\n  measured:\n" + measured if measured else ""))
        else:
            print("  ok" + (f", measured:\n{measured}" if figure.kind == "quickstart" else ""))
    print(f"docs-check: {len(figures) - failures} of {len(figures)} figures match")
    return 1 if failures else 0


def check_one(figure: Figure, files: list[Path], seeds: list[int] | None = None) -> tuple[list[str], str]:
    """Re-run one marked figure: ``(problems, what was measured, for pasting)``; no problem when it matches."""
    if figure.kind in FIGURE_KINDS:
        # An example runs in a fresh folder, as a user's first run: what it builds and logs (its default
        # checkpoint and runs/ paths are relative) is neither left in the checkout nor reused from it.
        with tempfile.TemporaryDirectory(prefix="docs_check_") as tmp:
            run = partial(_run, timeout_s=1800, cwd=Path(tmp))
            return check_figure(figure.kind, figure.command, figure.spec, figure.body, run), ""
    if figure.kind == "quickstart":
        return check_quickstart(figure, files, seeds)
    fresh = run_selfcheck(figure.command)
    measured = "\n".join(f"{k}: {v}" for k, v in fresh.items())
    return compare_selfcheck(parse_selfcheck_table(figure.body), fresh), measured


def _readme_problems(files: list[Path], table: RewardTable, runs: dict[int, list[float]]) -> list[str]:
    """README's seeds' mean first / last block and range of gains against the same runs; every seed's gain from the
    table's first block to its last >= MIN_GAIN."""
    problems = []
    for path in files:
        if path.name != "README.md":
            continue
        summary = parse_readme_summary(path.read_text(encoding="utf-8"))
        if summary is None:
            continue
        if sorted(summary.seeds) != sorted(runs):
            problems.append(f"README: averaged over seeds {summary.seeds}, the table has {sorted(runs)}")
            continue
        size = summary.size
        if any(len(rewards) < size for rewards in runs.values()):
            problems.append(f"README: a run has fewer than {size} batches")
            continue
        firsts = [block_mean(rewards, 1, size) for rewards in runs.values()]
        lasts = [block_mean(rewards, len(rewards) - size + 1, len(rewards)) for rewards in runs.values()]
        gains = [b - a for a, b in zip(firsts, lasts, strict=True)]
        for label, value, measured in (
            ("first", summary.first, math.fsum(firsts) / len(firsts)),
            ("last", summary.last, math.fsum(lasts) / len(lasts)),
            ("smallest gain", summary.gain_low, min(gains)),
            ("largest gain", summary.gain_high, max(gains)),
        ):
            if abs(measured - value) > README_TOLERANCE:
                problems.append(
                    f"README {label} ({size} batches): documented {value:.2f}, measured {measured:.3f} "
                    f"(tol {README_TOLERANCE})"
                )
    (first, first_end), (last, last_end) = table.blocks[0], table.blocks[-1]
    for seed, rewards in sorted(runs.items()):
        gain = block_mean(rewards, last, last_end) - block_mean(rewards, first, first_end)
        if gain < MIN_GAIN:
            problems.append(
                f"seed {seed}: train/reward gains {gain:.3f} from batches {first}-{first_end} to {last}-{last_end}, "
                f"under {MIN_GAIN}"
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
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        help="re-run these rows of a quickstart table only (default: every row, and README's seed-range)",
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        parser.error(f"--files: no such file: {', '.join(missing)}")
    return check([p.resolve() for p in args.files], tuple(args.only), args.seeds)


if __name__ == "__main__":
    sys.exit(main())
