"""The correction benchmark's results and its report: tables, goals, JSON."""

from __future__ import annotations

import datetime as _dt
import math
import os
import shlex
import statistics
from dataclasses import asdict, dataclass, field

import torch
from correction_probes import _llc_bytes
from harness.report import code_line, load_prose, machine_line

MiB = 1024.0 * 1024.0


#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]


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
"""Goal: the fused step within 3x one memory-bound pass over its inputs."""
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
