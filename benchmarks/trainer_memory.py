#!/usr/bin/env python
"""Peak trainer memory of one decoupled PPO step vs model size: full fine-tuning vs LoRA, the
reference policy's cost in each mode, and the lean vs a naive logprob path, on CPU.

One step is one ``OffPolicyRLModule.training_step`` under a real ``Trainer.fit`` (one batch):
proximal forward, reference forward (when ``ref_kl_coef > 0``), correction, then
``num_minibatches = 2`` optimizer steps (AdamW), as in ``configs/quickstart.yaml``. The second
optimizer step runs with AdamW's state already allocated: the steady-state peak of training.

Cases, per model (see ``CASES``):

* ``full``: full fine-tuning, no reference (``ref_kl_coef = 0``);
* ``full + frozen_copy``: full fine-tuning with ``ref_kl_coef > 0``: a frozen deep copy of the policy;
* ``lora16``: peft LoRA, rank 16 on every linear layer, no reference;
* ``lora16 + disable_adapter``: LoRA with ``ref_kl_coef > 0``: the reference is the same model with
  the adapters disabled (no copy);
* the two reference cases again with the logprobs computed naively
  (``log_softmax(logits.float() / T).gather(...)``, the entropy from its ``exp``) instead of the
  kit's lean ``token_logprobs``: the module has no switch for it, so the worker replaces
  ``lightning_offpolicy.logprobs.causal_lm.token_logprobs`` (which ``causal_lm_token_logprobs`` calls).

Models: the quickstart's tiny Llama (~0.34M parameters) and a random ~168M-parameter Llama built
from a config (hidden 1024, 8 layers, 16 heads, MLP 2816, vocabulary 32000), float32.

Memory is the peak resident set size of a fresh subprocess per case, minus its RSS right after the
model was built, with glibc's mmap threshold pinned so that RSS follows live memory; the headline
cases again under glibc's defaults (see ``METHOD``).

Usage::

    python benchmarks/trainer_memory.py --output docs/reports/performance_trainer_memory.md   # ~5-8 min, 2 CPU cores
    python benchmarks/trainer_memory.py --quick --output /tmp/mem.md                  # tiny model only, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# benchmarks/*.py run as scripts: their directory is on sys.path, and with it the shared harness.
from harness.memory import MB, mb, mb_diff, mem_available_bytes
from harness.report import header_bullets, load_bullet, load_prose, run_header, write_report
from trainer_memory_worker import (
    CASES,
    DEFAULT_MALLOC_CASES,
    MODELS,
    NUM_MINIBATCHES,
    PINNED_MMAP_THRESHOLD,
    Case,
    ModelSpec,
    worker,
)

ROOT = Path(__file__).resolve().parent.parent

#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]


def run_case(model: str, case: Case, threads: int, timeout: float, pinned: bool = True) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, case.key, "--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if pinned:
        env["MALLOC_MMAP_THRESHOLD_"] = str(PINNED_MMAP_THRESHOLD)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _estimated_need(spec: ModelSpec) -> float:
    """Bytes a full-fine-tuning case with a frozen copy may need: weights x 6 (+ reference, grads,
    AdamW x 2, slack) and 2 GB for activations, logits and the runtime."""
    cfg = spec.config
    hidden, layers, vocab = cfg.get("hidden_size", 128), cfg.get("num_hidden_layers", 2), cfg["vocab_size"]
    params = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * cfg.get("intermediate_size", 256))
    return 6 * 4 * params + 2e9


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per model: the ratios the report leads with, from this run's cases."""
    out: dict[str, dict[str, float]] = {}
    for model in dict.fromkeys(r["model"] for r in results):
        by = {r["case"]: r for r in results if r["model"] == model and not r.get("skipped")}

        def peak(name: str, by: dict[str, dict[str, Any]] = by) -> float | None:
            return by[name]["peak_extra"] if name in by else None

        s: dict[str, float] = {}
        full, full_ref = peak("full"), peak("full_ref")
        lora, lora_ref = peak("lora"), peak("lora_ref")
        weights = next(iter(by.values()))["param_bytes"] if by else 0
        if full and lora:
            s["lora_vs_full_peak_extra"] = lora / full
            s["lora_vs_full_peak_total"] = (lora + weights) / (full + weights)
        if full_ref and lora_ref:
            s["lora_vs_full_peak_extra_with_reference"] = lora_ref / full_ref
            s["lora_vs_full_peak_total_with_reference"] = (lora_ref + weights) / (full_ref + weights)
        if full is not None and full_ref is not None:
            s["reference_cost_full_bytes"] = full_ref - full
            s["reference_cost_full_x_weights"] = (full_ref - full) / weights
        if lora is not None and lora_ref is not None:
            s["reference_cost_lora_bytes"] = lora_ref - lora
            s["reference_cost_lora_x_weights"] = (lora_ref - lora) / weights
        for mode in ("full", "lora"):
            lean_name = f"{mode}_ref"
            naive, lean = peak(f"{mode}_ref_naive"), peak(lean_name)
            if naive is not None and lean is not None:
                s[f"naive_minus_lean_{mode}_bytes"] = naive - lean
                s[f"naive_minus_lean_{mode}_x_logits"] = (naive - lean) / by[lean_name]["logits_bytes"]
                s[f"naive_vs_lean_{mode}_peak_extra"] = naive / lean
        s["weights_bytes"] = weights
        out[model] = s
    return out


