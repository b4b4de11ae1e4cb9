#!/usr/bin/env python
"""Peak memory and time of token logprobs: lean and naive on the logits, fused from the hidden states, on CPU.

One measured step, on ``[1, T, V]`` logits that are a leaf with ``requires_grad``:

* lean:  ``token_logprobs(logits, targets, temperature, chunk_size).sum().backward()``
* naive: ``log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).sum().backward()``

and, with no logits at all, on hidden states ``[1, T, H]`` and a head weight ``[V, H]`` (both leaves
with ``requires_grad``, ``H = --hidden``, default 896 as Qwen2-0.5B):

* fused: ``fused_linear_token_logprobs(hidden, weight, targets, temperature, chunk_size).sum().backward()``

See ``METHOD`` below for how memory is measured (it is written into the report too).

Usage::

    python benchmarks/logprob_memory.py --output docs/reports/performance_logprobs.md   # ~ a few minutes
    python benchmarks/logprob_memory.py --quick --output /tmp/x.md              # smoke test, seconds
    python benchmarks/logprob_memory.py --methods fused --merge-json docs/reports/performance_logprobs.json \
        --output docs/reports/performance_logprobs.md   # re-measure the fused rows only, keep the others
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.memory import mb, mem_available_bytes
from harness.report import code_line, load_prose, machine_line
from logprob_memory_worker import worker

ROOT = Path(__file__).resolve().parent.parent

TEMPERATURE = 0.7

# (vocab, tokens, logits dtype). 151936 is the Qwen2/2.5 vocabulary ("150k"). The 150k x 8k case
# uses bf16 logits: in float32 one logits tensor is 5.0 GB and the naive path would need several.
# 151936 x 4096 in bf16 is there too, in case the naive bf16 path at 8192 tokens (~7 logits
# tensors, ~17.5 GB) does not fit in the memory available and is skipped (see EXPECTED_PEAK).
FULL_CASES = [
    (32000, 2048, "float32"),
    (32000, 8192, "float32"),
    (151936, 2048, "float32"),
    (151936, 4096, "bfloat16"),
    (151936, 8192, "bfloat16"),
]
FULL_CHUNKS = [1024, 256]
QUICK_CASES = [
    (2000, 256, "float32"),
    (4000, 256, "bfloat16"),
]
QUICK_CHUNKS = [16]
#: The fused head runs with the module's default chunk_size only (the chunk is capped at N // 32 by
#: fused_linear_token_logprobs itself).
FUSED_CHUNK = 1024
#: Width of the head: Qwen2-0.5B's (its lm_head weight is 151936 x 896, 272 MB in bf16).
HIDDEN = 896
QUICK_HIDDEN = 32
#: The issue's goal for the fused head: peak extra <= this many logits tensors.
FUSED_GOAL = 0.25
# Rough peak (extra over the baseline, in logits tensors, plus the logits themselves) used to skip a
# case that would not fit in the memory available when it starts, rather than OOM the machine.
EXPECTED_PEAK = {
    ("naive", "float32"): 4.2,
    ("naive", "bfloat16"): 6.5,
    ("lean", "float32"): 2.0,
    ("lean", "bfloat16"): 2.5,
    ("fused", "float32"): 0.6,
    ("fused", "bfloat16"): 0.6,
}

#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]

EXPECTED = PROSE["expected"]


def run_case(
    vocab: int,
    tokens: int,
    dtype: str,
    method: str,
    chunk: int,
    repeats: int,
    timeout: float,
    threads: int,
    hidden: int = HIDDEN,
) -> dict:
    logits_bytes = vocab * tokens * (2 if dtype == "bfloat16" else 4)
    need = (EXPECTED_PEAK[(method, dtype)] + 1.0) * logits_bytes + 1e9
    avail = mem_available_bytes()
    if avail is not None and need > avail:
        return {
            "vocab": vocab, "tokens": tokens, "dtype": dtype, "method": method,
            "chunk_size": chunk if method != "naive" else None, "logits_bytes": logits_bytes,
            "skipped": f"skipped: needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available",
        }  # fmt: skip
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--method", method,
        "--vocab", str(vocab),
        "--tokens", str(tokens),
        "--dtype", dtype,
        "--chunk-size", str(chunk),
        "--repeats", str(repeats),
        "--temperature", str(TEMPERATURE),
        "--threads", str(threads),
        "--hidden", str(hidden),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def render(results: list[dict], header: dict) -> str:
    fused = [r for r in results if r["method"] == "fused"]
    results = [r for r in results if r["method"] != "fused"]
    out = ["# Token logprobs: peak memory and time, lean vs naive vs fused head", ""]
    out += [f"* machine: {header['machine']}", f"* torch: {header['torch']}", f"* date: {header['date']}"]
    if header.get("merged"):
        out.append(f"* {header['merged']}")
    out += [f"* command: `{header['command']}`", f"* temperature: {TEMPERATURE}, batch B = 1, N = T tokens"]
    threads = sorted({r["threads"] for r in results + fused if not r["skipped"]})
    out.append(f"* intra-op threads in the workers: {', '.join(map(str, threads)) or '-'}")
    if header.get("load"):
        out.append(f"* load average at start / end: {header['load']}")
    reps = sorted({len(r["times_s"]) for r in results + fused if not r["skipped"]})
    out.append(f"* timed steps per case (best reported): {', '.join(map(str, reps)) or '-'}")
    by_dtype: dict[str, list[str]] = {}
    for r in results:
        case = f"{r['vocab']} x {r['tokens']}"
        if case not in by_dtype.setdefault(r["dtype"], []):
            by_dtype[r["dtype"]].append(case)
    out.append("* logits dtype: " + "; ".join(f"{d} for {', '.join(c)}" for d, c in by_dtype.items()) + ".")
    if header["quick"]:
        out.append("* `--quick`: smoke-test sizes, memory figures are dominated by noise at this size.")
    elif "bfloat16" in by_dtype:
        out.append(
            "  The large-vocabulary long cases use bf16 logits, as a trainer in bf16 produces them: a "
            "float32 151936 x 8192 logits tensor would be 5.0 GB and the naive path needs three more "
            "float32 copies at its peak."
        )
    if not all(r.get("peak_reset", True) for r in results + fused):
        out.append("* **VmHWM reset unavailable: peaks are lifetime `ru_maxrss` of each subprocess.**")
    out += ["", "## Method", "", METHOD, "## Results", ""]
    out.append(
        "| V | T | logits dtype | one logits tensor (MB) | method | chunk | time fwd+bwd (s, best) "
        "| held after fwd (MB / x logits) | peak fwd extra (x logits) "
        "| peak fwd+bwd extra (MB) | peak extra / one logits tensor | lp sum rel. diff |"
    )
    out.append("|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    naive = {(r["vocab"], r["tokens"], r["dtype"]): r for r in results if r["method"] == "naive"}
    for r in results:
        lb = r["logits_bytes"]
        if r["skipped"]:
            out.append(
                f"| {r['vocab']} | {r['tokens']} | {r['dtype']} | {mb(lb)} | {r['method']} "
                f"| {r['chunk_size'] or '-'} | {r['skipped']} | | | | | |"
            )
            continue
        ref = naive.get((r["vocab"], r["tokens"], r["dtype"]))
        if ref is None or r is ref or ref["skipped"]:
            diff = "-"
        else:
            diff = f"{abs(r['lp_sum'] - ref['lp_sum']) / max(abs(ref['lp_sum']), 1e-30):.1e}"
        out.append(
            f"| {r['vocab']} | {r['tokens']} | {r['dtype']} | {mb(lb)} | {r['method']} "
            f"| {r['chunk_size'] if r['chunk_size'] else '-'} | {r['time_s']:.2f} "
            f"| {mb(r['held_after_fwd'])} / {r['held_after_fwd'] / lb:.2f} | {r['peak_fwd'] / lb:.2f} "
            f"| {mb(r['peak_fwd_bwd'])} | **{r['peak_fwd_bwd'] / lb:.2f}** | {diff} |"
        )
    out += ["", "## Summary", ""]
    out.append(
        "| V | T | logits dtype | lean peak extra (x logits), per chunk size | naive peak extra (x logits) "
        "| naive time / lean time (chunk 1st listed) | fused peak extra (x logits) | fused time / lean time |"
    )
    out.append("|---:|---:|---|---|---:|---:|---:|---:|")
    cases = list(dict.fromkeys((r["vocab"], r["tokens"], r["dtype"]) for r in results + fused))
    fused_by_case = {(r["vocab"], r["tokens"], r["dtype"]): r for r in fused}
    for case in cases:
        lean = [r for r in results if (r["vocab"], r["tokens"], r["dtype"]) == case and r["method"] == "lean"]
        ref = naive.get(case)
        lean_txt = ", ".join(
            f"{r['peak_fwd_bwd'] / r['logits_bytes']:.2f} (chunk {r['chunk_size']})" for r in lean if not r["skipped"]
        )
        if ref is None or ref["skipped"]:
            naive_txt, speed = "not run", "-"
        else:
            naive_txt = f"{ref['peak_fwd_bwd'] / ref['logits_bytes']:.2f}"
            speed = f"{ref['time_s'] / lean[0]['time_s']:.2f}" if lean and not lean[0]["skipped"] else "-"
        f = fused_by_case.get(case)
        if f is None or f["skipped"]:
            fused_txt, fused_speed = "not run", "-"
        else:
            fused_txt = f"{f['peak_fwd_bwd'] / f['logits_bytes']:.2f}"
            fused_speed = f"{f['time_s'] / lean[0]['time_s']:.2f}" if lean and not lean[0]["skipped"] else "-"
        out.append(
            f"| {case[0]} | {case[1]} | {case[2]} | {lean_txt or '-'} | {naive_txt} | {speed} "
            f"| {fused_txt} | {fused_speed} |"
        )
    out += ["", EXPECTED, ""]
    if fused:
        out += render_fused(fused, results)
    return "\n".join(out)


def render_fused(fused: list[dict], others: list[dict]) -> list[str]:
    """The fused-head section: hidden states + head weight -> logprobs, no logits."""
    lean = {
        (r["vocab"], r["tokens"], r["dtype"]): r
        for r in reversed(others)  # the first lean chunk size listed wins
        if r["method"] == "lean" and not r["skipped"]
    }
    out = ["## Fused head (no logits)", ""]
    out.append(
        f"`fused_linear_token_logprobs(hidden [1, T, H], weight [V, H], ...)`, what `causal_lm_token_logprobs` "
        f"runs by default. Goal (issue 12): peak extra <= {FUSED_GOAL}x one `[T, V]` logits tensor of the input "
        "dtype, gradients included."
    )
    out.append("")
    out.append(
        "| V | T | dtype | H | chunk (used) | time fwd+bwd (s, best) | fused / lean time "
        "| held after fwd (MB) | peak fwd extra (x logits) | peak fwd+bwd extra (MB) "
        "| of which grad_hidden + grad_weight (MB) | **peak extra (x logits)** "
        f"| without the grads (x logits) | <= {FUSED_GOAL}x | max abs diff (64 rows) |"
    )
    out.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in fused:
        lb = r["logits_bytes"]
        if r["skipped"]:
            out.append(f"| {r['vocab']} | {r['tokens']} | {r['dtype']} | | | {r['skipped']} | | | | | | | | | |")
            continue
        ref = lean.get((r["vocab"], r["tokens"], r["dtype"]))
        ratio = f"{r['time_s'] / ref['time_s']:.2f}" if ref else "-"
        x = r["peak_fwd_bwd"] / lb
        out.append(
            f"| {r['vocab']} | {r['tokens']} | {r['dtype']} | {r['hidden']} | {r['chunk_size']} ({r['chunk_used']}) "
            f"| {r['time_s']:.2f} | {ratio} | {mb(r['held_after_fwd'])} | {r['peak_fwd'] / lb:.2f} "
            f"| {mb(r['peak_fwd_bwd'])} | {mb(r['grad_bytes'])} | **{x:.2f}** "
            f"| {(r['peak_fwd_bwd'] - r['grad_bytes']) / lb:.2f} | {'yes' if x <= FUSED_GOAL else 'no'} "
            f"| {r['max_abs_diff']:.1e} |"
        )
    out += [
        "",
        'What to expect (docs/logprobs.md, "The fused head"): the chunk is '
        "`c = min(chunk_size, max(64, T // 32))` rows; its temporaries are a float32 `[c, V]` chunk "
        "plus, in the bf16 backward, a `[c, V]` bf16 copy (on CUDA) or a float32 block of the weight "
        "of at most that size (on CPU, where bf16 weights are multiplied in float32 blocks because "
        "CPU bf16 matmuls are slow): `6 c V` bytes for bf16, 0.094x one bf16 logits tensor for "
        "`T >= 2048` (0.125x with the entropy). On CPU the bf16 `grad_weight` accumulation of each "
        "float32 block adds a block-sized temporary and the allocator keeps some freed memory: the "
        "`without the grads` column above 0.094x. On top of that come the gradients "
        "the caller asked for, `grad_hidden` and `grad_weight` (`(T + V) * H` elements, 0.11x at "
        "`V = 151936, T = 8192, H = 896`), which the logits paths return as well. Small `T` (below "
        "`64 * 32`) keeps the 64-row minimum chunk, so the ratio is larger there while the bytes are "
        "small. Nothing of size `T x V` is kept between forward and backward (`held after fwd`: the "
        "`T` log-sum-exps and logprobs).",
        "",
        "The fused time includes the head's four `T x H x V` matmuls (forward, recompute in the "
        "backward, `grad_hidden`, `grad_weight`) that the lean and naive rows (logits given) do not: "
        "the unfused head costs three of them on top of the lean row, so the ratio is not a slowdown "
        "of the logprob; on this CPU the matmuls dominate every fused row.",
        "",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--output", type=Path, help="write the Markdown report here")
    p.add_argument(
        "--json", type=Path, help="also write the raw per-case results here (default: next to --output, .json)"
    )
    p.add_argument("--render-json", type=Path, help="only re-render a report from a --json file")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per case, the best is reported (default 3; quick 1)",
    )
    p.add_argument("--chunk-sizes", type=str, default=None, help="lean chunk sizes, comma separated")
    p.add_argument(
        "--methods", type=str, default="lean,naive,fused", help="methods to run, comma separated (lean, naive, fused)"
    )
    p.add_argument("--hidden", type=int, default=None, help=f"H of the fused head (default {HIDDEN}; quick 32)")
    p.add_argument(
        "--merge-json",
        type=Path,
        help="keep the rows of the methods not run now from this earlier --json (the header says so)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="subprocesses run at once (default 1; quick: all, timings are then meaningless)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads in the workers (default: torch's default; quick: 1)",
    )
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", choices=["lean", "naive", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dtype", type=str, help=argparse.SUPPRESS)
    p.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--temperature", type=float, default=TEMPERATURE, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.render_json:  # re-render a saved run (no measurement)
        data = json.loads(args.render_json.read_text())
        report = render(data["results"], data["header"])
        if args.output:
            args.output.write_text(report)
        else:
            print(report)
        return 0

    if args.worker:
        args.repeats = args.repeats or 1
        print(json.dumps(worker(args)))
        return 0

    import torch

    cases = QUICK_CASES if args.quick else FULL_CASES
    chunks = (
        [int(c) for c in args.chunk_sizes.split(",")]
        if args.chunk_sizes
        else (QUICK_CHUNKS if args.quick else FULL_CHUNKS)
    )
    repeats = args.repeats or (1 if args.quick else 2)
    threads = args.threads if args.threads is not None else (1 if args.quick else 0)
    results = []
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    t_start = time.perf_counter()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - {"lean", "naive", "fused"}:
        p.error(f"--methods: lean, naive and/or fused, got {args.methods!r}")
    width = args.hidden or (QUICK_HIDDEN if args.quick else HIDDEN)
    per_case = [("lean", c) for c in chunks if "lean" in methods] + [("naive", 0)] * ("naive" in methods)
    per_case += [("fused", FUSED_CHUNK)] * ("fused" in methods)
    plan = [(vocab, tokens, dtype, method, chunk) for vocab, tokens, dtype in cases for method, chunk in per_case]
    jobs = args.jobs or (len(plan) if args.quick else 1)

    def one(item):
        vocab, tokens, dtype, method, chunk = item
        r = run_case(vocab, tokens, dtype, method, chunk or 1024, repeats, args.timeout, threads, width)
        if r["skipped"]:
            print(f"V={vocab:>6} T={tokens:>5} {dtype:>8} {method:>5}: {r['skipped']}", flush=True)
        else:
            print(
                f"V={vocab:>6} T={tokens:>5} {dtype:>8} {method:>5} chunk={chunk or '-':>4}: "
                f"{r['time_s']:.2f} s, peak extra {r['peak_fwd_bwd'] / 1e6:,.0f} MB = "
                f"{r['peak_fwd_bwd'] / r['logits_bytes']:.2f} x logits",
                flush=True,
            )
        return r

    if jobs > 1:  # quick mode: the subprocesses are independent; their RSS figures stay per process
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(one, plan))
    else:
        results = [one(item) for item in plan]
    header = {
        "machine": machine_line(),
        "torch": torch.__version__,
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": "python "
        + " ".join(
            shlex.quote(a) for a in [os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])
        ),
        "quick": args.quick,
        "load": f"{load0[0]:.1f} / {os.getloadavg()[0]:.1f} (1-min)" if load0 else "",
    }
    if args.merge_json:
        old = json.loads(args.merge_json.read_text())
        kept = [r for r in old["results"] if r["method"] not in methods]
        order = {"lean": 0, "naive": 1, "fused": 2}
        case_order = {
            c: i for i, c in enumerate(dict.fromkeys((r["vocab"], r["tokens"], r["dtype"]) for r in kept + results))
        }
        results = sorted(
            kept + results, key=lambda r: (case_order[(r["vocab"], r["tokens"], r["dtype"])], order[r["method"]])
        )
        old_methods = sorted({r["method"] for r in kept}, key=order.get)
        header["merged"] = (
            f"rows of {', '.join(old_methods) or 'no method'} from the run of {old['header']['date']} "
            f"(`{old['header']['command']}`, load {old['header'].get('load') or '-'}); "
            f"{', '.join(methods)} measured now (`--merge-json`)"
        )
    elapsed = time.perf_counter() - t_start
    report = render(results, header)
    print(f"total {elapsed:.0f} s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report)
        print(f"wrote {args.output}")
    else:
        print(report)
    json_path = args.json or (args.output.with_suffix(".json") if args.output else None)
    if json_path:  # render() ignores the extra header keys: the markdown is unchanged
        extra = {"elapsed_s": elapsed, "code": code_line()}
        json_path.write_text(json.dumps({"header": {**header, **extra}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
