"""The mismatch study's summaries and outputs: statistics, tables, plots and the markdown report."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared harness
from harness.report import load_prose  # noqa: E402
from mismatch_conditions import KL_BAND, TASKS, Condition  # noqa: E402
from mismatch_runs import VERSION_KL_KEY  # noqa: E402

#: Collapse: the trailing moving average over this many batches ...
COLLAPSE_WINDOW = 20
#: ... stays, to the end of the run, below the initial reward minus this margin ...
COLLAPSE_REWARD_DROP = 0.1
#: ... (initial reward: the mean over the first this many batches) ...
INITIAL_BATCHES = 10
#: ... or the moving average of the entropy stays below this value.
COLLAPSE_ENTROPY = 0.02

COLLAPSE_DEFINITION = (
    f"a run collapses at the first batch b from which, until the end of the run, the {COLLAPSE_WINDOW}-batch "
    f"trailing moving average of `train/reward` stays below the run's initial reward (mean of its first "
    f"{INITIAL_BATCHES} batches) minus {COLLAPSE_REWARD_DROP}, or the {COLLAPSE_WINDOW}-batch moving average of "
    f"`train/entropy` stays below {COLLAPSE_ENTROPY}"
)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average; the first ``window - 1`` entries average what is there."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def collapse_step(reward: Sequence[float], entropy: Sequence[float]) -> int | None:
    """First batch from which the run stays collapsed to its end (see ``COLLAPSE_DEFINITION``), else None."""
    if len(reward) < COLLAPSE_WINDOW:
        return None
    threshold = statistics.fmean(reward[:INITIAL_BATCHES]) - COLLAPSE_REWARD_DROP
    reward_ma = moving_average(reward, COLLAPSE_WINDOW)
    entropy_ma = moving_average(entropy, COLLAPSE_WINDOW) if entropy else [math.inf] * len(reward)
    first = None
    # Walk back from the end while the run is collapsed; only full windows count.
    for b in range(len(reward) - 1, COLLAPSE_WINDOW - 2, -1):
        if reward_ma[b] < threshold or entropy_ma[b] < COLLAPSE_ENTROPY:
            first = b
        else:
            break
    return first


def final_window(n: int) -> int:
    """Batches in the 'final' window: the last 10% of the run (at least one)."""
    return max(1, round(n / 10))


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    series = run["series"]
    reward = series["train/reward"]
    entropy = series.get("train/entropy", [])
    summary: dict[str, Any] = {
        "final_reward": statistics.fmean(reward[-final_window(len(reward)) :]),
        "auc_reward": statistics.fmean(reward),
        "initial_reward": statistics.fmean(reward[:INITIAL_BATCHES]),
        "final_entropy": statistics.fmean(entropy[-final_window(len(entropy)) :]) if entropy else math.nan,
        "collapse_step": collapse_step(reward, entropy),
    }
    for key, values in series.items():
        if key.startswith(("rollout_corr/", "staleness/", "policy/", "perf/")):
            finite = [v for v in values if math.isfinite(v)]
            summary[f"{key}:mean"] = statistics.fmean(finite) if finite else math.nan
            summary[f"{key}:max"] = max(finite) if finite else math.nan
    return summary


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize_condition(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for run in runs for k in run["summary"] if k != "collapse_step"})
    out: dict[str, Any] = {"seeds": [run["seed"] for run in runs]}
    for key in keys:
        mean, std = mean_std([run["summary"].get(key, math.nan) for run in runs])
        out[key] = {"mean": mean, "std": std}
    out["collapse_steps"] = [run["summary"]["collapse_step"] for run in runs]
    return out


#: Two-sided 95% Student-t quantiles by degrees of freedom (a few seeds: the normal 1.96 would be too narrow).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_delta(runs: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str) -> tuple[float, float, int]:
    """``key`` minus the baseline's ``key`` with the same seed (paired runs): mean, 95% CI half-width, n."""
    base = {run["seed"]: run["summary"][key] for run in baseline}
    deltas = [run["summary"][key] - base[run["seed"]] for run in runs if run["seed"] in base]
    deltas = [d for d in deltas if math.isfinite(d)]
    if not deltas:
        return math.nan, math.nan, 0
    n = len(deltas)
    half = T95.get(n - 1, 1.96) * statistics.stdev(deltas) / math.sqrt(n) if n > 1 else math.nan
    return statistics.fmean(deltas), half, n


def fmt_delta(mean: float, half: float) -> str:
    """``+0.012 [-0.004, +0.028]``: the mean and its 95% CI; bold when the CI excludes 0."""
    if not math.isfinite(mean):
        return "n/a"
    if not math.isfinite(half):
        return f"{mean:+.3f}"
    text = f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"
    return f"**{text}**" if abs(mean) > half else text