def render(results: list[dict[str, Any]], ratios: dict[str, dict[str, float]], header: dict[str, Any]) -> str:
    lines = [
        "# Trainer memory: full fine-tuning vs LoRA, the reference, lean vs naive logprobs",
        "",
        *header_bullets(header),
        f"- **Wall time of the whole run**: {header['elapsed_s']:.1f} s",
        load_bullet(header["load_start"], header["load_end"]),
        "",
        "Memory figures are resident bytes of one process (not timings): the machine's load does not",
        "change them. `step s` is wall time on a shared machine: read it as a ratio between cases.",
    ]
    if header.get("quick"):
        lines.append("`--quick`: the tiny model only: its figures are the fixed cost of a fit, not of the model.")
    if not all(r.get("peak_reset", True) for r in results if not r.get("skipped")):
        lines.append("**VmHWM reset unavailable: peaks are the lifetime `ru_maxrss` of each subprocess.**")
    lines += ["", "## Method", "", METHOD, "", "## Results", ""]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model and r.get("malloc") == "pinned"]
        defaults = [r for r in results if r["model"] == model and r.get("malloc") == "default"]
        first = next((r for r in rows if not r.get("skipped")), None)
        lines.append(f"### {model}")
        lines.append("")
        if first is not None:
            lines.append(
                f"{first['params'] if first['lora_rank'] == 0 else first['base_params']:,} parameters "
                f"({mb(first['param_bytes'])} MB of float32 weights, in the baseline); batch {first['rows']} rows x "
                f"({first['prompt_len']} prompt + {first['response_len']} response) tokens = {first['tokens']:,} "
                f"tokens, {NUM_MINIBATCHES} optimizer steps; one optimizer step's logits: "
                f"{mb(first['logits_bytes'])} MB."
            )
            lines.append("")
        lines.append(
            "| case | trainable params | reference params | set-up MB | peak extra MB | held after MB "
            "| state (analytic) MB | peak - state MB | peak extra / weights | step s |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if r.get("skipped"):
                lines.append(f"| {r['label']} | {r['skipped']} | | | | | | | | |")
                continue
            lines.append(
                f"| {r['label']} | {r['trainable_params']:,} | {r['reference_params']:,} | {mb(r['setup_extra'])} "
                f"| **{mb(r['peak_extra'])}** | {mb(r['held_extra'])} | {mb(r['state_bytes_analytic'])} "
                f"| {mb(r['peak_extra'] - r['state_bytes_analytic'])} | {r['peak_extra'] / r['param_bytes']:.2f} "
                f"| {r['step_s']:.1f} |"
            )
        s = ratios.get(model, {})
        lines += ["", "Ratios (same run):", ""]
        if "lora_vs_full_peak_extra" in s:
            lines.append(
                f"- LoRA / full, peak extra: **{s['lora_vs_full_peak_extra']:.2f}** without a reference, "
                f"**{s.get('lora_vs_full_peak_extra_with_reference', float('nan')):.2f}** with one; counting the "
                f"weights too: {s['lora_vs_full_peak_total']:.2f} / "
                f"{s.get('lora_vs_full_peak_total_with_reference', float('nan')):.2f}."
            )
        if "reference_cost_full_bytes" in s:
            lines.append(
                f"- The reference costs {mb_diff(s['reference_cost_full_bytes'])} MB of peak with full fine-tuning "
                f"(frozen_copy: {s['reference_cost_full_x_weights']:.2f} x the weights) and "
                f"{mb_diff(s.get('reference_cost_lora_bytes', float('nan')))} MB with LoRA "
                f"(disable_adapter: {s.get('reference_cost_lora_x_weights', float('nan')):.2f} x the weights)."
            )
        for mode, label in (("full", "full + frozen_copy"), ("lora", "LoRA + disable_adapter")):
            if f"naive_minus_lean_{mode}_bytes" in s:
                lines.append(
                    f"- Naive logprobs, {label}: {mb_diff(s[f'naive_minus_lean_{mode}_bytes'])} MB of peak "
                    f"({s[f'naive_minus_lean_{mode}_x_logits']:.2f} x one optimizer step's logits; "
                    f"naive / lean peak extra {s[f'naive_vs_lean_{mode}_peak_extra']:.2f})."
                )
        if defaults:
            pinned = {r["case"]: r for r in rows if not r.get("skipped")}
            lines += [
                "",
                "The same cases under glibc's default malloc settings (what `top` shows; allocator retention "
                "included):",
                "",
                "| case | peak extra MB, glibc defaults | peak extra MB, pinned threshold | defaults - pinned MB "
                "| held after MB, glibc defaults |",
                "|---|---:|---:|---:|---:|",
            ]
            for r in defaults:
                if r.get("skipped"):
                    lines.append(f"| {r['label']} | {r['skipped']} | | | |")
                    continue
                ref = pinned.get(r["case"])
                lines.append(
                    f"| {r['label']} | {mb(r['peak_extra'])} | {mb(ref['peak_extra']) if ref else '-'} "
                    f"| {mb_diff(r['peak_extra'] - ref['peak_extra']) if ref else '-'} | {mb(r['held_extra'])} |"
                )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,llama-168m", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument(
        "--cases", default=None, help=f"comma-separated, of {', '.join(c.key for c in CASES)} (default: all)"
    )
    p.add_argument("--quick", action="store_true", help="the tiny model only: a smoke test")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads in the workers (default 1)")
    p.add_argument(
        "--default-malloc-cases",
        default=",".join(DEFAULT_MALLOC_CASES),
        help="cases measured again under glibc's default malloc settings (default: %(default)s; '' for none)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    p.add_argument("--output", type=Path, default=None, help="markdown report (a .json is written next to it)")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "CASE_KEY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.threads)))
        return 0

    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    cases = CASES
    if args.cases:
        names = [c.strip() for c in args.cases.split(",") if c.strip()]
        cases = [c for c in CASES if c.key in names]
        if len(cases) != len(names):
            p.error(f"unknown case(s) in {names}; known: {[c.key for c in CASES]}")
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    results = []
    default_cases = [c.strip() for c in args.default_malloc_cases.split(",") if c.strip()]
    plan = [(m, c, True) for m in models for c in cases]
    plan += [(m, c, False) for m in models for c in cases if c.key in default_cases]
    for model, case, pinned in plan:
        need, avail = _estimated_need(MODELS[model]), mem_available_bytes()
        if avail is not None and need > avail:
            skipped = f"skipped: needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"
            results.append(
                {
                    "model": model,
                    "case": case.key,
                    "label": case.name,
                    "malloc": "pinned" if pinned else "default",
                    "skipped": skipped,
                }
            )
            continue
        r = run_case(model, case, args.threads, args.timeout, pinned=pinned)
        results.append(r)
        print(
            f"{model:>11} | {case.name:<42} {r['malloc']:>7} malloc: peak extra {r['peak_extra'] / MB:8,.0f} MB, "
            f"set-up {r['setup_extra'] / MB:6,.0f} MB, {r['step_s']:.1f} s",
            flush=True,
        )
    ratios = summarize([r for r in results if r.get("malloc") == "pinned"])
    import torch

    header = {
        **run_header("trainer_memory.py", argv),
        "torch": torch.__version__,
        "quick": args.quick,
        "elapsed_s": time.perf_counter() - began,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "models": {m: asdict(MODELS[m]) for m in models},
    }
    payload = {"header": header, "results": results, "ratios": ratios}
    write_report(args.output, render(results, ratios, header), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
