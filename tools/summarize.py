#!/usr/bin/env python
"""Gather the benchmarks' JSON outputs into one page, ``docs/reports/performance.md``: the key ratios, linked
to each benchmark's own report.

Reads, from ``--docs`` (each one optional; a missing one is reported as not run):

* ``performance_end_to_end.json``     (``benchmarks/end_to_end.py``)
* ``performance_async.json``          (``benchmarks/async_overlap.py``)
* ``performance_trainer_memory.json`` (``benchmarks/trainer_memory.py``)
* ``performance_logprobs.json``       (``benchmarks/logprob_memory.py``)
* ``performance_correction.json``     (``benchmarks/correction_bench.py``)
* ``performance_vs_trl.json``         (``benchmarks/vs_trl.py``)
* ``performance_vs_trl_tools.json``   (``benchmarks/vs_trl_tools.py``)
* ``performance_weight_sync.json``    (``benchmarks/weight_sync.py``)
* ``performance_long_tail.json``      (``benchmarks/vs_trl_long_tail.py``)
* ``performance_compile.json``        (``benchmarks/compile_policy.py``)

Nothing is measured here. ``make bench`` runs it last with ``--started`` (the epoch second the
target started) and ``--load-start``, so the page states the wall time of the whole target.

Usage::

    python tools/summarize.py --docs docs --output docs/reports/performance.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared harness
from harness.memory import mb, mb_diff  # noqa: E402
from harness.report import code_line, cpu_model  # noqa: E402

#: (file stem, section title, the script that writes it)
SECTIONS = [
    ("performance_end_to_end", "End to end: the quickstart recipe per engine", "benchmarks/end_to_end.py"),
    ("performance_async", "Asynchronous rollouts: overlap of generation and training", "benchmarks/async_overlap.py"),
    ("performance_trainer_memory", "Trainer memory: full fine-tuning vs LoRA", "benchmarks/trainer_memory.py"),
    ("performance_logprobs", "Token logprobs: lean vs naive vs fused head", "benchmarks/logprob_memory.py"),
    ("performance_correction", "Off-policy correction step", "benchmarks/correction_bench.py"),
    ("performance_vs_trl", "Side by side with TRL's GRPOTrainer on the same task", "benchmarks/vs_trl.py"),
    ("performance_vs_trl_tools", "Tool use side by side with TRL (tools=...)", "benchmarks/vs_trl_tools.py"),
    (
        "performance_vs_trl_tools_slow_tool",
        "Tool use side by side with TRL, each tool call 0.1-2 s",
        "benchmarks/vs_trl_tools.py",
    ),
    (
        "performance_vs_trl_tools_slow_tool_async",
        "Tool use side by side with TRL, each tool call 0.1-2 s, the kit asynchronous",
        "benchmarks/vs_trl_tools.py",
    ),
    ("performance_agentic", "Agentic rollouts with slow tools: steps side by side", "benchmarks/agentic.py"),
    (
        "performance_agentic_server",
        "Agentic rollouts on a vLLM server: each episode alone vs turn by turn",
        "benchmarks/agentic_server.py",
    ),
    (
        "performance_agentic_server_long_turns",
        "Agentic rollouts on a vLLM server with long-tailed turns: each episode alone vs turn by turn",
        "benchmarks/agentic_server.py",
    ),
    ("performance_weight_sync", "Weight sync: in memory vs files", "benchmarks/weight_sync.py"),
    ("performance_long_tail", "Long-tailed completions side by side with TRL", "benchmarks/vs_trl_long_tail.py"),
    ("performance_compile", "Compiled policy: training step compiled vs eager", "benchmarks/compile_policy.py"),
]


def load_json(docs: Path, stem: str) -> Any | None:
    path = docs / f"{stem}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}x"


def __mb_pair(ratios: dict[str, float], first: str, second: str) -> str:
    return " / ".join(mb_diff(ratios[k]) if k in ratios else "-" for k in (first, second))


# --------------------------------------------------------------------------- one function per section


def end_to_end(data: dict[str, Any]) -> list[str]:
    runs = data["results"]
    lines = [
        "| run | engine, mode | batches/s | optimizer steps/s | generated tokens/s | batches/s vs (a) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| ({r['key']}) | {r['label']} | {r['batches_per_s']:.2f} | {r['optimizer_steps_per_s']:.2f} "
            f"| {r['generated_tokens_per_s']:.0f} | **{_x(r.get('batches_per_s_vs_a'))}** |"
        )
    head = data["header"]
    by_key = {r["key"]: r for r in runs}
    lines.append("")
    if "c" in by_key and "d" in by_key:  # the one pair that differs by the staleness alone
        lines.append(
            f"Asynchronous / synchronous with the same engine: vLLM (d) / (c) = "
            f"**{_x(by_key['d']['batches_per_s'] / by_key['c']['batches_per_s'])}** batches/s "
            "((b) / (a) also changes the engine's dtype)."
        )
    lines.append(
        f"{head['batches']} batches per run, the first {head['warmup']} not counted; "
        f"load {head['load_start']:.1f} -> {head['load_end']:.1f}."
    )
    lines += [f"{n}" for n in head.get("notes", [])]
    return lines


def async_overlap(data: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| engine | sync step s | async step s | speed-up | async / max(generation, training) | goal <= 1.1x "
        "| training alone -> side by side | CPU share training / generation |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for r in data:
        ratio = r.get("async_over_ideal", 1 / r["overlap_efficiency"])
        phases = r.get("async_phases")
        slowdown = f"{_x(r['train_slowdown'])}" if "train_slowdown" in r else "-"
        shares = f"{phases['train_cpu_share']:.2f} / {phases['generate_cpu_share']:.2f}" if phases else "-"
        lines.append(
            f"| {r['engine']} | {r['sync_step_s']:.3f} | {r['async_step_s']:.3f} | **{_x(r['speedup'])}** "
            f"| **{_x(ratio)}** | {'met' if ratio <= 1.1 else 'not met'} | {slowdown} | {shares} |"
        )
    return lines


def trainer_memory(data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    top: list[str] = []
    for model, s in data.get("ratios", {}).items():
        mine = [r for r in data["results"] if r["model"] == model and not r.get("skipped")]
        rows = {r["case"]: r for r in mine if r.get("malloc", "pinned") == "pinned"}
        if not rows:
            continue
        # The same cases under glibc's default malloc settings: what `top` shows.
        defaults = [
            f"{r['label']} {mb(r['peak_extra'])} MB ({mb_diff(r['peak_extra'] - rows[r['case']]['peak_extra'])})"
            for r in mine
            if r.get("malloc") == "default" and r["case"] in rows
        ]
        if defaults:
            top.append(f"- {model}: " + ", ".join(defaults) + ".")
        weights = s.get("weights_bytes", 0)
        cases = ("full", "full_ref", "lora", "lora_ref")
        cells = " | ".join(mb(rows[k]["peak_extra"]) if k in rows else "-" for k in cases)
        lines.append(
            f"| {model} | {mb(weights)} | {cells} | {_x(s.get('lora_vs_full_peak_extra'))} / "
            f"**{_x(s.get('lora_vs_full_peak_extra_with_reference'))}** "
            f"| {__mb_pair(s, 'reference_cost_full_bytes', 'reference_cost_lora_bytes')} "
            f"| {__mb_pair(s, 'naive_minus_lean_full_bytes', 'naive_minus_lean_lora_bytes')} |"
        )
    head = [
        "Peak RSS extra over the process after the model was built, MB (fresh subprocess per case, glibc's "
        "mmap threshold pinned so that RSS follows live memory):",
        "",
        "| model | weights MB | full | full + frozen_copy | LoRA r16 | LoRA + disable_adapter "
        "| LoRA / full (no reference / with one) | reference cost MB (full / LoRA) "
        "| naive - lean logprobs MB (full / LoRA) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if not lines:
        return ["No case ran."]
    if top:
        top.insert(0, "Peak extra under glibc's default malloc settings (what `top` shows; in brackets the "
                   "allocator's retention over the pinned figure):")  # fmt: skip
        top.insert(1, "")
    return head + lines + ([""] + top if top else [])


def logprobs(data: dict[str, Any]) -> list[str]:
    results = data["results"]
    cases = list(dict.fromkeys((r["vocab"], r["tokens"], r["dtype"]) for r in results))
    lines = [
        "| V | T | logits dtype | lean chunk | lean peak extra (x logits) | naive peak extra (x logits) "
        "| naive / lean time | fused head peak extra (x logits; goal <= 0.25) | fused / lean time |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        same = [r for r in results if (r["vocab"], r["tokens"], r["dtype"]) == case and not r["skipped"]]
        lean = [r for r in same if r["method"] == "lean"]
        naive = next((r for r in same if r["method"] == "naive"), None)
        fused = next((r for r in same if r["method"] == "fused"), None)
        if not lean:
            continue
        first = lean[0]  # the first chunk size listed: 1024, the module's default
        lean_x = first["peak_fwd_bwd"] / first["logits_bytes"]
        naive_x = f"{naive['peak_fwd_bwd'] / naive['logits_bytes']:.2f}" if naive else "not run"
        speed = _x(naive["time_s"] / first["time_s"]) if naive else "-"
        if fused:
            fx = fused["peak_fwd_bwd"] / fused["logits_bytes"]
            temps = (fused["peak_fwd_bwd"] - fused.get("grad_bytes", 0)) / fused["logits_bytes"]
            fused_x = (
                f"**{fx:.2f}** ({temps:.2f} without grad_hidden + grad_weight; H = {fused['hidden']}"
                f"{'' if fx <= 0.25 else '; total over the goal'})"
            )
            fused_speed = _x(fused["time_s"] / first["time_s"])
        else:
            fused_x, fused_speed = "not run", "-"
        lines.append(
            f"| {case[0]} | {case[1]} | {case[2]} | {first['chunk_size']} | **{lean_x:.2f}** | {naive_x} | {speed} "
            f"| {fused_x} | {fused_speed} |"
        )
    return lines


def correction(data: dict[str, Any]) -> list[str]:
    lines = [
        "| B x T | fastest preset (ms) | slowest preset (ms) | slowest / fastest | median x bandwidth bound (hot) "
        "| peak extra, x one [B,T] float32 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for size in data["sizes"]:
        rows = size["rows"]
        fast = min(rows, key=lambda r: r["total"])
        slow = max(rows, key=lambda r: r["total"])
        unit = 4 * size["batch"] * size["seq_len"]
        hot = [r["hot_ratio"] for r in rows if r["hot_ratio"] is not None]
        peaks = [r["peak"] / unit for r in rows]
        lines.append(
            f"| {size['batch']} x {size['seq_len']} | {fast['preset']} ({fast['total'] * 1e3:.1f}) "
            f"| {slow['preset']} ({slow['total'] * 1e3:.1f}) | {_x(slow['total'] / fast['total'])} "
            f"| {statistics.median(hot):.1f} | {min(peaks):.1f} - {max(peaks):.1f} |"
        )
    fused = [size for size in data["sizes"] if size.get("fused_rows")]
    goals = data["header"].get("goals", {})
    one_pass_goal, peak_goal = goals.get("one_pass", 3.0), goals.get("peak", 4.0)
    if fused:
        lines += [
            "",
            f"The fused step (`FusedCorrectionStep`, `torch.compile`; `OffPolicyRLModule(fused_loss=True)`), "
            f"against issue 12's goals: <= {one_pass_goal:g}x one memory-bound pass over its inputs and gradient, "
            f"a peak extra of <= {peak_goal:g} [B,T] float32 tensors.",
            "",
            f"| B x T | fused / eager step time (median) | x one pass (hot) | goal <= {one_pass_goal:g}x "
            f"| exp pass / add pass | peak extra, x one [B,T] float32 | goal <= {peak_goal:g} |",
            "|---|---:|---:|---|---:|---:|---|",
        ]
        for size in fused:
            rows = size["fused_rows"]
            unit = 4 * size["batch"] * size["seq_len"]
            speed = statistics.median(r["total"] / r["eager_total"] for r in rows)
            ratios = [r["hot_ratio"] for r in rows]
            peaks = [r["peak"] / unit for r in rows]
            lines.append(
                f"| {size['batch']} x {size['seq_len']} | {speed:.2f} | {min(ratios):.0f} - {max(ratios):.0f} "
                f"| {_met(max(ratios) <= one_pass_goal)} | {size['exp_over_add']:.1f} "
                f"| {min(peaks):.1f} - {max(peaks):.1f} | {_met(max(peaks) <= peak_goal)} |"
            )
        lines += [
            "",
            "Where the time goal is not met, the reason is measured in the same run: one `torch.exp` pass costs "
            "several `torch.add` passes on this CPU (column `exp pass / add pass`), and the step evaluates exp / "
            "expm1 / log 3-4 times per token (forward, gradient and metrics), so those evaluations alone cost "
            "10-13x one pass (the `compute floor` column of the linked report); the compiled loops run at a few "
            "times that floor (float64 accumulation of the exact metric sums, some 30 reductions per pass).",
        ]
    return lines


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def vs_trl(data: dict[str, Any]) -> list[str]:
    head = data["header"]
    lines = [
        f"| side | engine | final reward (last {head['window']} steps) | first step of a {head['window']}-step mean "
        f">= {head['threshold']} | s/step (median) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in data["summary"]:
        steps = "never" if r["steps_to_threshold"] is None else f"{r['steps_to_threshold']:.0f}"
        lines.append(
            f"| {r['label']} | {r['engine']} | **{r['final_reward']:.3f}** | {steps} | {r['median_step_s']:.3f} |"
        )
    lines.append("")
    for key, ratio in data["ratios"].items():
        steps_ratio = ratio["steps_to_threshold_kit_over_trl"]
        engine = ratio.get("engine", key)
        # An engine's rows may cover fewer seeds than the whole report (invocations merged with --from-json).
        seeds = sorted({s for r in data["summary"] if r["engine"] == engine for s in r["seeds"]}) or head["seeds"]
        speed = ratio.get("steps_per_s_kit_over_trl")
        speed_goal = head.get("speed_goal", 2.0)  # the first-letter task's goal; the tool-use run sets none
        goal = ""
        if speed is not None and speed_goal is not None:
            goal = f" (goal >= {speed_goal:g}x: {'met' if speed >= speed_goal else 'not met'})"
        lines.append(
            f"{key}: final reward kit - TRL {ratio['final_reward_kit_minus_trl']:+.3f}; steps to "
            f"{head['threshold']} kit / TRL {'n/a' if steps_ratio is None else f'{steps_ratio:.2f}'}; "
            f"s/step kit / TRL {_x(ratio['median_step_s_kit_over_trl'])}; steps/s kit / TRL **{_x(speed)}**{goal}. "
            f"Means over seeds {', '.join(map(str, seeds))}, {head['steps']} steps per side and seed."
        )
    return lines


def vs_trl_tools(data: dict[str, Any]) -> list[str]:
    """The side-by-side's lines, the final models' held-out success, and the run's notes."""
    head, held_out = data["header"], data["held_out"]
    start = head["held_out_start"]
    rates = "; ".join(
        f"{side} {modes['greedy']['mean']:.3f} / {modes['sampled']['mean']:.3f}" for side, modes in held_out.items()
    )
    return [
        *vs_trl(data),
        "",
        f"Held-out success of the final models ({head['held_out_prompts']} questions, one evaluator), greedy / "
        f"sampled: the checkpoint {start['greedy']:.3f} / {start['sampled']:.3f}; {rates}.",
        *(f"Note: {note}" for note in head.get("notes", [])),
    ]


