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
import datetime as _dt
import gc
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from harness.report import code_line, load_prose, machine_line
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_offpolicy.correction import PRESETS, PolicyLossConfig, compute_correction, policy_loss
from lightning_offpolicy.correction.fused import FusedCorrectionStep
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics

MiB = 1024.0 * 1024.0

#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]


# ------------------------------------------------------------------------------------ inputs
@dataclass
class Inputs:
    prox: torch.Tensor
    rollout: torch.Tensor
    logprobs: torch.Tensor  # not a leaf yet; each case clones it into its own leaf
    mask: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor


def make_inputs(batch: int, seq_len: int, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.randn(batch, seq_len, generator=gen).abs() * 2.0
    rollout = prox + 0.05 * torch.randn(batch, seq_len, generator=gen)
    low = max(1, seq_len // 8)
    lengths = torch.randint(low, seq_len + 1, (batch,), generator=gen)
    lengths[0] = seq_len
    if batch > 1:
        lengths[-1] = 1
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).float()
    # A few large outliers inside the responses (~1 per 2 rows).
    n_out = max(1, batch // 2)
    rows = torch.randint(0, batch, (n_out,), generator=gen)
    cols = (torch.rand(n_out, generator=gen) * lengths[rows].float()).long().clamp(max=seq_len - 1)
    size = 4.0 + 8.0 * torch.rand(n_out, generator=gen)
    sign = torch.where(torch.rand(n_out, generator=gen) < 0.5, -1.0, 1.0)
    rollout[rows, cols] += sign * size
    logprobs = prox + 0.01 * torch.randn(batch, seq_len, generator=gen)
    nan = torch.tensor(float("nan"))
    valid = mask.bool()
    prox, rollout, logprobs = (torch.where(valid, t, nan) for t in (prox, rollout, logprobs))
    advantages = torch.randn(batch, generator=gen)
    return Inputs(prox, rollout, logprobs, mask, advantages, lengths)


# ------------------------------------------------------------------------------------ one case
class Case:
    """One preset: its config, its metric objects, its own logprobs leaf, and a timed step."""

    path = "eager"

    def __init__(self, name: str, inputs: Inputs, loss_cfg: PolicyLossConfig) -> None:
        self.name = name
        self.cfg = PRESETS[name]()
        self.inputs = inputs
        self.loss_cfg = loss_cfg
        # pi_prox, or in bypass mode with a mask the current policy's logprobs (the leaf's values).
        self.prox = self.cfg.ratio_numerator(inputs.prox, inputs.logprobs)
        self.leaf = inputs.logprobs.clone().requires_grad_(True)
        self.corr_metrics = CorrectionMetrics(self.cfg)
        self.loss_metrics = PolicyLossMetrics()
        self.times: list[tuple[float, float, float]] = []
        self.last_loss = float("nan")

    @property
    def key(self) -> str:
        return f"{self.path}:{self.name}"

    def step(self) -> tuple[float, float, float]:
        x = self.inputs
        t0 = time.perf_counter()
        out = compute_correction(self.prox, x.rollout, x.mask, self.cfg)
        t1 = time.perf_counter()
        loss, info = policy_loss(self.leaf, self.prox, x.rollout, x.advantages, x.mask, self.loss_cfg, correction=out)
        loss.backward()
        t2 = time.perf_counter()
        self.corr_metrics.update(stats=out.stats)
        self.loss_metrics.update(info=info)
        t3 = time.perf_counter()
        self.last_loss = float(loss.detach())
        return t1 - t0, t2 - t1, t3 - t2

    def reset(self) -> None:
        """Untimed bookkeeping between steps."""
        self.leaf.grad = None
        self.corr_metrics.reset()
        self.loss_metrics.reset()

    def check_finite(self) -> list[str]:
        """NaN padding must never leak: the loss, the gradient and every metric stay finite."""
        problems = []
        self.reset()
        self.step()
        if not math.isfinite(self.last_loss):
            problems.append(f"loss={self.last_loss}")
        grad = self.leaf.grad
        if grad is None:
            problems.append("no gradient reached logprobs")
        elif not torch.isfinite(grad).all():
            problems.append("non-finite gradient")
        values = {**self.corr_metrics.compute(), **self.loss_metrics.compute()}
        bad = [k for k, v in values.items() if not torch.isfinite(v).all()]
        if bad:
            problems.append("non-finite metrics: " + ", ".join(bad))
        self.reset()
        return problems


class FusedCase(Case):
    """The same step through :class:`FusedCorrectionStep` (``torch.compile`` of correction, loss
    and metric sums); the metrics are fed from the sums computed inside the graph."""

    path = "fused"

    def __init__(self, name: str, inputs: Inputs, loss_cfg: PolicyLossConfig) -> None:
        super().__init__(name, inputs, loss_cfg)
        self.fused = FusedCorrectionStep(self.cfg, loss_cfg, statistics=self.corr_metrics.sums)
        self.fell_back = False

    def step(self) -> tuple[float, float, float]:
        x = self.inputs
        t0 = time.perf_counter()
        out = self.fused(self.leaf, self.prox, x.rollout, x.advantages, x.mask)
        out.loss.backward()
        t1 = time.perf_counter()
        self.corr_metrics.update_from_sums(out.statistics)
        self.loss_metrics.update(info=out.info)
        t2 = time.perf_counter()
        self.fell_back |= not out.compiled
        self.last_loss = float(out.loss.detach())
        return 0.0, t1 - t0, t2 - t1

    def check_finite(self) -> list[str]:
        problems = super().check_finite()
        return problems + (["the compiled graph was not used (eager fallback)"] if self.fell_back else [])


def one_pass_bytes(case: Case) -> int:
    """The least a step must move: its [B, T] inputs read once and the gradient written once."""
    x = case.inputs
    tensors = [x.rollout, x.logprobs, x.mask, x.logprobs] + ([case.prox] if case.prox is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors) + x.advantages.numel() * x.advantages.element_size()


# ------------------------------------------------------------------------------------ bytes
_TRANSCENDENTAL_OPS = {"exp", "expm1", "log", "log1p", "sigmoid"}
_NO_DATA_OPS = {"lift_fresh", "detach", "alias", "promote_types", "_local_scalar_dense"}


def _tensor_bytes(t: torch.Tensor) -> int:
    storage_bytes = t.untyped_storage().nbytes()
    view_bytes = t.numel() * t.element_size()
    return min(storage_bytes, view_bytes)


class ByteCounter(TorchDispatchMode):
    """Records the storages every aten op reads and writes (keeps them alive so pointers stay unique)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}
        self.traffic = 0
        self.ops = 0
        self.transcendental = 0  # elements through exp / expm1 / log / sigmoid (a compute-cost count)
        self._alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        for t in ins + outs:
            st = t.untyped_storage()
            self.storages.setdefault(st.data_ptr(), st.nbytes())
        self._alive.extend(ins + outs)
        name = func.overloadpacket.__name__
        if name.rstrip("_") in _TRANSCENDENTAL_OPS:
            self.transcendental += sum(t.numel() for t in outs)
        if not getattr(func, "is_view", False) and name not in _NO_DATA_OPS:
            self.ops += 1
            self.traffic += sum(_tensor_bytes(t) for t in ins + outs)
        return out

    @property
    def distinct(self) -> int:
        return sum(self.storages.values())


def count_bytes(case: Case) -> tuple[int, int, int, int]:
    """(distinct bytes, op-traffic bytes, number of data ops, transcendental elements) of one eager step."""
    case.reset()
    counter = ByteCounter()
    with counter:
        case.step()
    case.reset()
    result = counter.distinct, counter.traffic, counter.ops, counter.transcendental
    counter._alive.clear()
    return result


# ------------------------------------------------------------------------------------ memory
def peak_extra_memory(cases: list[Case]) -> dict[str, int]:
    """Peak bytes allocated (and live at once) inside one step of each case.

    One profiler session covers one step of every case, each inside a ``record_function`` range;
    the CPU allocator's allocation events (any thread) are assigned to a case by time.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    for case in cases:
        case.reset()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for case in cases:
            with record_function(f"bench_step::{case.key}"):
                case.step()
            case.reset()
    ranges: dict[str, tuple[int, int]] = {}
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        elif node.name.startswith("bench_step::"):
            ranges[node.name.split("::", 1)[1]] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    allocations.sort(key=lambda e: e[0])
    peaks = {}
    for case in cases:
        begin, finish = ranges[case.key]
        live: dict[int, int] = {}
        current = peak = 0
        for when, size, ptr in allocations:
            if when < begin or when > finish:
                continue
            if size > 0:
                live[ptr] = size
                current += size
                peak = max(peak, current)
            elif ptr in live:  # a free of a block allocated inside the step
                current -= live.pop(ptr)
        peaks[case.key] = peak
    return peaks


# ------------------------------------------------------------------------------------ bandwidth
def _llc_bytes() -> int:
    for index in range(4, -1, -1):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
        return int(text.rstrip("KMG")) * scale
    return 32 * 1024**2


class BandwidthProbe:
    """``torch.add(a, b, out=c)`` over [B, T] float32: hot (same tensors) and streaming (distinct)."""

    def __init__(self, batch: int, seq_len: int, stream: bool = True) -> None:
        self.bytes_per_add = 3 * 4 * batch * seq_len
        self.a = torch.rand(batch, seq_len)
        self.b = torch.rand(batch, seq_len)
        self.c = torch.empty(batch, seq_len)
        self.hot: list[float] = []
        self.stream: list[float] = []
        self.exp: list[float] = []  # torch.exp(a, out=c): one transcendental per element, hot tensors
        self.pool = None
        if stream:
            n = max(4, math.ceil(4 * _llc_bytes() / self.bytes_per_add))
            self.pool = [
                (torch.rand(batch, seq_len), torch.rand(batch, seq_len), torch.empty(batch, seq_len)) for _ in range(n)
            ]

    def measure(self, reps: int = 20) -> None:
        a, b, c = self.a, self.b, self.c
        torch.add(a, b, out=c)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.add(a, b, out=c)
            samples.append(time.perf_counter() - t0)
        self.hot.append(statistics.median(samples))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.exp(a, out=c)
            samples.append(time.perf_counter() - t0)
        self.exp.append(statistics.median(samples))
        if self.pool:
            t0 = time.perf_counter()
            for pa, pb, pc in self.pool:
                torch.add(pa, pb, out=pc)
            self.stream.append((time.perf_counter() - t0) / len(self.pool))

    def exp_over_add(self) -> float:
        """How many add passes one exp pass over the same tensors costs (compute, not memory)."""
        return statistics.median(self.exp) / statistics.median(self.hot) if self.exp and self.hot else float("nan")

    def bandwidth(self, kind: str) -> float:
        samples = self.hot if kind == "hot" else self.stream
        return self.bytes_per_add / statistics.median(samples) if samples else float("nan")


# ------------------------------------------------------------------------------------ run one size
@dataclass
class Row:
    preset: str
    total: float
    iqr: float
    fastest: float
    correction: float
    loss: float
    metrics: float
    distinct: int
    traffic: int
    ops: int
    peak: int
    hot_ratio: float = float("nan")
    stream_ratio: float = float("nan")
    bound_hot: float = float("nan")
    alias_of: str | None = None  # an earlier preset with an equal config (a free noise estimate)
    transcendental: int = 0  # elements through exp / expm1 / log / sigmoid in one eager step


@dataclass
class FusedRow:
    """One preset through ``FusedCorrectionStep``, against one memory-bound pass of its inputs."""

    preset: str
    total: float
    iqr: float
    fastest: float
    peak: int
    one_pass: int  # bytes: the [B, T] inputs read once and the gradient written once
    eager_total: float
    one_pass_hot: float = float("nan")  # seconds for one_pass bytes at the hot probe's bandwidth
    hot_ratio: float = float("nan")
    stream_ratio: float = float("nan")
    eager_hot_ratio: float = float("nan")  # the eager step against the same one pass


@dataclass
class SizeResult:
    batch: int
    seq_len: int
    rows: list[Row]
    bw_hot: float
    bw_stream: float
    rounds: int
    warmup: int
    seconds: float
    problems: dict[str, list[str]] = field(default_factory=dict)
    load: tuple[float, float] = (float("nan"), float("nan"))  # 1-min load average before / after the rounds
    cpu_per_wall: float = float("nan")  # this process's CPU seconds per wall second during the rounds
    fused_rows: list[FusedRow] = field(default_factory=list)
    exp_over_add: float = float("nan")  # one torch.exp pass / one torch.add pass over [B, T], same run


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
def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"


def _share(res: SizeResult, stage: str) -> float:
    return statistics.median(getattr(r, stage) / (r.correction + r.loss + r.metrics) for r in res.rows)


def render_table(res: SizeResult) -> str:
    unit = 4 * res.batch * res.seq_len  # one [B, T] float32 tensor
    head = (
        "| preset | step ms (median) | IQR ms | min step ms | correction ms | loss f+b ms | metrics ms "
        "| distinct MiB (x [B,T] f32) | op traffic MiB | data ops | bound ms (hot) "
        "| x bound (hot) | x bound (stream) | peak extra MiB (x [B,T] f32) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fastest = min(r.total for r in res.rows)
    for r in res.rows:
        lines.append(
            f"| {r.preset} | {r.total * 1e3:.2f} | {r.iqr * 1e3:.2f} | {r.fastest * 1e3:.2f} "
            f"| {r.correction * 1e3:.2f} "
            f"| {r.loss * 1e3:.2f} | {r.metrics * 1e3:.2f} "
            f"| {r.distinct / MiB:.3g} ({r.distinct / unit:.1f}) | {r.traffic / MiB:.3g} | {r.ops} "
            f"| {r.bound_hot * 1e3:.3g} | {_fmt(r.hot_ratio, 1)} | {_fmt(r.stream_ratio, 1)} "
            f"| {r.peak / MiB:.3g} ({r.peak / unit:.1f}) |"
        )
    summary = (
        f"\nB={res.batch}, T={res.seq_len}: {res.rounds} timed rounds after {res.warmup} warm-up rounds, "
        f"{res.seconds:.1f} s for this size. Bandwidth probe (`torch.add`, 12 B/element): "
        f"hot {res.bw_hot / 1e9:.1f} GB/s, stream {_fmt(res.bw_stream / 1e9, 1)} GB/s. "
        f"Fastest step {fastest * 1e3:.2f} ms; slowest/fastest = "
        f"{max(r.total for r in res.rows) / fastest:.2f}. Share of the step (median over presets): "
        f"correction {_share(res, 'correction'):.0%}, loss f+b {_share(res, 'loss'):.0%}, "
        f"metrics {_share(res, 'metrics'):.0%}."
    )
    summary += (
        f" Machine load during the rounds: 1-min load average {_fmt(res.load[0], 1)} -> "
        f"{_fmt(res.load[1], 1)} "
        f"on {os.cpu_count()} CPUs; this process got {res.cpu_per_wall:.2f} CPU-s per wall-s "
        f"({torch.get_num_threads()} intra-op threads)."
    )
    by_name = {r.preset: r for r in res.rows}
    twins = [(by_name[r.alias_of], r) for r in res.rows if r.alias_of is not None]
    if twins:
        summary += (
            " Same config measured twice (noise estimate): "
            + ", ".join(
                f"{a.preset} {a.total * 1e3:.2f} ms vs {b.preset} {b.total * 1e3:.2f} ms ({b.total / a.total:.2f}x)"
                for a, b in twins
            )
            + "."
        )
    noisy = []
    cpus = os.cpu_count() or 1
    if max(res.load) > cpus:
        noisy.append(f"the 1-min load average ({max(res.load):.1f}) exceeded the {cpus} CPUs")
    off = [f"{b.preset}/{a.preset} {b.total / a.total:.2f}x" for a, b in twins if abs(b.total / a.total - 1) > 0.1]
    if off:
        noisy.append("identical configs differ by more than 10% (" + ", ".join(off) + ")")
    if noisy:
        summary += "\n\n**Noisy run**: " + "; ".join(noisy) + ". Other processes competed for the CPUs. "
        if torch.get_num_threads() > 1:
            summary += (
                "With several intra-op threads each op waits for its slowest thread, so contention "
                "inflates times far more than the load suggests: compare `min step ms`, or rerun with "
                "`--threads 1` or on a quiet machine."
            )
        else:
            summary += "Compare `min step ms` and the ratios between presets, or rerun on a quiet machine."
    if res.problems:
        summary += "\n\n**Non-finite results (NaN padding leaked?):** " + "; ".join(
            f"{k}: {', '.join(v)}" for k, v in res.problems.items()
        )
    return "\n".join(lines) + "\n" + summary + "\n"


ONE_PASS_GOAL = 3.0
"""Goal (issue 12, item 3): the fused step within 3x one memory-bound pass over its inputs."""
PEAK_GOAL = 4.0
"""Goal: the fused step's peak extra memory at most 4 [B, T] float32 tensors."""


def render_fused_table(res: SizeResult) -> str:
    """The fused step per preset, against one memory-bound pass and against its eager twin."""
    if not res.fused_rows:
        return ""
    unit = 4 * res.batch * res.seq_len
    exp_pass = res.exp_over_add * 12 * res.batch * res.seq_len / res.bw_hot  # seconds of one torch.exp pass
    transcendental = {r.preset: r.transcendental / (res.batch * res.seq_len) for r in res.rows}
    head = (
        "| preset | fused step ms (median) | IQR ms | min step ms | eager / fused | one pass MiB (x [B,T] f32) "
        "| one pass ms (hot) | x one pass (hot) | x one pass (stream) | eager x one pass (hot) "
        "| exp-type evaluations per token | compute floor, x one pass | peak extra MiB (x [B,T] f32) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in res.fused_rows:
        per_token = transcendental.get(r.preset, float("nan"))
        floor = per_token * exp_pass / r.one_pass_hot
        lines.append(
            f"| {r.preset} | {r.total * 1e3:.2f} | {r.iqr * 1e3:.2f} | {r.fastest * 1e3:.2f} "
            f"| {_fmt(r.eager_total / r.total)} | {r.one_pass / MiB:.3g} ({r.one_pass / unit:.1f}) "
            f"| {r.one_pass_hot * 1e3:.3g} | {_fmt(r.hot_ratio, 1)} | {_fmt(r.stream_ratio, 1)} "
            f"| {_fmt(r.eager_hot_ratio, 1)} | {_fmt(per_token, 1)} | {_fmt(floor, 1)} "
            f"| {r.peak / MiB:.3g} ({r.peak / unit:.1f}) |"
        )
    ratios = [r.hot_ratio for r in res.fused_rows]
    peaks = [r.peak / unit for r in res.fused_rows]
    speedups = [r.eager_total / r.total for r in res.fused_rows if math.isfinite(r.eager_total)]
    met = lambda ok: "met" if ok else "not met"  # noqa: E731
    summary = (
        f"\nFused step (`FusedCorrectionStep`, `torch.compile`), B={res.batch}, T={res.seq_len}: "
        f"{_fmt(min(ratios), 1)}-{_fmt(max(ratios), 1)}x one memory-bound pass (hot) against the goal "
        f"<= {ONE_PASS_GOAL:g}x: **{met(max(ratios) <= ONE_PASS_GOAL)}**; peak extra "
        f"{min(peaks):.1f}-{max(peaks):.1f} [B,T] float32 tensors against the goal <= {PEAK_GOAL:g}: "
        f"**{met(max(peaks) <= PEAK_GOAL)}**"
        + (f"; {statistics.median(speedups):.1f}x faster than eager (median)." if speedups else ".")
        + f" One `torch.exp` pass over [B,T] costs {_fmt(res.exp_over_add, 1)} `torch.add` passes in this run, and "
        "the step evaluates exp / expm1 / log / sigmoid 3-4 times per token (forward, gradient and metrics; counted "
        "in the eager step): `compute floor` is what those evaluations alone cost, in one-pass units, so on this CPU "
        "the step cannot come near one memory-bound pass. The compiled step runs at a few times that floor: the "
        "rest is the generated loops themselves (float64 accumulation of the exact metric sums, some 30 reductions "
        "per pass), not memory traffic."
    )
    return "\n".join(lines) + "\n" + summary + "\n"


def render_report(results: list[SizeResult], argv: list[str], elapsed: float, extra: str = "") -> str:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = " ".join(shlex.quote(a) for a in ["python", "benchmarks/correction_bench.py", *argv])
    llc_mib = _llc_bytes() // 2**20
    parts = [
        "# Off-policy correction: CPU benchmark",
        "",
        f"- **Machine**: {machine_line(f'intra-op threads={torch.get_num_threads()}', f'LLC {llc_mib} MiB')}",
        f"- **Date**: {now}",
        f"- **Code**: {code_line()}",
        f"- **Command**: `{cmd}`",
        f"- **Wall time of the whole run**: {elapsed:.1f} s",
        "",
        "The machine is shared and noisy: compare presets with each other and with the bandwidth",
        "probe of the same run (the ratio columns), not the absolute milliseconds across runs.",
        "",
        "## Method",
        "",
        METHOD,
    ]
    for res in results:
        parts += [f"## B={res.batch}, T={res.seq_len}", "", render_table(res)]
        if res.fused_rows:
            parts += [f"### Fused step, B={res.batch}, T={res.seq_len}", "", render_fused_table(res)]
    if extra:
        parts += [extra]
    return "\n".join(parts).rstrip() + "\n"


def _json_safe(value):
    """NaN / inf -> None, recursively: the .json stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def results_json(results: list[SizeResult], argv: list[str], elapsed: float, profiled: list[str]) -> dict:
    """The measurements behind the report, for tools/summarize.py (the markdown is unchanged)."""
    cmd = " ".join(shlex.quote(a) for a in ["python", "benchmarks/correction_bench.py", *argv])
    header = {
        "machine": machine_line(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code_line(),
        "command": cmd,
        "elapsed_s": elapsed,
        "threads": torch.get_num_threads(),
        "profiled": profiled,
        "goals": {"one_pass": ONE_PASS_GOAL, "peak": PEAK_GOAL},
    }
    return _json_safe({"header": header, "sizes": [asdict(res) for res in results]})


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
