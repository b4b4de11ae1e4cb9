"""Smoke test of benchmarks/mismatch_study.py: ``--quick`` runs, and its three outputs agree.

Not a check of the study's conclusions (6 tiny batches say nothing about stability): only that the
JSON has every run's series, the PNG is a PNG, the markdown table lists the conditions, and the
table's numbers are the ones the JSON series give.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parent.parent / "benchmarks" / "mismatch_study.py"
QUICK = ("onpolicy", "stale4-bypass", "stale4-tis")


def _table(text: str) -> dict[str, dict[str, str]]:
    lines = text.splitlines()
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


def test_json_has_every_run_with_one_value_per_batch(quick_study):
    out, _ = quick_study
    data = json.loads((out / "mismatch_study.json").read_text())
    assert {"meta", "conditions", "summary", "runs"} <= set(data)
    assert [c["name"] for c in data["conditions"]] == list(QUICK)
    assert data["meta"]["wall_s"] > 0 and "collapse_definition" in data["meta"]
    batches = data["meta"]["settings"]["batches"]
    assert len(data["runs"]) == len(QUICK) * len(data["meta"]["settings"]["seeds"])
    for run in data["runs"]:
        assert run["batches"] == batches
        series = run["series"]
        keys = ("train/reward", "train/entropy", "staleness/mean", "rollout_corr/kl", "rollout_corr/chi2_token")
        for key in (*keys, "policy/version_kl"):
            assert len(series[key]) == batches, (run["condition"], key)
            assert all(isinstance(v, float) and math.isfinite(v) for v in series[key]), (run["condition"], key)
        assert all(0.0 <= r <= 1.0 for r in series["train/reward"])
        assert all(v > 0 for v in series["policy/version_kl"])  # every optimizer step moves the policy


def test_version_kl_is_the_exact_kl_between_consecutive_versions():
    """VersionKL against torch's own kl_div on the same probe, hooks driven by hand (two steps, one batch)."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    from lightning_offpolicy.batch import RolloutBatch
    from tests.module_helpers import tiny_model

    spec = importlib.util.spec_from_file_location("mismatch_study", STUDY)
    study = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(STUDY.parent))  # the script imports its sibling _report
    sys.modules["mismatch_study"] = study  # its dataclasses look their module up
    try:
        spec.loader.exec_module(study)
    finally:
        sys.path.remove(str(STUDY.parent))
        sys.modules.pop("mismatch_study", None)
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
            assert max(run["series"]["staleness/max"]) == bound[run["condition"]]  # the bound is reached
    # The stale engine really differs from the trainer: the mismatch KL is far above the synchronous one.
    kl = {run["condition"]: statistics.fmean(run["series"]["rollout_corr/kl"]) for run in data["runs"]}
    assert kl["stale4-tis"] > 100 * abs(kl["onpolicy"]) and kl["stale4-tis"] > 1e-3, kl
    # Bypass mode: pi_prox := pi_rollout, so the mismatch metrics read 0 by construction.
    assert kl["stale4-bypass"] == 0.0


def test_png_is_a_png(quick_study):
    out, _ = quick_study
    png = (out / "mismatch_study.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 500 and height > 300


def test_markdown_table_matches_the_json(quick_study):
    out, proc = quick_study
    report = out.with_suffix(".md")  # the default: docs/results -> docs/results.md
    text = report.read_text()
    for needed in ("**Machine**", "nproc=", "**Date**", "**Code**", "**Command**", "**Wall time", "## Method"):
        assert needed in text, needed
    assert "results/mismatch_study.png" in text  # the plot, linked relative to the report
    rows = _table(text)
    assert list(rows) == list(QUICK)
    data = json.loads((out / "mismatch_study.json").read_text())
    for name, row in rows.items():
        runs = [run for run in data["runs"] if run["condition"] == name]
        auc = statistics.fmean(statistics.fmean(run["series"]["train/reward"]) for run in runs)
        assert float(row["AUC reward"].split(" ± ")[0]) == pytest.approx(auc, abs=6e-4), name
        window = data["meta"]["final_window"]
        final = statistics.fmean(statistics.fmean(run["series"]["train/reward"][-window:]) for run in runs)
        assert float(row["final reward"].split(" ± ")[0]) == pytest.approx(final, abs=6e-4), name
        staleness = statistics.fmean(statistics.fmean(run["series"]["staleness/mean"]) for run in runs)
        assert float(row["staleness/mean"]) == pytest.approx(staleness, abs=6e-3), name
        assert row["collapsed (batch)"].startswith("0/") or row["collapsed (batch)"].split("/")[0].isdigit()
    assert "| condition |" in proc.stdout  # the report also goes to stdout


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
    assert _table(text) == _table(report.read_text())
    assert "## Reading\n\nToken TIS did what it says." in text
