"""Smoke test of benchmarks/correction_bench.py: it runs, and its report has the expected shape.

Not a timed test: only that every preset gets one row with positive, finite numbers.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_offpolicy.correction import PRESETS

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "correction_bench.py"


def _first_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| preset |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return header, rows


@pytest.mark.bench("benchmarks/correction_bench.py --quick")
def test_correction_bench_quick(tmp_path):
    out = tmp_path / "perf.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for needed in ("nproc=", "torch ", "threads=", "**Date**", "**Command**", "## Method"):
        assert needed in text
    assert "Non-finite results" not in text, text

    header, rows = _first_table(text)
    names = [row[0] for row in rows]
    assert sorted(names) == sorted(PRESETS), names
    assert len(names) == len(set(names))

    def column(name: str) -> int:
        return next(i for i, h in enumerate(header) if h.startswith(name))

    numeric = ["step ms", "x bound (hot)", "bound ms", "distinct MiB", "peak extra MiB"]
    for row in rows:
        assert len(row) == len(header), row
        for name in numeric:
            value = float(row[column(name)].split()[0])
            assert math.isfinite(value) and value > 0, (row[0], name, value)
    # The table also goes to stdout.
    assert "| preset |" in proc.stdout

    # The fused step (--quick: two presets), against one memory-bound pass and its eager twin.
    fused_text = text[text.index("### Fused step") :]
    header, rows = _first_table(fused_text)
    assert [row[0] for row in rows] == ["token_tis", "geo_mis_seq_tis"]
    for row in rows:
        for name in ("fused step ms", "eager / fused", "x one pass (hot)", "peak extra MiB"):
            value = float(row[column(name)].split()[0])
            assert math.isfinite(value) and value > 0, (row[0], name, value)
    assert "against the goal <= 3x" in fused_text and "the compiled graph was not used" not in text
    import json

    size = json.loads(out.with_suffix(".json").read_text())["sizes"][0]
    assert [r["preset"] for r in size["fused_rows"]] == ["token_tis", "geo_mis_seq_tis"]
    assert size["exp_over_add"] > 0


ASYNC_BENCH = BENCH.parent / "async_overlap.py"


@pytest.mark.bench("benchmarks/async_overlap.py --quick")
def test_async_overlap_bench_quick(tmp_path):
    out = tmp_path / "async.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ASYNC_BENCH),
            "--quick",
            "--engines",
            "hf",
            "--partial",
            "--no-stop",
            "--max-new-tokens",
            "24",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    (row,) = json.loads(out.with_suffix(".json").read_text())
    assert row["engine"] == "hf" and row["batches_counted"] == 4
    for key in ("sync_step_s", "async_step_s", "generation_s", "training_s", "async_wait_s"):
        assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
    # The components add up: ideal = max(generation, training), and sync = generation + training.
    assert row["ideal_step_s"] == max(row["generation_s"], row["training_s"])
    assert math.isclose(row["generation_s"] + row["training_s"], row["sync_step_s"], rel_tol=1e-9)
    assert "| hf |" in out.read_text()
    # The partial-rollout run: its step, push and interrupted fraction, against the plain async run.
    partial = row["partial"]
    assert 0 <= partial["interrupted_frac"] <= 1 and partial["push_and_wait_s"] >= 0
    assert math.isclose(partial["speedup_over_async"], row["async_step_s"] / partial["step_s"], rel_tol=1e-9)
    assert "## Partial rollouts" in out.read_text() and "exactly 24 new tokens" in out.read_text()


# ------------------------------------------------------------------ end_to_end, trainer_memory, summarize
# Smoke runs, not timed: the JSON schema, and that the figures agree with each other. Both
# benchmarks run once per session into one folder, named as `make bench` names them, so the
# summary test reads exactly what the two others checked.
END_TO_END = BENCH.parent / "end_to_end.py"
TRAINER_MEMORY = BENCH.parent / "trainer_memory.py"
SUMMARIZE = BENCH.parents[1] / "tools" / "summarize.py"
_QUICK_DOCS: dict[str, Path] = {}


def _run_script(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _quick_docs(tmp_path_factory) -> Path:
    if "docs" not in _QUICK_DOCS:
        docs = tmp_path_factory.mktemp("bench_docs")
        _run_script([str(END_TO_END), "--quick", "--output", str(docs / "performance_end_to_end.md")], 600)
        # Three cases keep it short: full vs LoRA, and the naive-logprob / disable_adapter path;
        # `full` once more under glibc's default malloc settings.
        _run_script(
            [
                str(TRAINER_MEMORY),
                "--quick",
                "--cases",
                "full,lora,lora_ref_naive",
                "--default-malloc-cases",
                "full",
                "--output",
                str(docs / "performance_trainer_memory.md"),
            ],
            900,
        )
        _QUICK_DOCS["docs"] = docs
    return _QUICK_DOCS["docs"]


@pytest.mark.long(
    "the first of the module's tests to read the quick outputs of end_to_end.py and trainer_memory.py "
    "runs them (once for the module)"
)
@pytest.mark.bench("benchmarks/end_to_end.py, trainer_memory.py and summarize.py --quick")
def test_end_to_end_quick(tmp_path_factory):
    import json

    docs = _quick_docs(tmp_path_factory)
    data = json.loads((docs / "performance_end_to_end.json").read_text())
    header, runs = data["header"], data["results"]
    assert header["quick"] is True and header["batches"] == 4 and header["warmup"] == 1
    for key in ("machine", "date", "code", "command", "work", "elapsed_s", "load_start", "load_end"):
        assert key in header, key
    # --quick: the two HF runs only, (a) as the quickstart ships it, (b) asynchronous.
    assert [r["key"] for r in runs] == ["a", "b"]
    a, b = runs
    assert (a["engine"], a["engine_dtype"], a["max_staleness"]) == ("HFEngine", "bfloat16", 0)
    assert (b["engine"], b["engine_dtype"], b["max_staleness"]) == ("HFEngine", "float32", 2)
    for r in runs:
        assert r["batches_counted"] == 3 and r["optimizer_steps_per_batch"] == 2
        assert r["wall_s"] > 0 and r["generate_s"] > 0 and r["generated_tokens"] > 0
        # At most 16 prompts x 8 samples x 8 new tokens per batch.
        assert 0 < r["tokens_per_batch"] <= 16 * 8 * 8
        assert math.isclose(r["batches_per_s"], r["batches_counted"] / r["wall_s"], rel_tol=1e-9)
        assert math.isclose(r["optimizer_steps_per_s"], 2 * r["batches_per_s"], rel_tol=1e-9)
        assert math.isclose(r["generated_tokens_per_s"], r["generated_tokens"] / r["wall_s"], rel_tol=1e-9)
        assert math.isclose(r["engine_tokens_per_s"], r["generated_tokens"] / r["generate_s"], rel_tol=1e-9)
        assert math.isclose(r["tokens_per_batch"], r["generated_tokens"] / r["batches_counted"], rel_tol=1e-9)
        assert math.isclose(r["batches_per_s_vs_a"], r["batches_per_s"] / a["batches_per_s"], rel_tol=1e-9)
        assert 0.0 <= r["reward_mean"] <= 1.0
    # Synchronous: generation is part of the measured wall time.
    assert a["generate_s"] < a["wall_s"]
    assert a["batches_per_s_vs_a"] == 1.0
    text = (docs / "performance_end_to_end.md").read_text()
    for needed in ("**Machine**", "**Load average**", "## Method", "| (a) |", "| (b) |"):
        assert needed in text, needed


@pytest.mark.bench("benchmarks/end_to_end.py, trainer_memory.py and summarize.py --quick")
def test_trainer_memory_quick(tmp_path_factory):
    import json

    docs = _quick_docs(tmp_path_factory)
    data = json.loads((docs / "performance_trainer_memory.json").read_text())
    assert data["header"]["quick"] is True
    rows = {r["case"]: r for r in data["results"] if r["malloc"] == "pinned"}
    assert set(rows) == {"full", "lora", "lora_ref_naive"}
    (default,) = [r for r in data["results"] if r["malloc"] == "default"]
    assert default["case"] == "full" and default["peak_extra"] > 0
    full, lora, naive = rows["full"], rows["lora"], rows["lora_ref_naive"]
    for r in rows.values():
        assert r["model"] == "tiny" and r["peak_reset"] is True
        assert r["peak_extra"] > 0 and r["baseline_rss"] > 0 and r["step_s"] > 0
        assert r["state_bytes_analytic"] == r["trainable_params"] * 4 * 3 + r["reference_params"] * 4
        assert r["base_params"] == full["params"]  # the same model under every case
    # Full fine-tuning trains everything; LoRA only its adapters, fewer, on top of the same base.
    assert full["trainable_params"] == full["params"]
    assert 0 < lora["trainable_params"] < full["trainable_params"]
    assert lora["params"] == lora["base_params"] + lora["trainable_params"]
    # No reference copy: none asked for in `full` / `lora`, the adapters disabled in lora_ref_naive.
    assert full["reference_params"] == lora["reference_params"] == naive["reference_params"] == 0
    assert (naive["reference"], naive["logprobs"], naive["lora_rank"]) == ("disable_adapter", "naive", 16)
    ratios = data["ratios"]["tiny"]
    assert math.isclose(ratios["lora_vs_full_peak_extra"], lora["peak_extra"] / full["peak_extra"], rel_tol=1e-9)
    text = (docs / "performance_trainer_memory.md").read_text()
    for needed in ("**Machine**", "## Method", "fresh subprocess", "### tiny", "| full |", "| lora16 |"):
        assert needed in text, needed
    for needed in ("glibc's default", "| full | "):  # the table of the default-malloc run
        assert needed in text, needed


@pytest.mark.long("reads the quick outputs of end_to_end.py and trainer_memory.py, which it runs when it comes first")
@pytest.mark.bench("benchmarks/end_to_end.py, trainer_memory.py and summarize.py --quick")
def test_summarize_quick_outputs(tmp_path_factory):
    import re
    import time

    docs = _quick_docs(tmp_path_factory)
    out = docs / "performance.md"
    started = str(time.time() - 90)
    _run_script(
        [str(SUMMARIZE), "--docs", str(docs), "--output", str(out), "--started", started, "--load-start", "0.5"], 120
    )
    text = out.read_text()
    wall = re.search(r"\*\*`make bench` wall time\*\*: ([0-9.]+) min", text)
    assert wall is not None and 1.5 <= float(wall.group(1)) < 3.0, text  # 90 s before the start, plus its run
    assert "0.5 / " in text  # the load average at the start, as given
    # The two benchmarks that ran are summarized and linked; the others say they did not run.
    assert "[performance_end_to_end.md](performance_end_to_end.md)" in text
    assert "| (a) | HFEngine(bfloat16), sync |" in text and "**1.00x**" in text
    assert "[performance_trainer_memory.md](performance_trainer_memory.md)" in text
    assert "| tiny |" in text
    for stem in ("performance_async", "performance_logprobs", "performance_correction", "performance_vs_trl"):
        assert f"Not run: no `{stem}.json`" in text, stem
    assert "Could not summarize" not in text


def test_summarize_names_each_engines_own_seeds_of_a_merged_vs_trl_report():
    """docs/reports/performance_vs_trl.json merges invocations (vs_trl --from-json): each comparison line names the
    seeds of its own engine's rows (e.g. 5 hf seeds and 3 vllm seeds)."""
    import importlib.util
    import json

    sys.path.insert(0, str(SUMMARIZE.parent))  # its folder, as when run as a script (it adds benchmarks/ itself)
    spec = importlib.util.spec_from_file_location("summarize", SUMMARIZE)
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    data = json.loads((BENCH.parents[1] / "docs" / "reports" / "performance_vs_trl.json").read_text())
    lines = summarize.vs_trl(data)
    for key, ratio in data["ratios"].items():
        engine = ratio.get("engine", key)
        seeds = sorted({s for r in data["summary"] if r["engine"] == engine for s in r["seeds"]})
        (line,) = [x for x in lines if x.startswith(f"{key}: ")]
        assert f"Means over seeds {', '.join(map(str, seeds))}, " in line


