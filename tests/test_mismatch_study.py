"""Smoke test of studies/mismatch_study.py: ``--quick`` runs, and its three outputs agree.

Not a check of the study's conclusions (6 tiny batches say nothing about stability): only that the
JSON has every run's series and the calibration, the PNGs are PNGs, the markdown tables list the
conditions of both tasks, and the tables' numbers are the ones the JSON series give; plus the
learning-rate rule, the paired confidence interval and VersionKL against independent references.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parent.parent / "studies" / "mismatch_study.py"
QUICK = ("onpolicy", "stale4-bypass", "stale4-tis")
TASKS = ("reverse", "letter")
QUICK_NAMES = [f"{task}/{short}" for task in TASKS for short in QUICK]


def _load_study():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mismatch_study", STUDY)
    study = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(STUDY.parent))  # as when run as a script (it adds benchmarks/ itself)
    # Its dataclasses look their module up; the module another test file imported stays registered
    # afterwards (popping it made a later pickle of that module's functions fail).
    previous = sys.modules.get("mismatch_study")
    sys.modules["mismatch_study"] = study
    try:
        spec.loader.exec_module(study)
    finally:
        sys.path.remove(str(STUDY.parent))
        if previous is None:
            sys.modules.pop("mismatch_study", None)
        else:
            sys.modules["mismatch_study"] = previous
    return study


def _tables(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """Each task's results table (under its ``### `task``` heading), rows keyed by condition."""
    lines = text.splitlines()
    tables = {}
    for i, line in enumerate(lines):
        if line.startswith("### `"):
            tables[line.strip("#` ")] = _table(lines[i + 1 :])
    return tables


