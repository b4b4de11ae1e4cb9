"""studies/prox_loglinear.py and the study's ``-loglinear`` corrections: the conditions it builds, a quick run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "studies"))
import mismatch_study  # noqa: E402  (studies/ is not a package)
import prox_loglinear  # noqa: E402


def test_every_correction_with_a_pi_prox_has_a_loglinear_variant_and_bypass_has_none():
    args = argparse.Namespace(geo_low=0.9, geo_high=1.1)
    known = mismatch_study.corrections(args)
    assert {"tis-loglinear", "decoupled-loglinear", "geo-loglinear", "cispo-loglinear", "rkl-loglinear"} <= set(known)
    assert "bypass-loglinear" not in known and "bypass-geo-loglinear" not in known
    study_args = mismatch_study.parse_args(
        ["--output-dir", "x", "--staleness", "4", "--corrections", "tis", "tis-loglinear"]
    )
    conditions = {c.short: c for c in mismatch_study.build_conditions(study_args, "reverse")}
    assert conditions["stale4-tis"].prox_method == "recompute"
    assert conditions["stale4-tis-loglinear"].prox_method == "loglinear"
    assert conditions["stale4-tis-loglinear"].preset == conditions["stale4-tis"].preset == "token_tis"
    assert conditions["stale4-tis-loglinear"].correction == "tis-loglinear"


@pytest.mark.study("studies/prox_loglinear.py --quick")
def test_quick_run_reports_both_methods_and_the_forward_it_saves(tmp_path):
    output = tmp_path / "report.md"
    assert prox_loglinear.main(["--quick", "--tasks", "reverse", "--workers", "1", "--output", str(output)]) == 0
    payload = json.loads(output.with_suffix(".json").read_text())
    step = payload["step_time"]["reverse"]
    # Two optimizer steps per batch: recompute adds the forward without gradient to the two with it.
    assert step["forwards_per_batch"] == {"recompute": 3, "loglinear": 2}
    assert all(seconds > 0 for pieces in step["seconds"].values() for seconds in pieces["step_s"])
    median = step["median_s"]
    # What loglinear saves (the proximal forward: none of it left) and what it adds (the correction per micro-batch).
    assert median["recompute"]["prox_forward_s"] > 0 and median["loglinear"]["prox_forward_s"] == 0
    assert median["recompute"]["correction_s"] > 0 and median["loglinear"]["correction_s"] > 0
    training = payload["training"]["reverse"]
    assert [len(training[m]["runs"]) for m in ("recompute", "loglinear", "bypass (reference)")] == [1, 1, 1]
    for method in training:
        series = training[method]["runs"][0]["series"]
        assert set(series) == set(prox_loglinear.KEPT_SERIES)
        assert min(series["staleness/mean"][-2:]) > 0  # asynchronous: the tokens are stale
    text = output.read_text()
    for method in ("recompute", "loglinear", "bypass (reference)"):
        assert f"| `reverse` | {method} |" in text
    assert "| 3 / 2 |" in text