# ------------------------------------------------------------------ gpu_check (its --cpu-smoke mode)
GPU_CHECK = BENCH.parent / "gpu_check.py"


@pytest.mark.slow
@pytest.mark.bench("benchmarks/gpu_check.py --cpu-smoke")
def test_gpu_check_cpu_smoke_reports_finite_figures_for_every_part(tmp_path):
    """The script another engineer runs once on a GPU, on CPU with a tiny model: every part runs in its
    subprocess and the report holds finite figures for each (the fits: 2 batches of 2 optimizer steps)."""
    import json

    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--cpu-smoke", "--output-dir", str(tmp_path), "--budget-s", "280"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((tmp_path / "performance_gpu.json").read_text())
    parts = data["parts"]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(
        ("checkpoint", "fsdp", "lora", "logprobs"), "ok"
    ), {name: p.get("error") for name, p in parts.items()}
    assert data["header"]["smoke"] is True and data["header"]["torch_runtime"]

    ck = parts["checkpoint"]
    assert ck["tied_embeddings"] is True and ck["params"] > 0 and ck["checkpoint_bytes"] > 0
    assert ck["config"]["vocab_size"] > ck["tokenizer_ids"]  # padded head rows, as Qwen2.5's
    # Completions are text with some spread: the rewards of a group differ, so the loss has a gradient.
    assert ck["next_token_entropy"] > 0.5 and ck["next_token_mass_in_tokenizer"] > 0.9

    for name in ("fsdp", "lora"):
        fit = parts[name]
        assert fit["problems"] == [] and fit["batches_trained"] == 2, (name, fit["problems"])
        assert fit["wall_s"] > 0 and fit["peak_allocated_bytes"] > 0
        rows = fit["rows"]
        assert [r["batch"] for r in rows] == [0, 1] and rows[-1]["policy_version"] == 4
        for row in rows:
            for key in ("loss", "reward", "grad_norm", "rollout_kl", "approx_kl", "step_s", "generate_s"):
                assert math.isfinite(row[key]), (name, key, row)
            assert row["grad_norm"] > 0 and row["step_s"] > 0
        assert math.isfinite(rows[1]["batch_wall_s"]) and rows[1]["batch_wall_s"] > 0
    fsdp_argv = " ".join(parts["fsdp"]["argv"])
    assert "configs/fsdp.yaml" in fsdp_argv and "rollout.HFEngine" in fsdp_argv

    lp = parts["logprobs"]
    assert [(r["tokens"], r["method"]) for r in lp["rows"]] == [
        (t, m) for t in (128, 256) for m in ("eager", "lean", "fused")
    ]
    for row in lp["rows"]:
        assert "error" not in row, row
        assert math.isfinite(row["time_s"]) and row["time_s"] > 0
        assert math.isfinite(row["peak_extra_bytes"]) and math.isfinite(row["max_abs_diff_fp32"])
        # The fused head computes float32 logits; the logits paths round them to bf16 first.
        assert row["max_abs_diff_fp32"] < (1e-3 if row["method"] == "fused" else 0.5), row
    for ratio in lp["ratios"]:
        assert math.isfinite(ratio["eager_over_fused_time"]) and math.isfinite(ratio["lean_over_fused_time"])

    text = (tmp_path / "performance_gpu.md").read_text()
    for needed in ("## `configs/fsdp.yaml`", "## `configs/lora_single_gpu.yaml`", "## Token logprobs", "| fused |"):
        assert needed in text, needed
    for name in ("checkpoint", "fsdp", "lora", "logprobs"):
        assert f"| {name} | ok |" in text, name


