#!/usr/bin/env python
"""Benchmark of the off-policy correction path on CPU, one row per correction preset.

One *step* is what ``OffPolicyRLModule.training_step`` does per micro-batch besides the model:

1. ``compute_correction(prox, rollout, mask, cfg)``                       (column ``correction``)
2. ``policy_loss(logprobs, prox, rollout, adv, mask, correction=out)`` and
   ``loss.backward()`` into ``logprobs`` (a leaf with ``requires_grad``) (column ``loss f+b``)
3. ``CorrectionMetrics.update(stats=...)`` + ``PolicyLossMetrics.update(info=...)`` (column ``metrics``)

Presets whose config does not need the proximal forward (``bypass``, ``pure_is``) get
``prox_logprobs=None``, as the trainer would pass them.

What is measured, per preset, on ``[B, T]`` inputs (see ``METHOD`` below for the details that are
also written into the report):

* time: median over ``--repeats`` rounds after warm-up; rounds visit the presets in a fresh
  random order and each round also times the bandwidth probe, so slow drifts of a shared
  machine hit every preset alike. Ratios between presets, and to the probe, are the numbers to
  read; absolute milliseconds are this machine at this moment.
* bytes touched: counted, not guessed, by running one step under a ``TorchDispatchMode`` that
  sees every aten op of the forward, the backward and the metric updates. ``distinct`` is the
  sum of the sizes of the distinct storages read or written (the inputs, every intermediate and
  every output, each once); ``op traffic`` adds input + output bytes of every non-view op (what
  the unfused eager pipeline moves if nothing stays in cache).
* ratio to a memory-bandwidth bound: ``t_step / (distinct_bytes / BW)``, where ``BW`` is
  measured in the same rounds from ``torch.add(a, b, out=c)`` over ``[B, T]`` float32 tensors
  (3 tensors moved). ``hot`` repeats the add on the same three tensors (they stay in cache at
  T=4096), ``stream`` walks a pool of distinct tensors larger than the last-level cache.
* peak extra memory: ``torch.profiler`` with ``profile_memory=True`` records every CPU allocator
  allocation and free of one step; the running sum of the bytes allocated inside the step
  (frees of older tensors ignored) gives its peak. This is what the allocator handed out,
  intermediates inside an op included, not an RSS estimate.

Usage::

    python benchmarks/correction_bench.py                      # B=64, T=4096, every preset
    python benchmarks/correction_bench.py --full               # + T=16384
    python benchmarks/correction_bench.py --quick --output /tmp/x.md   # smoke test, seconds
    python benchmarks/correction_bench.py --presets token_tis,geo_mis --profile geo_mis
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from correction_cases import Case, FusedCase, make_inputs, one_pass_bytes
from correction_probes import BandwidthProbe, count_bytes, peak_extra_memory
from correction_report import FusedRow, Row, SizeResult, render_fused_table, render_report, render_table, results_json

from lightning_offpolicy.correction import PRESETS, PolicyLossConfig


# ------------------------------------------------------------------------------------ run one size
def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def run_size(
    names: list[str],
    batch: int,
    seq_len: int,
    repeats: int,
    warmup: int,
    stream: bool,
    seed: int,
    log,
    fused_names: list[str] = (),
) -> SizeResult:
    start = time.perf_counter()
    inputs = make_inputs(batch, seq_len, seed)
    loss_cfg = PolicyLossConfig()
    eager_cases = [Case(n, inputs, loss_cfg) for n in names]
    if fused_names:
        log(f"[B={batch} T={seq_len}] compiling the fused step of {len(fused_names)} presets ...")
    fused_cases = [FusedCase(n, inputs, loss_cfg) for n in fused_names]
    cases = eager_cases + fused_cases
    probe = BandwidthProbe(batch, seq_len, stream=stream)

    problems = {}
    for case in cases:
        bad = case.check_finite()
        if bad:
            problems[case.key] = bad
    log(f"[B={batch} T={seq_len}] warm-up x{warmup} ...")
    for _ in range(warmup):
        for case in cases:
            case.step()
            case.reset()
        probe.measure(reps=5)
    probe.hot.clear()
    probe.stream.clear()
    probe.exp.clear()

    rng = random.Random(seed)
    order = list(cases)
    log(f"[B={batch} T={seq_len}] {repeats} timed rounds over {len(cases)} presets ...")
    gc.collect()
    load_before = _loadavg()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    gc.disable()
    try:
        for r in range(repeats):
            rng.shuffle(order)
            probe.measure()
            for case in order:
                case.times.append(case.step())
                case.reset()
            if (r + 1) % max(1, repeats // 5) == 0:
                gc.enable()
                gc.collect()
                gc.disable()
                log(f"  round {r + 1}/{repeats}")
    finally:
        gc.enable()
    cpu_per_wall = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    load_after = _loadavg()

    log(f"[B={batch} T={seq_len}] counting bytes and peak memory ...")
    peaks = peak_extra_memory(cases)
    rows = []
    for case in eager_cases:
        totals = [sum(t) for t in case.times]
        q1, q3 = _quartiles(totals)
        distinct, traffic, ops, transcendental = count_bytes(case)
        rows.append(
            Row(
                preset=case.name,
                total=statistics.median(totals),
                iqr=q3 - q1,
                fastest=min(totals),
                correction=statistics.median(t[0] for t in case.times),
                loss=statistics.median(t[1] for t in case.times),
                metrics=statistics.median(t[2] for t in case.times),
                distinct=distinct,
                traffic=traffic,
                ops=ops,
                peak=peaks[case.key],
                alias_of=next((c.name for c in eager_cases[: eager_cases.index(case)] if c.cfg == case.cfg), None),
                transcendental=transcendental,
            )
        )
    bw_hot, bw_stream = probe.bandwidth("hot"), probe.bandwidth("stream")
    for row in rows:
        row.bound_hot = row.distinct / bw_hot
        row.hot_ratio = row.total / row.bound_hot
        row.stream_ratio = row.total / (row.distinct / bw_stream) if stream else float("nan")
    eager_total = {row.preset: row.total for row in rows}
    fused_rows = []
    for case in fused_cases:
        totals = [sum(t) for t in case.times]
        q1, q3 = _quartiles(totals)
        one_pass = one_pass_bytes(case)
        row = FusedRow(
            preset=case.name,
            total=statistics.median(totals),
            iqr=q3 - q1,
            fastest=min(totals),
            peak=peaks[case.key],
            one_pass=one_pass,
            eager_total=eager_total.get(case.name, float("nan")),
            one_pass_hot=one_pass / bw_hot,
        )
        row.hot_ratio = row.total / row.one_pass_hot
        row.stream_ratio = row.total / (one_pass / bw_stream) if stream else float("nan")
        row.eager_hot_ratio = row.eager_total / row.one_pass_hot
        fused_rows.append(row)
    return SizeResult(
        batch,
        seq_len,
        rows,
        bw_hot,
        bw_stream,
        repeats,
        warmup,
        time.perf_counter() - start,
        problems,
        (load_before, load_after),
        cpu_per_wall,
        fused_rows,
        probe.exp_over_add(),
    )


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# ------------------------------------------------------------------------------------ report
# ------------------------------------------------------------------------------------ profile
def profile_preset(name: str, batch: int, seq_len: int, seed: int, top: int = 15) -> str:
    """Top aten ops by self CPU time over a few steps of one preset."""
    from torch.profiler import ProfilerActivity, profile

    case = Case(name, make_inputs(batch, seq_len, seed), PolicyLossConfig())
    for _ in range(3):
        case.step()
        case.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            case.step()
            case.reset()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return f"### Profile: {name} (B={batch}, T={seq_len}, 5 steps)\n\n```\n{table}\n```\n"


# ------------------------------------------------------------------------------------ CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64, help="B (default 64)")
    p.add_argument("--seq-len", type=int, default=4096, help="T (default 4096)")
    p.add_argument("--long-seq-len", type=int, default=16384, help="T of the long run (default 16384)")
    p.add_argument(
        "--long",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run T=--long-seq-len (default: on with --full, off otherwise)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 30; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 3; 1 with --quick)")
    p.add_argument(
        "--presets", type=str, default=None, help=f"comma list (default: all of PRESETS: {','.join(PRESETS)})"
    )
    p.add_argument(
        "--fused",
        type=str,
        default=None,
        help="presets also run through FusedCorrectionStep (torch.compile): 'all' (default), 'none' or a "
        "comma list (--quick: token_tis,geo_mis_seq_tis)",
    )
    p.add_argument("--full", action="store_true", help="full run: adds the long sequence length")
    p.add_argument("--quick", action="store_true", help="smoke test: B=4, T=128, 1 round, no streaming probe (seconds)")
    p.add_argument("--no-stream", action="store_true", help="skip the streaming bandwidth probe")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--profile",
        type=str,
        default=None,
        help="comma list of presets to profile (top ops by self CPU time), or 'auto' for the "
        "slowest and the fastest; appended to the report",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write the Markdown report here")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.seq_len = 4, 128
        args.repeats = 1 if args.repeats is None else args.repeats
        args.warmup = 1 if args.warmup is None else args.warmup
        args.no_stream = True
        if args.long is None:
            args.long = False
    args.repeats = 30 if args.repeats is None else args.repeats
    args.warmup = 3 if args.warmup is None else args.warmup
    if args.long is None:
        args.long = args.full
    names = list(PRESETS)
    if args.presets is not None:
        names = [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(PRESETS)}")
    args.names = names
    fused = args.fused if args.fused is not None else ("token_tis,geo_mis_seq_tis" if args.quick else "all")
    if fused.strip() == "all":
        args.fused_names = list(names)
    elif fused.strip() == "none":
        args.fused_names = []
    else:
        args.fused_names = [n.strip() for n in fused.split(",") if n.strip()]
        bad = [n for n in args.fused_names if n not in PRESETS]
        if bad:
            p.error(f"--fused: unknown preset(s) {', '.join(bad)}; known: {', '.join(PRESETS)}")
    if args.profile and args.profile.strip() != "auto":
        bad = [n for n in args.profile.split(",") if n.strip() and n.strip() not in PRESETS]
        if bad:
            p.error(f"--profile: unknown preset(s) {', '.join(bad)}")
    if args.repeats < 1 or args.batch < 1 or args.seq_len < 1:
        p.error("--repeats, --batch and --seq-len must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    sizes = [args.seq_len] + ([args.long_seq_len] if args.long and args.long_seq_len != args.seq_len else [])
    results = []
    for seq_len in sizes:
        res = run_size(
            args.names,
            args.batch,
            seq_len,
            args.repeats,
            args.warmup,
            stream=not args.no_stream,
            seed=args.seed,
            log=log,
            fused_names=args.fused_names,
        )
        results.append(res)
        print(f"\nB={res.batch} T={res.seq_len}\n" + render_table(res) + render_fused_table(res), flush=True)
    extra = ""
    wanted: list[str] = []
    if args.profile:
        wanted = [n.strip() for n in args.profile.split(",") if n.strip()]
        if wanted == ["auto"]:  # the slowest and the fastest preset of the first size
            ranked = sorted(results[0].rows, key=lambda r: r.total)
            wanted = list(dict.fromkeys([ranked[-1].preset, ranked[0].preset]))
        log(f"profiling {', '.join(wanted)} ...")
        profiles = [profile_preset(n, args.batch, args.seq_len, args.seed) for n in wanted]
        extra = "## Profiles\n\n" + "\n".join(profiles)
        print(extra)
    elapsed = time.perf_counter() - t0
    log(f"total {elapsed:.1f} s")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(render_report(results, argv, elapsed, extra))
        # The same measurements as JSON next to the report (times in seconds, bytes in bytes).
        json_path = args.output.with_suffix(".json")
        json_path.write_text(json.dumps(results_json(results, argv, elapsed, wanted), indent=1) + "\n")
        log(f"wrote {args.output} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
