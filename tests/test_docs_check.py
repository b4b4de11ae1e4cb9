"""tools/docs_check.py: the figures of the docs are parsed, re-run and compared within a tolerance.

The quick part here: parsing the real docs and the comparison logic against hand-made numbers (a
mismatch of each kind is found and named). The documented figures themselves are re-run by
tests/test_docs_figures.py (the quickstart's seed-0 row) and ``make docs-check`` (every row).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_offpolicy.correction import PRESETS
from lightning_offpolicy.demo.selfcheck import LOSS_CHECKS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import docs_check  # noqa: E402  (tools/ is not a package)


def _figures(kind: str) -> list[docs_check.Figure]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [f for path in files for f in docs_check.find_figures(path) if f.kind == kind]


def test_the_docs_mark_the_quickstart_and_selfcheck_figures():
    (quick,) = _figures("quickstart")
    assert quick.command == "lightning-offpolicy fit --config configs/quickstart.yaml"
    table = docs_check.parse_reward_table(quick.body)
    assert table.blocks == [(30 * i + 1, 30 * (i + 1)) for i in range(10)]
    assert sorted(table.seeds) == [0, 1, 2, 3, 4] and table.mean is not None
    assert all(0 < v < 1 for row in table.seeds.values() for v in row)
    for column, mean in enumerate(table.mean):  # the mean row is the seeds' mean, to the printed digits
        assert mean == pytest.approx(sum(row[column] for row in table.seeds.values()) / 5, abs=1e-3)
    # README's sentence: the mean row's first / last block, the range of the seeds' gains, rounded.
    summary = docs_check.parse_readme_summary((ROOT / "README.md").read_text())
    assert (summary.size, summary.seeds) == (30, sorted(table.seeds))
    assert (summary.first, summary.last) == (round(table.mean[0], 2), round(table.mean[-1], 2))
    gains = [row[-1] - row[0] for row in table.seeds.values()]
    assert summary.gain_low == pytest.approx(min(gains), abs=0.006)
    assert summary.gain_high == pytest.approx(max(gains), abs=0.006)
    assert min(gains) >= docs_check.MIN_GAIN  # the demo learns on every documented seed
    (selfcheck,) = _figures("selfcheck")
    assert selfcheck.command.startswith("lightning-offpolicy selfcheck")
    table = docs_check.parse_selfcheck_table(selfcheck.body)
    assert list(table) == list(PRESETS) + list(LOSS_CHECKS)
    assert set(table["token_tis"]) == {"kl", "chi2_tok", "ess", "w_mean", "reject", "loss", "grad", "ms"}


def test_compare_blocks_by_hand():
    rewards = [0.1, 0.3, 0.5, 0.7]  # block means: 0.2 and 0.6
    assert docs_check.compare_blocks([(1, 2, 0.2), (3, 4, 0.6)], rewards) == []
    assert docs_check.compare_blocks([(1, 2, 0.215), (3, 4, 0.59)], rewards, tolerance=0.02) == []
    (problem,) = docs_check.compare_blocks([(1, 2, 0.2), (3, 4, 0.63)], rewards, tolerance=0.02)
    assert "batches 3-4" in problem and "0.630" in problem and "0.600" in problem
    (short,) = docs_check.compare_blocks([(1, 2, 0.2), (3, 6, 0.6)], rewards)
    assert "only 4 batches" in short


def test_quickstart_rows_mean_and_readme_by_hand(tmp_path):
    doc = (
        "| `--seed_everything` | 1-2 | 3-4 |\n|---|---|---|\n| 0 | 0.200 | 0.600 |\n| 1 | 0.400 | 0.600 |\n"
        "| mean | 0.300 | 0.600 |\n\nAfter the table."
    )
    table = docs_check.parse_reward_table(doc)
    assert table.blocks == [(1, 2), (3, 4)] and table.seeds == {0: [0.2, 0.6], 1: [0.4, 0.6]}
    assert table.mean == [0.3, 0.6]
    runs = {0: [0.1, 0.3, 0.5, 0.7], 1: [0.4, 0.4, 0.6, 0.6]}  # block means (0.2, 0.6) and (0.4, 0.6)
    assert docs_check.compare_quickstart(table, runs) == []
    assert docs_check.compare_quickstart(table, {0: runs[0]}) == []  # one row re-run: the mean is not compared
    moved, mean = docs_check.compare_quickstart(table, {**runs, 1: [0.4, 0.4, 0.7, 0.7]})  # seed 1's last: 0.7
    assert moved.startswith("seed 1: batches 3-4: documented 0.600, measured 0.700")
    assert mean.startswith("mean, batches 3-4: documented 0.600, measured 0.650")
    assert docs_check.reward_table_markdown(table, runs).splitlines()[2:] == [
        "| 0 | 0.200 | 0.600 |",
        "| 1 | 0.400 | 0.600 |",
        "| mean | 0.300 | 0.600 |",
    ]
    # README: the seeds' mean first / last block and the range of their gains (0.2 and 0.4), and every seed
    # gains at least MIN_GAIN.
    readme = tmp_path / "README.md"
    readme.write_text(
        "rises from **0.30** (first 2 batches) to **0.60** (last 2), averaged over `--seed_everything` 0\nto 1; "
        "every one of those seeds gains between **0.20** and **0.40** in the demo."
    )
    assert docs_check._readme_problems([readme], table, runs) == []
    readme.write_text(readme.read_text().replace("**0.40**", "**0.50**").replace("0\nto 1", "0 to 2"))
    (seeds,) = docs_check._readme_problems([readme], table, runs)
    assert seeds == "README: averaged over seeds [0, 1, 2], the table has [0, 1]"
    readme.write_text(readme.read_text().replace("0 to 2", "0 to 1"))
    (gain,) = docs_check._readme_problems([readme], table, runs)
    assert gain.startswith("README largest gain (2 batches): documented 0.50, measured 0.400")
    (flat,) = docs_check._readme_problems([], table, {0: runs[0], 1: [0.45, 0.45, 0.5, 0.5]})
    assert flat == "seed 1: train/reward gains 0.050 from batches 1-2 to 3-4, under 0.1"


def test_compare_selfcheck_by_hand():
    doc = {"a": {"kl": 0.04, "loss": -0.06, "ms": 900.0}, "b": {"kl": 0.0, "loss": 0.1, "ms": 1.0}}
    close = {"a": {"kl": 0.0405, "loss": -0.0601, "ms": 5.0}, "b": {"kl": 0.001, "loss": 0.1, "ms": 7.0}}
    assert docs_check.compare_selfcheck(doc, close) == []  # within 2% or 2e-3; timings ignored
    far = {"a": {"kl": 0.05, "loss": -0.06, "ms": 900.0}, "c": {"kl": 0.0, "loss": 0.1, "ms": 1.0}}
    problems = docs_check.compare_selfcheck(doc, far)
    assert any(p.startswith("a.kl: documented 0.04, measured 0.05") for p in problems)
    assert any(p.startswith("b: documented") for p in problems)
    assert any(p.startswith("c: printed") for p in problems)


def test_parse_errors_name_what_is_expected():
    with pytest.raises(ValueError, match="seed_everything"):
        docs_check.parse_reward_table("| x | 1 |\n")
    with pytest.raises(ValueError, match="batch range"):
        docs_check.parse_reward_table("| `--seed_everything` | first |\n|---|---|\n| 0 | 0.4 |\n")
    with pytest.raises(ValueError, match="a seed or `mean`"):
        docs_check.parse_reward_table("| `--seed_everything` | 1-2 |\n|---|---|\n| `train/reward` | 0.4 |\n")
    with pytest.raises(ValueError, match="a number per block"):
        docs_check.parse_reward_table("| `--seed_everything` | 1-2 | 3-4 |\n|---|---|---|\n| 0 | 0.4 |\n")
    with pytest.raises(ValueError, match="preset"):
        docs_check.parse_selfcheck_table("no table here")
    with pytest.raises(ValueError, match="no rows"):
        docs_check.parse_selfcheck_table("preset kl ms\n-------\nnot numbers\n")
    # The selfcheck's own output: the table ends where the numbers end (the next line names the logdir).
    printed = "tiny\npreset kl ms\n----\na 1e-2 3.0\nb 0.5 4.0\nTensorBoard events: runs/x  (tensorboard --logdir x)\n"
    assert docs_check.parse_selfcheck_table(printed) == {"a": {"kl": 0.01, "ms": 3.0}, "b": {"kl": 0.5, "ms": 4.0}}
    with pytest.raises(ValueError, match="lightning-offpolicy"):
        docs_check.command_argv("python train.py")


# ------------------------------------------------------------------------------ single figures
def test_single_figure_checks_by_hand(tmp_path):
    import docs_check_figures as figures

    assert figures.rounding("0.668") == pytest.approx(5e-4)
    assert figures.rounding("20.6") == pytest.approx(0.05)
    assert figures.rounding("3e-4") == pytest.approx(5e-5)
    body = "\nthe reward rose from 0.22 (first\n10 batches) to 0.44.\n\nA later 0.99 is not in the paragraph."
    assert figures.missing_from_text(["0.22", "0.44", "10"], body) == []
    (missing,) = figures.missing_from_text(["0.22", "0.99"], body)
    assert missing.startswith("0.99:")

    spec = "reward, first {10} batches {0.22} -> last {10} {0.44}"
    printed = "setup\nreward, first 10 batches 0.230 -> last 10 0.461\n"
    assert figures.compare_output(spec, printed) == []  # within 0.02 + the stated rounding (0.005)
    (far,) = figures.compare_output(spec, printed.replace("0.461", "0.500"))
    assert "stated 0.44, printed 0.500" in far
    assert figures.compare_output(spec, "nothing printed") == [f"no printed line matches {spec!r}"]
    with pytest.raises(ValueError, match="holes"):
        figures.output_template("no holes")

    report = {"parts": {"lora": {"peak_allocated_bytes": 20.553 * 2**30}}, "rows": [{"x": 0.126}]}
    assert figures.compare_report("20.6=parts.lora.peak_allocated_bytes:GiB 0.13=rows.0.x", report) == []
    (wrong,) = figures.compare_report("20.4=parts.lora.peak_allocated_bytes:GiB", report)
    assert wrong == "parts.lora.peak_allocated_bytes: stated 20.4, the report has 20.553"
    assert figures.compare_report("1=rows.3.x", report) == ["rows.3.x: not a number in the report"]
    with pytest.raises(ValueError, match="unknown unit"):
        figures.report_spec("1=a:KiB")
    with pytest.raises(ValueError, match="number=path"):
        figures.report_spec("a=b")

    assert figures.compare_quote("0.44 0.65", "from **0.44** to **0.65**; 0.655") == []
    assert figures.compare_quote("0.08", "stayed at 0.080") == ["0.08: not in the source"]

    assert figures.example_argv("python examples/sft_then_rl.py --steps 2")[1:] == [
        str(ROOT / "examples" / "sft_then_rl.py"),
        "--steps",
        "2",
    ]
    with pytest.raises(ValueError, match="examples"):
        figures.example_argv("python train.py")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- docs-check: quote `README.md` 0.123456789 -->\nA figure: 0.123456789.\n\n"
        "<!-- docs-check: report `docs/reports/performance_gpu.json` 1.5=parts.lora.peak_allocated_bytes:GiB -->\n"
        "Peak 1.5 GiB.\n"
    )
    assert docs_check.main(["--files", str(doc), "--only", "quote", "report"]) == 1


def test_the_docs_mark_their_single_figures_where_the_text_states_them():
    import docs_check_figures as figures

    marked = [f for kind in docs_check.FIGURE_KINDS for f in _figures(kind)]
    assert {f.kind for f in marked} == set(docs_check.FIGURE_KINDS)
    assert {f.path.name for f in marked} == {"README.md", "journeys.md"}
    for figure in marked:
        assert figures.missing_from_text(figures.stated_figures(figure.kind, figure.spec), figure.body) == []
        if figure.kind == "output":
            assert Path(figures.example_argv(figure.command)[1]).is_file()
        else:
            assert (ROOT / figure.command).is_file()