def reject_key(keys: Sequence[str]) -> str | None:
    """The summary's reject-rate key: the union of the masks (``total_seq_reject_rate``) when a mask is on."""
    has_mask = any(k.endswith("_reject_rate") and "/total_" not in k for k in keys)
    return "rollout_corr/total_seq_reject_rate" if has_mask else None


# ------------------------------------------------------------------------------ outputs


def fmt(mean: float, std: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def sci(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.1e}" if value != 0 and abs(value) < 1e-2 else f"{value:.3f}"


def table(conditions: list[Condition], summaries: dict[str, dict[str, Any]], runs_by_condition) -> list[str]:
    """One task's table (``conditions`` all on one task, its on-policy baseline first)."""
    baseline = runs_by_condition.get(f"{conditions[0].task}/onpolicy")
    lines = [
        "| condition | group | correction | final reward | AUC reward | AUC - on-policy (paired, 95% CI) "
        "| collapsed (batch) | staleness/mean | KL per version | kl mean / max | chi2_token mean / max "
        "| seq reject mean / max | final entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in conditions:
        s = summaries[c.name]

        def stat(key: str, field: str = "mean", s: dict[str, Any] = s) -> float:
            value = s.get(key, {}).get(field)
            return math.nan if value is None else value  # null in the JSON: not finite / not logged

        collapses = [b for b in s["collapse_steps"] if b is not None]
        collapsed = f"{len(collapses)}/{len(s['collapse_steps'])}" + (
            f" ({', '.join(str(b) for b in collapses)})" if collapses else ""
        )
        keys = [k for run in runs_by_condition[c.name] for k in run["series"]]
        reject = reject_key(keys)
        reject_cell = f"{stat(reject + ':mean'):.3f} / {stat(reject + ':max'):.3f}" if reject else "-"
        delta = (
            "-"
            if baseline is None or c.short == "onpolicy"
            else fmt_delta(*paired_delta(runs_by_condition[c.name], baseline, "auc_reward")[:2])
        )
        lines.append(
            f"| `{c.short}` | {c.group} | {c.label} | {fmt(stat('final_reward'), stat('final_reward', 'std'))} "
            f"| {fmt(stat('auc_reward'), stat('auc_reward', 'std'))} | {delta} | {collapsed} "
            f"| {stat('staleness/mean:mean'):.2f} | {sci(stat(VERSION_KL_KEY + ':mean'))} "
            f"| {sci(stat('rollout_corr/kl:mean'))} / {sci(stat('rollout_corr/kl:max'))} "
            f"| {sci(stat('rollout_corr/chi2_token:mean'))} / {sci(stat('rollout_corr/chi2_token:max'))} "
            f"| {reject_cell} | {stat('final_entropy'):.3f} |"
        )
    return lines


def calibration_table(calibration: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| task | learning rate | KL per version | AUC reward | final reward | chosen |",
        "|---|---|---|---|---|---|",
    ]
    for task, cal in calibration.items():
        if "given" in cal:
            lines.append(f"| {task} | {cal['given']:g} | (given with --lr, not calibrated) | | | yes |")
            continue
        rows = zip(cal["lrs"], cal["version_kl"], cal["auc_reward"], cal["final_reward"], strict=True)
        for lr, kl, auc, final in rows:
            chosen = "**yes**" if lr == cal["chosen"] else ""
            lines.append(f"| {task} | {lr:g} | {sci(kl)} | {auc:.3f} | {final:.3f} | {chosen} |")
    return lines


def plot_summary(conditions: list[Condition], runs_by_condition, path: Path) -> None:
    """Per task: paired AUC difference to on-policy against staleness (per correction), and per engine."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also keeps the test suite headless
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(c.task for c in conditions))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(13, 4.2 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        mine = [c for c in conditions if c.task == task]
        baseline = runs_by_condition.get(f"{task}/onpolicy", [])
        ax_stale, ax_engine = axes[row]
        stale = [c for c in mine if c.max_staleness > 0]
        corrections_here = list(dict.fromkeys(c.correction for c in stale))
        labels = {c.correction: c.label for c in stale}
        version_kl = []
        for index, short in enumerate(corrections_here):
            points = [(0, 0.0, 0.0)]  # the baseline itself
            for c in stale:
                if c.correction == short and baseline:
                    mean, half, _ = paired_delta(runs_by_condition[c.name], baseline, "auc_reward")
                    points.append((c.max_staleness, mean, half if math.isfinite(half) else 0.0))
                    version_kl += [r["summary"][VERSION_KL_KEY + ":mean"] for r in runs_by_condition[c.name]]
            xs, ys, errs = zip(*sorted(points), strict=True)
            shift = (index - (len(corrections_here) - 1) / 2) * 0.07  # keep the error bars apart
            ax_stale.errorbar(
                [x + shift for x in xs],
                ys,
                yerr=errs,
                label=labels[short],
                color=f"C{index}",
                marker="o",
                markersize=3,
                linewidth=1.2,
                capsize=2,
            )
        ax_stale.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
        kl = statistics.fmean(v for v in version_kl if math.isfinite(v)) if version_kl else math.nan
        levels = sorted({0, *(c.max_staleness for c in stale)})
        ax_stale.set_xticks(levels)
        ax_stale.set_xticklabels(
            [f"{k}\n~{k * kl:.1e} nats" if k and math.isfinite(kl) else str(k) for k in levels], fontsize=8
        )
        ax_stale.set_xlabel(f"max_staleness (optimizer steps); x KL per version ({sci(kl)}) = expected token KL")
        ax_stale.set_ylabel("AUC reward - on-policy (paired, 95% CI)")
        ax_stale.set_title(f"{task}: asynchronous staleness", fontsize=10)
        ax_stale.legend(fontsize=7, loc="lower left")
        engines = [c for c in mine if c.engine != "float32"]
        groups = list(dict.fromkeys(c.engine for c in engines))
        shorts = list(dict.fromkeys(c.correction for c in engines))
        width = 0.8 / max(1, len(shorts))
        for index, short in enumerate(shorts):
            labelled = False
            for g, engine in enumerate(groups):
                match = [c for c in engines if c.engine == engine and c.correction == short]
                if not match or not baseline:
                    continue
                mean, half, _ = paired_delta(runs_by_condition[match[0].name], baseline, "auc_reward")
                ax_engine.bar(
                    g + (index - (len(shorts) - 1) / 2) * width,
                    mean,
                    width,
                    yerr=half if math.isfinite(half) else 0,
                    color=f"C{corrections_here.index(short) if short in corrections_here else index}",
                    capsize=2,
                    label=None if labelled else match[0].label,
                )
                labelled = True
        ax_engine.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
        ax_engine.set_xticks(range(len(groups)))
        ax_engine.set_xticklabels([f"{e} engine (sync)" for e in groups])
        ax_engine.set_title(f"{task}: engine mismatch", fontsize=10)
        ax_engine.legend(fontsize=7, loc="lower left")
        for ax in (ax_stale, ax_engine):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(conditions: list[Condition], runs_by_condition, path: Path) -> None:
    """Reward (smoothed, mean over seeds) and mismatch KL per condition, one row of panels per task and group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys((c.task, c.group) for c in conditions if c.short != "onpolicy")) or [
        (conditions[0].task, "on-policy")
    ]
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 3.4 * len(rows)), squeeze=False)
    for row, (task, group) in enumerate(rows):
        members = [c for c in conditions if c.task == task and (c.short == "onpolicy" or c.group == group)]
        batches = min(len(r["series"]["train/reward"]) for c in members for r in runs_by_condition[c.name])
        smooth = max(1, min(10, batches // 10))
        ax_reward, ax_kl = axes[row]
        others = [c for c in members if c.short != "onpolicy"]  # a study may run without the baseline
        for c in members:
            runs = runs_by_condition[c.name]
            # Fixed colours: a condition keeps its colour in both panels even when its KL is not drawn.
            style = {"color": "black", "linestyle": "--"} if c.short == "onpolicy" else {"color": f"C{others.index(c)}"}
            reward = _mean_curve([moving_average(r["series"]["train/reward"], smooth) for r in runs])
            ax_reward.plot(reward, label=c.label, linewidth=1.3, **style)
            kl = _mean_curve([r["series"].get("rollout_corr/kl", []) for r in runs])
            if any(math.isfinite(v) and v != 0 for v in kl):  # bypass: identically 0, nothing for a log axis
                # k1 KL can read slightly negative on one batch: plot its magnitude on the log axis.
                ax_kl.plot(moving_average([abs(v) for v in kl], smooth), label=c.label, linewidth=1.3, **style)
        ax_reward.set_title(f"{task}, {group}: train/reward ({smooth}-batch moving avg, mean over seeds)", fontsize=9)
        ax_kl.set_title(f"{task}, {group}: |rollout_corr/kl| (not drawn where it reads 0)", fontsize=9)
        ax_kl.set_yscale("log")
        for ax in (ax_reward, ax_kl):
            ax.set_xlabel("batch")
            ax.grid(alpha=0.3)
        ax_reward.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    curves = [c for c in curves if c]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]


def render(payload: dict[str, Any], runs_by_condition, paths: dict[str, Path], reading: Path | None) -> str:
    """The markdown report of a study, from its stored payload (what the JSON holds)."""
    meta, settings = payload["meta"], payload["meta"]["settings"]
    conditions = [Condition(**c) for c in payload["conditions"]]
    summaries = payload["summary"]
    report_dir = paths["report"].parent
    rel = {key: os.path.relpath(paths[key], report_dir) for key in ("plot", "curves", "json")}
    run_times = [r["wall_s"] for runs in runs_by_condition.values() for r in runs]
    elapsed, seeds = meta["wall_s"], settings["seeds"]
    tasks = list(dict.fromkeys(c.task for c in conditions))
    task_lines = []
    for task in tasks:
        t = settings["tasks"][task]
        task_lines.append(
            f"* `{task}`: {TASKS[task].description}. Checkpoint: `{t['model']}`. lr {t['lr']:g}, "
            f"{t['batches']} batches of {t['prompts_per_step']} prompts x {t['samples_per_prompt']} samples x "
            f"<= {t['max_new_tokens']} new tokens, `num_minibatches={t['num_minibatches']}` "
            f"({t['num_minibatches']} optimizer step{'s' if t['num_minibatches'] > 1 else ''} per batch)."
        )
    calibration = meta.get("calibration", {})
    cal_any = next((c for c in calibration.values() if "lrs" in c), {})
    lines = [
        "# Mismatch study: does the off-policy correction keep RL stable?",
        "",
        f"- **Machine**: {meta['machine']}",
        f"- **Date**: {meta['date']}",
        f"- **Code**: {meta['code']}",
        f"- **Command**: `{meta['command']}`",
        f"- **Runs**: {len(conditions)} conditions ({', '.join(tasks)}) x {len(seeds)} seeds "
        f"(seeds {', '.join(map(str, seeds))}), after a calibration of "
        f"{sum(len(c.get('lrs', [])) for c in calibration.values())} fits",
        f"- **Wall time of the whole study**: {elapsed / 60:.1f} min ({elapsed:.0f} s); one run: "
        f"{statistics.fmean(run_times):.0f} s on average (min {min(run_times):.0f}, max {max(run_times):.0f})",
        f"- **Data**: every run's per-batch series in [`{rel['json']}`]({rel['json']}); summary plot "
        f"[`{rel['plot']}`]({rel['plot']}); reward curves [`{rel['curves']}`]({rel['curves']})",
        "",
        "## Method",
        "",
        METHOD.format(
            tasks="\n".join(task_lines),
            seed=cal_any.get("seed", seeds[0]),
            band_low=KL_BAND[0],
            band_top=KL_BAND[1],
            noise=next(iter(settings["tasks"].values()))["noise_scale"],
            collapse=meta["collapse_definition"],
        ),
        "",
        "## Calibration",
        "",
        *calibration_table(calibration),
        "",
        "## Results",
        "",
        f"![paired AUC difference against staleness and per engine]({rel['plot']})",
        "",
    ]
    for task in tasks:
        lines += [
            f"### `{task}`",
            "",
            *table([c for c in conditions if c.task == task], summaries, runs_by_condition),
            "",
        ]
    lines += [f"Reward curves of every condition: [`{rel['curves']}`]({rel['curves']}).", ""]
    if reading is not None and reading.exists():
        lines += ["## Reading", "", reading.read_text().strip(), ""]
    return "\n".join(lines)


def write_outputs(payload: dict[str, Any], args: argparse.Namespace) -> str:
    """Write the JSON, the PNGs and the markdown report of ``payload``; return the report."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": args.output_dir / "mismatch_study.json",
        "plot": args.output_dir / "mismatch_study.png",
        "curves": args.output_dir / "mismatch_curves.png",
        "report": args.report,
    }
    payload = _jsonable(payload)
    paths["json"].write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    conditions = [Condition(**c) for c in payload["conditions"]]
    runs_by_condition = {c.name: [r for r in payload["runs"] if r["condition"] == c.name] for c in conditions}
    plot_summary(conditions, runs_by_condition, paths["plot"])
    plot_curves(conditions, runs_by_condition, paths["curves"])
    report = render(payload, runs_by_condition, paths, args.reading)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(report)
    return report


def load_payload(path: Path) -> dict[str, Any]:
    """A stored study, with null (non-finite) values back as NaN and the summaries recomputed."""
    payload = json.loads(path.read_text())
    for run in payload["runs"]:
        run["series"] = {k: [math.nan if v is None else v for v in vs] for k, vs in run["series"].items()}
        run["summary"] = summarize_run(run)
    conditions = [Condition(**c) for c in payload["conditions"]]
    payload["summary"] = {
        c.name: summarize_condition([r for r in payload["runs"] if r["condition"] == c.name]) for c in conditions
    }
    return payload


def _jsonable(value: Any) -> Any:
    """Strict JSON: NaN / inf become null; floats keep 6 significant digits (the series are noisy anyway)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