# ------------------------------------------------------------------ weight_sync, transfer_bandwidth
WEIGHT_SYNC = BENCH.parent / "weight_sync.py"
TRANSFER = BENCH.parent / "transfer_bandwidth.py"


@pytest.mark.bench("benchmarks/transfer_bandwidth.py at test size")
def test_transfer_bandwidth_moves_a_tiny_model_exactly(tmp_path):
    """Every way that runs on CPU moves the weights into the receiver's copy (checked by a float64 sum)."""
    import json

    out = tmp_path / "bw.md"
    proc = subprocess.run(
        [sys.executable, str(TRANSFER), "--device", "cpu", "--models", "tiny", "--repeats", "1", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["way"] for r in rows] == ["shared_memory", "file"]
    assert all(r["bytes"] > 0 and 0 < r["seconds"] < 10 for r in rows)
    assert "| tiny | shared_memory |" in out.read_text()


def test_weight_sync_report_and_its_summary_line():
    """The report's ratios and the performance page's line, from figures given by hand."""
    import importlib.util

    sys.path.insert(0, str(WEIGHT_SYNC.parent))
    sys.path.insert(0, str(SUMMARIZE.parent))
    modules = {}
    for name, path in (("weight_sync", WEIGHT_SYNC), ("summarize", SUMMARIZE)):
        spec = importlib.util.spec_from_file_location(name, path)
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])

    def row(model, transport, walls, transfers, nbytes, peak, held, probe=(-1.0, -2.5)):
        return dict(model=model, transport=transport, params=100, bytes=nbytes, wall_s=walls, transfer_s=transfers,
                    check_diff=0.01, peak_extra=peak, held_buffer=held, probe_logprobs=list(probe))  # fmt: skip

    results = [
        row("qwen2-0.5b", "file", [6.0, 5.0, 7.0], [5.5, 4.5, 6.5], 2_000_000_000, 2.4e9, 0),
        row("qwen2-0.5b", "memory", [1.0, 1.2, 0.9], [0.8, 1.0, 0.7], 1_000_000_000, 5e8, 5.4e8),
        row("llama-168m", "file", [1.0], [0.9], 6e8, 5e8, 0),
        row("llama-168m", "memory", [0.5], [0.4], 3e8, 1e8, 2e8, probe=(-1.0, -2.25)),
    ]
    ratios = modules["weight_sync"].summarize(results)
    assert ratios["qwen2-0.5b"]["transports_max_diff"] == 0.0 and ratios["llama-168m"]["transports_max_diff"] == 0.25
    half = ratios["qwen2-0.5b"]
    assert half["file_wall_s"] == 6.0 and half["memory_wall_s"] == 1.0 and half["speedup_wall"] == 6.0
    assert half["memory_bandwidth"] == 1e9 / 0.8 and half["file_transfer_s"] == 5.5
    lines = modules["summarize"].weight_sync({"ratios": ratios})
    assert lines[0].startswith("- qwen2-0.5b: sync 6.00 s (files) -> 1.00 s (memory), **6.0x** (goal >= 5x: **met**)")
    assert "(+ a 540 MB bucket held)" in lines[0]
    assert lines[1].startswith("- llama-168m:") and "goal" not in lines[1]  # the goal is stated at 0.5B
    ratios["qwen2-0.5b"]["speedup_wall"] = 4.0
    assert "**not met**" in modules["summarize"].weight_sync({"ratios": ratios})[0]
    header = {"syncs": 3, "elapsed_s": 1.0, "load_start": 0.0, "load_end": 0.0, "machine": "m", "date": "d",
              "code": "c", "command": "python benchmarks/weight_sync.py"}  # fmt: skip
    text = modules["weight_sync"].render(results, modules["weight_sync"].summarize(results), header)
    assert "- qwen2-0.5b: whole sync **6.0x** faster in memory" in text
    assert "qwen2-0.5b bit-identical, llama-168m **differ by 0.25**" in text
    assert "| 7B (Qwen2-7B) | 15.2 |" in text  # 15.24 GB at 2 bytes per parameter
