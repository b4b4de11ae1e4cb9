"""The figures README.md and docs/ state, re-run on every landing: a change that moves one fails here.

Every ``<!-- docs-check: ... -->`` figure is one test, run as ``make docs-check`` runs it
(tools/docs_check.py), except the quickstart table: its seed-0 row is re-run here, every row and
README's seed-range by ``make docs-check``. A failure prints the measured figures to paste after
re-measuring the docs (``make docs-check``). The long ones are in groups of their own, so that the
two workers of ``make test`` run them side by side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import docs_check  # noqa: E402  (tools/ is not a package)

FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIGURES = [figure for path in FILES for figure in docs_check.find_figures(path)]
#: The quickstart table's row re-run on every landing (the other seeds: `make docs-check`).
LANDING_SEEDS = [0]
#: Figures that re-run a command (the others read a report or a source document).
RERUN_KINDS = ("quickstart", "selfcheck", "output")


def _cases() -> list:
    cases = []
    for figure in FIGURES:
        name = f"{figure.path.name}:{figure.line}:{figure.kind}"
        marks = []
        if figure.kind in RERUN_KINDS:
            marks = [
                pytest.mark.long(f"re-runs the documented `{figure.command}` as `make docs-check` does"),
                pytest.mark.xdist_group(f"docs-figure-{name}"),
            ]
        cases.append(pytest.param(figure, id=name, marks=marks))
    return cases


@pytest.mark.parametrize("figure", _cases())
def test_the_documented_figure_is_what_its_command_gives(figure):
    problems, measured = docs_check.check_one(figure, FILES, LANDING_SEEDS if figure.kind == "quickstart" else None)
    assert not problems, (
        f"{figure.where}: the docs state other figures than `{figure.command}` gives now. If the change meant "
        "to move them, re-measure with `make docs-check` and update the docs.\n  "
        + "\n  ".join(problems)
        + (f"\nmeasured:\n{measured}" if measured else "")
    )


def test_every_figure_kind_of_the_docs_is_re_run_or_read():
    assert {f.kind for f in FIGURES} == set(docs_check.KINDS)
    (quickstart,) = [f for f in FIGURES if f.kind == "quickstart"]
    assert set(LANDING_SEEDS) <= set(docs_check.parse_reward_table(quickstart.body).seeds)
