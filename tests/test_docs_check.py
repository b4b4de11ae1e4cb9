"""tools/docs_check.py: the figures of the docs are parsed, re-run and compared within a tolerance.

The quick part here: parsing the real docs, the comparison logic against hand-made numbers, and
one end-to-end check on a short real fit and a small real selfcheck written into a fixture doc.
The full re-run of the documented figures is ``make docs-check`` (not part of the suite).
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
    blocks = docs_check.parse_reward_table(quick.body)
    assert [(a, b) for a, b, _ in blocks] == [(30 * i + 1, 30 * (i + 1)) for i in range(10)]
    assert all(0 < v < 1 for *_, v in blocks)
    # README's first / last 30 batches are the table's first / last block, rounded.
    size, first, last = docs_check.parse_readme_summary((ROOT / "README.md").read_text())
    assert (size, first, last) == (30, round(blocks[0][2], 2), round(blocks[-1][2], 2))
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
    assert docs_check.reward_table_markdown([(1, 2, 0.0), (3, 4, 0.0)], rewards).splitlines()[2] == (
        "| `train/reward` | 0.200 | 0.600 |"
    )


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
    with pytest.raises(ValueError, match="batches"):
        docs_check.parse_reward_table("| x | 1 |\n")
    with pytest.raises(ValueError, match="batch range"):
        docs_check.parse_reward_table("| batches | first |\n|---|---|\n| `train/reward` | 0.4 |\n")
    with pytest.raises(ValueError, match="preset"):
        docs_check.parse_selfcheck_table("no table here")
    with pytest.raises(ValueError, match="no rows"):
        docs_check.parse_selfcheck_table("preset kl ms\n-------\nnot numbers\n")
    # The selfcheck's own output: the table ends where the numbers end (the next line names the logdir).
    printed = "tiny\npreset kl ms\n----\na 1e-2 3.0\nb 0.5 4.0\nTensorBoard events: runs/x  (tensorboard --logdir x)\n"
    assert docs_check.parse_selfcheck_table(printed) == {"a": {"kl": 0.01, "ms": 3.0}, "b": {"kl": 0.5, "ms": 4.0}}
    with pytest.raises(ValueError, match="lightning-offpolicy"):
        docs_check.command_argv("python train.py")


@pytest.mark.slow
@pytest.mark.long(
    "docs_check re-runs a documented fit and selfcheck and compares their tables: the re-run is the feature"
)
def test_check_end_to_end_on_a_short_fit_and_a_small_selfcheck(tmp_path, capsys):
    fit = (
        "lightning-offpolicy fit --config configs/quickstart.yaml --trainer.max_steps=8 "
        "--data.init_args.prompts_per_step=4 --rollout.sampling.samples_per_prompt=4"
    )
    selfcheck = "lightning-offpolicy selfcheck --batch 8 --new-tokens 8 --logdir ''"
    rewards = docs_check.run_quickstart(fit)
    assert len(rewards) == 4  # 8 optimizer steps, 2 per batch
    table = docs_check.reward_table_markdown([(1, 2, 0.0), (3, 4, 0.0)], rewards)
    printed = docs_check._run(docs_check.command_argv(selfcheck), 600)
    doc = tmp_path / "doc.md"

    def write(reward_table: str, selfcheck_output: str) -> None:
        doc.write_text(
            f"Text.\n\n<!-- docs-check: quickstart `{fit}` -->\n{reward_table}\n\nMore text.\n\n"
            f"<!-- docs-check: selfcheck `{selfcheck}` -->\n```text\n{selfcheck_output}```\n"
        )

    write(table, printed)  # the commands' own output: a second run reproduces it
    assert docs_check.main(["--files", str(doc)]) == 0
    wrong_reward = table.replace(f"{docs_check.block_mean(rewards, 3, 4):.3f}", "0.999")
    wrong_loss = printed.replace("cispo", "cispo_renamed")
    write(wrong_reward, wrong_loss)
    assert docs_check.main(["--files", str(doc)]) == 1
    out = capsys.readouterr().out
    assert "batches 3-4: documented 0.999" in out and "cispo_renamed: documented" in out
    assert docs_check.main(["--files", str(doc), "--only", "selfcheck"]) == 1
    doc.write_text("no figures\n")
    assert docs_check.main(["--files", str(doc)]) == 2


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