def _table(lines: list[str]) -> dict[str, dict[str, str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("| condition |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header), line
        rows[cells[0].strip("`")] = dict(zip(header, cells, strict=True))
    return rows


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("study") / "results"
    proc = subprocess.run(
        [sys.executable, str(STUDY), "--quick", "--workers", "1", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


@pytest.mark.study("studies/mismatch_study.py --quick")
def test_json_has_every_run_with_one_value_per_batch(quick_study):
    out, _ = quick_study
    data = json.loads((out / "mismatch_study.json").read_text())
    assert {"meta", "conditions", "summary", "runs"} <= set(data)
    assert [c["name"] for c in data["conditions"]] == QUICK_NAMES
    assert data["meta"]["wall_s"] > 0 and "collapse_definition" in data["meta"]
    assert len(data["runs"]) == len(QUICK_NAMES) * len(data["meta"]["settings"]["seeds"])
    for run in data["runs"]:
        task = run["condition"].split("/")[0]
        batches = data["meta"]["settings"]["tasks"][task]["batches"]
        assert run["batches"] == batches
        assert run["lr"] == data["meta"]["settings"]["tasks"][task]["lr"]
        series = run["series"]
        keys = ("train/reward", "train/entropy", "staleness/mean", "rollout_corr/kl", "rollout_corr/chi2_token")
        for key in (*keys, "policy/version_kl"):
            assert len(series[key]) == batches, (run["condition"], key)
            assert all(isinstance(v, float) and math.isfinite(v) for v in series[key]), (run["condition"], key)
        assert all(0.0 <= r <= 1.0 for r in series["train/reward"])
        assert all(v > 0 for v in series["policy/version_kl"])  # every optimizer step moves the policy


def test_version_kl_is_the_exact_kl_between_consecutive_versions():
    """VersionKL against torch's own kl_div on the same probe, hooks driven by hand (two steps, one batch)."""
    from types import SimpleNamespace

    import torch

    from lightning_offpolicy.batch import RolloutBatch
    from tests.module_helpers import tiny_model

    study = _load_study()
    policy = tiny_model()
    rollout = RolloutBatch.from_sequences(
        prompt_ids=[[1, 5, 6], [1, 9]],
        response_ids=[[7, 8, 2], [4]],
        rewards=[0.0, 1.0],
        advantages=torch.zeros(2),
        group_ids=[0, 0],
        policy_versions=[0, 0],
        rollout_logprobs=None,
        pad_token_id=0,
    )
    module = SimpleNamespace(policy=policy, policy_version=0)
    callback = study.VersionKL()

    def distributions():
        # The 4 response tokens, each predicted from the position before it (prompt is left-padded to 3).
        with torch.no_grad():
            logits = policy(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits.double()
        return torch.stack([logits[0, 2], logits[0, 3], logits[0, 4], logits[1, 2]]).log_softmax(-1)

    def step():
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.02 * torch.randn_like(p))
        module.policy_version += 1

    torch.manual_seed(0)
    callback.on_train_batch_start(None, module, SimpleNamespace(rollout=rollout), 0)
    before = distributions()
    callback.on_before_optimizer_step(None, module, None)  # version 0 again: nothing new
    step()
    middle = distributions()
    callback.on_before_optimizer_step(None, module, None)
    step()
    after = distributions()
    callback.on_train_batch_end(None, module, None, None, 0)
    kl = torch.nn.functional.kl_div
    expected = [
        float(kl(middle, before, log_target=True, reduction="sum")) / 4,
        float(kl(after, middle, log_target=True, reduction="sum")) / 4,
    ]
    assert callback.per_batch == pytest.approx([sum(expected) / 2], rel=1e-9)
    assert expected[0] > 1e-6


@pytest.mark.study("studies/mismatch_study.py --quick")
def test_staleness_is_zero_synchronous_and_bounded_asynchronous(quick_study):
    out, _ = quick_study
    data = json.loads((out / "mismatch_study.json").read_text())
    bound = {c["name"]: c["max_staleness"] for c in data["conditions"]}
    for run in data["runs"]:
        staleness = run["series"]["staleness/mean"]
        if bound[run["condition"]] == 0:
            assert all(s == 0 for s in staleness), run["condition"]
        else:
            assert statistics.fmean(staleness) > 0, run["condition"]
            assert all(0 <= s <= bound[run["condition"]] for s in staleness), run["condition"]
            if run["condition"].startswith("reverse/"):
                # A batch behind at least (2 optimizer steps per batch): the next batch is generated while
                # this one trains. How far ahead the producer gets beyond that, up to the bound, depends on
                # how fast generation runs beside training on the machine's cores at that moment.
                assert max(run["series"]["staleness/max"]) >= 2, run["condition"]
    # The stale engine really differs from the trainer: the mismatch KL is far above the synchronous one.
    kl = {run["condition"]: statistics.fmean(run["series"]["rollout_corr/kl"]) for run in data["runs"]}
    for task in TASKS:
        stale, onpolicy = kl[f"{task}/stale4-tis"], kl[f"{task}/onpolicy"]
        assert stale > 100 * abs(onpolicy) and stale > 1e-3, kl
        # Bypass mode has no pi_prox: the metrics compare pi_theta with the stale pi_rollout.
        assert kl[f"{task}/stale4-bypass"] > 100 * abs(onpolicy) and kl[f"{task}/stale4-bypass"] > 1e-3, kl


@pytest.mark.parametrize("name", ["mismatch_study.png", "mismatch_curves.png"])
@pytest.mark.study("studies/mismatch_study.py --quick")
def test_pngs_are_pngs(quick_study, name):
    out, _ = quick_study
    png = (out / name).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 500 and height > 300


@pytest.mark.study("studies/mismatch_study.py --quick")
def test_calibration_measures_every_rate_and_uses_the_rule(quick_study):
    out, _ = quick_study
    study = _load_study()
    data = json.loads((out / "mismatch_study.json").read_text())
    for task in TASKS:
        cal = data["meta"]["calibration"][task]
        assert cal["lrs"] == [1e-3, 3e-4] and len(cal["version_kl"]) == 2
        # A larger step moves the policy further: the measured KL per version grows with the rate.
        assert cal["version_kl"][0] > cal["version_kl"][1] > 0, cal
        assert cal["chosen"] == study.choose_lr(cal["lrs"], cal["version_kl"])
        assert data["meta"]["settings"]["tasks"][task]["lr"] == cal["chosen"]
    assert "## Calibration" in out.with_suffix(".md").read_text()


def test_choose_lr_takes_the_largest_rate_under_the_band_top_else_the_nearest():
    study = _load_study()
    assert study.KL_BAND == (1e-3, 1e-2)
    assert study.choose_lr([1e-3, 5e-4, 2.5e-4], [2.6e-2, 6e-3, 1.6e-3]) == 5e-4
    assert study.choose_lr([1e-3, 5e-4], [1e-2, 2e-3]) == 1e-3  # the top is inclusive
    assert study.choose_lr([1e-3, 5e-4], [5e-2, 3e-2]) == 5e-4  # none within: the nearest (0.48 decade)
    assert study.choose_lr([1e-4, 5e-5], [2e-4, 5e-5]) == 1e-4  # all below: the nearest from below


def test_paired_delta_is_the_mean_difference_with_a_student_t_interval():
    study = _load_study()

    def run(seed, auc):
        return {"seed": seed, "summary": {"auc_reward": auc}}

    baseline = [run(0, 0.50), run(1, 0.40), run(2, 0.45), run(3, 0.9)]  # seed 3 has no pair: ignored
    runs = [run(2, 0.475), run(0, 0.52), run(1, 0.43)]
    mean, half, n = study.paired_delta(runs, baseline, "auc_reward")
    # By hand, paired by seed: deltas 0.02, 0.03, 0.025; sd 0.005; t(0.975, df=2) = 4.302653.
    assert n == 3 and mean == pytest.approx(0.025)
    assert half == pytest.approx(4.302653 * 0.005 / 3**0.5, rel=1e-4)
    assert study.fmt_delta(mean, half) == "**+0.025 [+0.013, +0.037]**"  # excludes 0: bold
    assert study.fmt_delta(0.01, 0.02) == "+0.010 [-0.010, +0.030]"


@pytest.mark.study("studies/mismatch_study.py --quick")
def test_markdown_table_matches_the_json(quick_study):
    out, proc = quick_study
    report = out.with_suffix(".md")  # the default: docs/reports/results -> docs/reports/results.md
    text = report.read_text()
    for needed in ("**Machine**", "nproc=", "**Date**", "**Code**", "**Command**", "**Wall time", "## Method"):
        assert needed in text, needed
    assert "results/mismatch_study.png" in text  # the plots, linked relative to the report
    assert "results/mismatch_curves.png" in text
    tables = _tables(text)
    assert list(tables) == list(TASKS)
    data = json.loads((out / "mismatch_study.json").read_text())
    rows = {f"{task}/{short}": row for task, table in tables.items() for short, row in table.items()}
    assert list(rows) == QUICK_NAMES
    for name, row in rows.items():
        runs = [run for run in data["runs"] if run["condition"] == name]
        auc = statistics.fmean(statistics.fmean(run["series"]["train/reward"]) for run in runs)
        assert float(row["AUC reward"].split(" ± ")[0]) == pytest.approx(auc, abs=6e-4), name
        window = max(1, round(len(runs[0]["series"]["train/reward"]) / 10))  # the last 10% of the batches
        final = statistics.fmean(statistics.fmean(run["series"]["train/reward"][-window:]) for run in runs)
        assert float(row["final reward"].split(" ± ")[0]) == pytest.approx(final, abs=6e-4), name
        staleness = statistics.fmean(statistics.fmean(run["series"]["staleness/mean"]) for run in runs)
        assert float(row["staleness/mean"]) == pytest.approx(staleness, abs=6e-3), name
        assert row["collapsed (batch)"].startswith("0/") or row["collapsed (batch)"].split("/")[0].isdigit()
    assert "| condition |" in proc.stdout  # the report also goes to stdout


@pytest.mark.study("studies/mismatch_study.py --quick")
def test_render_only_rebuilds_the_same_table_from_the_json_and_appends_the_reading(quick_study, tmp_path):
    out, _ = quick_study
    report = out.with_suffix(".md")
    # Strict JSON: no NaN / Infinity tokens (non-finite values are stored as null).
    json.loads((out / "mismatch_study.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    reading = tmp_path / "reading.md"
    reading.write_text("Token TIS did what it says.\n")
    rebuilt = tmp_path / "rebuilt.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(STUDY),
            "--render-only",
            "--output-dir",
            str(out),
            "--report",
            str(rebuilt),
            "--reading",
            str(reading),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = rebuilt.read_text()
    assert _tables(text) == _tables(report.read_text())
    assert "## Reading\n\nToken TIS did what it says." in text