#: The in-memory sync's goal at the ~0.5B size: a whole sync (check included) this many times faster than files.
WEIGHT_SYNC_GOAL = 5.0


def agentic(data: dict[str, Any]) -> list[str]:
    median = data["results"]["median"]
    lines = [
        "| variant | rollout s / batch | x instant, side by side | episodes / s | engine share |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in median.items():
        lines.append(
            f"| {name} | {v['rollout_s']:.2f} | {_x(v['x_instant_side_by_side'])} | {v['episodes_per_s']:.1f} "
            f"| {v['engine_share']:.0%} |"
        )
    slow = median["slow tool, side by side"]["x_instant_side_by_side"]
    lines += ["", f"Goal: the slow tool within 1.3x of the instant tool's rollout: {_x(slow)}, {_met(slow <= 1.3)}."]
    return lines


def agentic_server(data: dict[str, Any]) -> list[str]:
    median = data["results"]["median"]
    lines = [
        "| variant | rollout s / batch | episodes / s | server busy | turn tokens mean / max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in median.items():
        turns = f"{v['turn_tokens_mean']:.1f} / {v['turn_tokens_max']:.0f}" if "turn_tokens_mean" in v else "-"
        lines.append(
            f"| {name} | {v['rollout_s']:.2f} | {v['episodes_per_s']:.1f} | {v['server_busy_share']:.0%} | {turns} |"
        )
    alone = median["slow environment, each episode alone"]["rollout_s"]
    by_turn = median["slow environment, turn by turn"]["rollout_s"]
    lines += ["", f"With the slow environment, turn by turn takes {_x(by_turn / alone)} the time of each alone."]
    return lines


def weight_sync(data: dict[str, Any]) -> list[str]:
    """Per model: whole-sync seconds of both transports, the speed-up against the goal, peak extra memory."""
    lines = []
    for model, r in data["ratios"].items():
        if "speedup_wall" not in r:
            continue
        met = _met(r["speedup_wall"] >= WEIGHT_SYNC_GOAL)
        goal = f" (goal >= {WEIGHT_SYNC_GOAL:g}x: {met})" if "0.5b" in model else ""
        lines.append(
            f"- {model}: sync {r['file_wall_s']:.2f} s (files) -> {r['memory_wall_s']:.2f} s (memory), "
            f"**{r['speedup_wall']:.1f}x**{goal}; peak extra {r['file_peak_extra'] / 1e6:,.0f} -> "
            f"{r['memory_peak_extra'] / 1e6:,.0f} MB (+ a {r['memory_held_buffer'] / 1e6:,.0f} MB bucket held)."
        )
    return lines


def long_tail(data: dict[str, Any]) -> list[str]:
    """Per side: final reward and s/step; then each goal with its figure, met or not."""
    lines = ["| side | final reward | s/step (median) | completion tokens/s |", "|---|---:|---:|---:|"]
    for r in data["summary"]:
        tokens = r.get("completion_tokens_per_s")
        lines.append(
            f"| {r['label']} | **{r['final_reward']:.3f}** | {r['median_step_s']:.2f} | "
            f"{'-' if tokens is None else f'{tokens:.0f}'} |"
        )
    lines += ["", "| goal | measured | |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['figure']} | {_met(g['met'])} |" for g in data["header"]["goals"]]
    return lines


def compile_policy(data: dict[str, Any]) -> list[str]:
    """Per model and thread count: steady s/step eager and compiled, their ratio, the cold compilation."""
    lines = [
        "| model | threads | eager s/step | compiled s/step | compiled / eager | compile s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['eager_steady_s']:.3f} | {r['compiled_steady_s']:.3f} | "
            f"**{r['steady_ratio']:.2f}** | {r['compile_s']:.0f} |"
        )
    return lines


RENDER: dict[str, Callable[[Any], list[str]]] = {
    "performance_end_to_end": end_to_end,
    "performance_async": async_overlap,
    "performance_trainer_memory": trainer_memory,
    "performance_logprobs": logprobs,
    "performance_correction": correction,
    "performance_vs_trl": vs_trl,
    "performance_vs_trl_tools": vs_trl_tools,
    "performance_vs_trl_tools_slow_tool": vs_trl_tools,
    "performance_vs_trl_tools_slow_tool_async": vs_trl_tools,
    "performance_agentic": agentic,
    "performance_agentic_server": agentic_server,
    "performance_agentic_server_long_turns": agentic_server,
    "performance_weight_sync": weight_sync,
    "performance_long_tail": long_tail,
    "performance_compile": compile_policy,
}

READING = {
    "performance_end_to_end": "Throughput of the whole loop (generation, weight pushes, the decoupled PPO "
    "step, logging) on the tiny model; ratios are to run (a), the quickstart as shipped.",
    "performance_async": "Sync vs async step time at the same work; overlap needs idle cores (see the load).",
    "performance_trainer_memory": "What the trainer adds to the policy's weights during one decoupled PPO step "
    "(2 AdamW steps), measured as peak RSS.",
    "performance_logprobs": "The logprob computation alone, on [1, T, V] logits (lean, naive), or from the "
    "hidden states and the head weight with no logits (fused head, the default; its time includes the head's "
    "matmuls); `x logits` = multiples of one logits tensor (the gradient of the logits alone is 1.0). The "
    "lean and naive rows may come from an earlier run (the report's header says which).",
    "performance_correction": "The correction + loss + metrics step per preset, against a memory-bandwidth "
    "probe of the same run.",
    "performance_vs_trl": "Issue 10's task (copy the prompt's first letter) from a random-init Llama with a "
    "char-level HF tokenizer: TRL and the kit's plain user path, each in its own process, back to back.",
    "performance_vs_trl_tools": "Tool-use episodes (multiply with a calculator tool) from `tiny:multiply`, an "
    "HF-format checkpoint with Qwen2.5's chat template: TRL's tool loop and the kit's episodes on the same "
    "prompts and settings, each in its own process; the reward is the success rate.",
    "performance_vs_trl_tools_slow_tool": "The same side by side with the `multiply` tool of both sides waiting "
    "0.1-2 s a call (long-tailed, mean 0.26 s), 6 steps of one seed: what the tool loops cost when tools are slow.",
    "performance_vs_trl_tools_slow_tool_async": "The slow-tool side by side with the kit asynchronous "
    "(`max_staleness=1`, `HFProcessEngine`): the next batch's episodes, their tool calls included, are played while "
    "the trainer steps; TRL synchronous as it ships.",
    "performance_agentic": "Rollouts only, 64 tool-calling episodes of `tiny:multiply` a batch: the `multiply` tool "
    "instant or behind a long-tailed latency (0.1-2 s), the environment steps of a turn side by side (the default) "
    "or one at a time (the runner before).",
    "performance_agentic_server": "Rollouts only, 64 episodes of 3 turns a batch of `tiny:reverse` on one local vLLM "
    "server, the environment answering at once or after a long-tailed latency (0.1-2 s): each episode's next turn as "
    "soon as its environment answered (the servers' default) or one call per turn (the runner before).",
    "performance_agentic_server_long_turns": "The same on long_tail_task.py's warmed-up 10M Qwen2 (turns of geometric "
    "length, mean ~128 tokens, up to 256; `--model long-tail`): the turn-by-turn call waits for the longest turn.",
    "performance_weight_sync": "One weight sync of a float32 trainer into an in-process bfloat16 vLLM engine, the "
    "sync check included: shared-memory buckets (the default) against safetensors files (the earlier default).",
    "performance_long_tail": "Completions of ~16 to 512 tokens from a ~10M-parameter Qwen2 with a byte-level BPE "
    "tokenizer: TRL and the kit (synchronous, and asynchronous beside it), each in its own process, back to back; "
    "then the kit's update packed vs padded on the same batches, and its MFU against the measured matmul peak.",
    "performance_compile": "`OffPolicyRLModule(compile_policy='on')` against eager, cold inductor cache, steady-state "
    "median s/step (ratio < 1: compiled is faster); `'auto'` stays eager (docs/training.md, 'Compiled policy').",
}


def _when(data: Any, report: Path) -> str:
    """Date and duration of a benchmark run: from its JSON header, else from its report's header lines."""
    head = data.get("header", {}) if isinstance(data, dict) else {}
    parts = [head["date"]] if head.get("date") else []
    if head.get("elapsed_s") is not None:
        parts.append(f"{head['elapsed_s'] / 60:.1f} min")
    if not parts and report.exists():  # e.g. async_overlap.py writes a bare list of rows
        for line in report.read_text().splitlines():
            match = re.match(r"- \*\*(Date|Wall time of the whole run)\*\*: (.*)", line)
            if match:
                parts.append(match.group(2))
    return ", ".join(parts)


def render(docs: Path, started: float | None, load_start: float | None) -> str:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Performance",
        "",
        "Every figure below comes from one run of one benchmark on a shared CPU machine; the ratios are",
        "measured within that run (same process or same invocation, same load), the seconds are not",
        "comparable across runs. Each section links the benchmark's full report (method, every column).",
        "",
        f"- **Machine**: {cpu_model()}, nproc={os.cpu_count()}, no GPU",
        f"- **Summarized**: {now}; {code_line()}",
    ]
    load_end = os.getloadavg()[0]
    if started is not None:
        wall = (time.time() - started) / 60
        lines.append(f"- **`make bench` wall time**: {wall:.1f} min (all {len(SECTIONS)} benchmarks)")
        load = f"{load_start:.1f} / {load_end:.1f}" if load_start is not None else f"{load_end:.1f} (end)"
        lines.append(f"- **Load average** (1 min) at the start / end of `make bench`: {load} on {os.cpu_count()} cores")
    else:  # gathered outside `make bench`: each section's own run says when and how long
        lines.append("- **Gathered** from separate benchmark runs: each section names its run's date and wall time")
    lines.append("- **Regenerate**: `make bench` (every benchmark writes its `.md` and `.json`, then this page)")
    for stem, title, script in SECTIONS:
        data = load_json(docs, stem)
        lines += ["", f"## {title}", ""]
        if data is None:
            lines.append(f"Not run: no `{stem}.json` (run `{script}`).")
            continue
        when = _when(data, docs / f"{stem}.md")
        lines.append(f"[{stem}.md]({stem}.md), from `{script}`" + (f" ({when})" if when else "") + ".")
        lines += [READING[stem], ""]
        try:
            lines += RENDER[stem](data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # an older or partial JSON
            lines.append(f"Could not summarize `{stem}.json` ({type(exc).__name__}: {exc}); see the report.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, default=Path("docs/reports"), help="folder of the performance_*.json files")
    p.add_argument("--output", type=Path, default=None, help="write the page here (default: stdout)")
    p.add_argument("--started", type=float, default=None, help="epoch second `make bench` started (wall time)")
    p.add_argument("--load-start", type=float, default=None, help="1-min load average when `make bench` started")
    args = p.parse_args(argv)
    page = render(args.docs, args.started, args.load_start)
    if args.output is None:
        print(page)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(page)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
