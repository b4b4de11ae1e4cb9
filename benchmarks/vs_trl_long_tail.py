#!/usr/bin/env python
"""Long-tailed completions (~16 to 512 tokens), a ~10M-parameter Qwen2 with a byte-level BPE tokenizer: TRL's
``GRPOTrainer`` and the kit, back to back, each in its own process; then the kit's step packed vs padded.

The task, model and tokenizer are ``long_tail_task.py``'s. Sides (``--sides``):

* ``trl``: ``GRPOTrainer(model=<dir>, processing_class=<its tokenizer>)``, HF ``generate``, one thread;
* ``kit``: ``OffPolicyRLModule(model=<dir>)`` + ``RolloutCallback(HFEngine())`` as it ships (packed
  micro-batches, the model allows them), synchronous, one thread;
* ``kit-async``: the same with ``AsyncSettings(max_staleness=1)`` and ``HFProcessEngine``: the next
  batch is generated in another process (the second core) while the trainer trains on this one.

Per step: the mean reward, the wall time, the completion lengths (mean, longest) and, for the kit, the
training step's own time. Then ``long_tail_probe.py`` times the kit's PPO update packed and padded
on the last rollout batches of the ``kit`` side, and its MFU against the matmul peak measured in the
same process. The report states the issue's goals as met or not.

Usage::

    python benchmarks/vs_trl_long_tail.py --output docs/reports/performance_long_tail.md   # ~20 min, 2 cores
    python benchmarks/vs_trl_long_tail.py --quick --output /tmp/long_tail.md                # smoke test, ~5 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import long_tail_task as task
from harness.report import header_bullets, load_bullet, method_sections, run_header, write_report

ROOT = Path(__file__).resolve().parent.parent
SIDES: dict[str, tuple[str, dict[str, Any]]] = {
    "trl": ("trl", {}),
    "kit": ("kit", {}),
    "kit-async": ("kit", {"max_staleness": 1}),
}
LABELS = {
    "trl": "TRL GRPOTrainer",
    "kit": "kit (packed, synchronous)",
    "kit-async": "kit (packed, async, max_staleness=1, HFProcessEngine)",
}
#: Steps whose mean reward is the first / final reward.
WINDOW = 5
#: Warm-up steps of a --quick run's checkpoint (a smoke test: its lengths are not the point).
QUICK_WARM_UP = 10
#: Goals: kit / TRL steps/s (synchronous), |packed speed-up / predicted - 1|, MFU of the packed step.
SPEED_GOAL, PACKING_TOLERANCE, MFU_GOAL = 2.0, 0.2, 0.5


def _child(args: argparse.Namespace) -> int:
    """One side in this process (the driver starts one subprocess per side, and one for the probe)."""
    if args.side == "probe":
        from long_tail_probe import probe

        files = sorted((args.workdir / "rollouts").glob("*.pt"))
        record = probe(args.workdir / "model", files, task.SETTINGS["threads"], repeats=args.probe_repeats)
    else:
        from vs_trl_sides import run_side

        kind, variant = SIDES[args.side]
        variant = dict(variant, keep_rollouts=args.keep_rollouts if args.side == "kit" else 0)
        record = run_side(kind, args.workdir, args.steps, args.seed, "hf", variant, task=task)
    args.side_output.write_text(json.dumps(record) + "\n")
    return 0


def _run_child(side: str, workdir: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    out = workdir / f"{side}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--workdir", str(workdir)]
    cmd += ["--steps", str(args.steps), "--seed", str(seed), "--side-output", str(out)]
    cmd += ["--keep-rollouts", str(args.keep_rollouts), "--probe-repeats", str(args.probe_repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vs_trl_long_tail: {side} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def summarize(side: str, seed: int, record: dict[str, Any]) -> dict[str, Any]:
    """Final reward, median s/step, completion tokens/s and the batches' completion padding share."""
    rows = task.SETTINGS["prompts_per_step"] * task.SETTINGS["samples_per_prompt"]
    rewards, step_s, lengths = record["rewards"], record["step_s"], record.get("lengths") or []
    window = min(WINDOW, len(rewards))
    completion_tokens = sum(length["mean"] * rows for length in lengths)
    out = {
        "side": side,
        "label": LABELS[side],
        "seed": seed,
        "first_reward": statistics.fmean(rewards[:window]),
        "final_reward": statistics.fmean(rewards[-window:]),
        "median_step_s": statistics.median(step_s),
        "completion_tokens_per_s": completion_tokens / sum(step_s) if lengths else None,
        "mean_completion": statistics.fmean(length["mean"] for length in lengths) if lengths else None,
        "longest_completion": max(length["max"] for length in lengths) if lengths else None,
        # Of a batch padded to its longest completion, the share of completion positions that are padding.
        "completion_padding": statistics.fmean(1 - x["mean"] / x["max"] for x in lengths) if lengths else None,
    }
    if record.get("train_s") and side == "kit":
        # Asynchronously the batch's hooks also wait for the generation in flight (the weight push):
        # the training step alone is measured on the synchronous side only.
        out["median_train_s"] = statistics.median(record["train_s"])
    return out


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per side over its seeds (means; the median s/step over every step of every seed)."""
    rows = []
    for side in dict.fromkeys(run["side"] for run in runs):
        mine = [run for run in runs if run["side"] == side]
        numeric = [key for key, value in mine[0].items() if key != "seed" and isinstance(value, (int, float))]
        row: dict[str, Any] = {key: _mean([run.get(key) for run in mine]) for key in numeric}
        row.update(side=side, label=LABELS[side], seeds=[run["seed"] for run in mine])
        row["final_reward_per_seed"] = [run["final_reward"] for run in mine]
        row["median_step_s"] = statistics.median(s for run in mine for s in run["record"]["step_s"])
        rows.append(row)
    return rows


def _tokens_ratio(row: dict[str, Any], trl: dict[str, Any]) -> str:
    # The sides sample their own completions: their lengths, so the work of a step, differ.
    if not row.get("completion_tokens_per_s") or not trl.get("completion_tokens_per_s"):
        return "-"
    return f"{row['completion_tokens_per_s'] / trl['completion_tokens_per_s']:.2f}x"


def goals(summary: list[dict[str, Any]], probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal with its figure and whether it is met."""
    by_side = {row["side"]: row for row in summary}
    out = []
    trl = by_side.get("trl")
    for side in ("kit", "kit-async"):
        row = by_side.get(side)
        if trl is None or row is None:
            continue
        speed = trl["median_step_s"] / row["median_step_s"]
        reward_gap = row["final_reward"] - trl["final_reward"]
        out.append(
            {
                "goal": f"{LABELS[side]}: >= {SPEED_GOAL:g}x TRL's steps/s at >= TRL's final reward"
                + (" (the goal is the synchronous row; this one is reported beside it)" if side != "kit" else ""),
                "figure": f"{speed:.2f}x steps/s ({_tokens_ratio(row, trl)} completion tokens/s); final reward "
                f"{row['final_reward']:.3f} vs {trl['final_reward']:.3f}",
                "met": speed >= SPEED_GOAL and reward_gap >= 0,
                "speed": speed,
                "reward_gap": reward_gap,
            }
        )
    if probes:
        speedup = statistics.fmean(p["speedup"] for p in probes)
        predicted = statistics.fmean(p["predicted_speedup"] for p in probes)
        share = statistics.fmean(p["padding_share"] for p in probes)
        out.append(
            {
                "goal": f"padded vs packed: the speed-up equals what the padding share predicts within "
                f"{PACKING_TOLERANCE:.0%}",
                "figure": f"speed-up {speedup:.2f}x; padding share {share:.1%} predicts {predicted:.2f}x "
                f"(ratio {speedup / predicted:.2f})",
                "met": abs(speedup / predicted - 1) <= PACKING_TOLERANCE,
            }
        )
        mfu = statistics.fmean(p["mfu"] for p in probes)
        out.append(
            {
                "goal": f"MFU of the training step >= {MFU_GOAL:.0%} of the measured matmul peak",
                "figure": f"{mfu:.1%} ({statistics.fmean(p['packed_gflops'] for p in probes):.1f} of "
                f"{statistics.fmean(max(p['matmul_gflops'].values()) for p in probes):.1f} GFLOP/s; padded "
                f"{statistics.fmean(p['mfu_padded'] for p in probes):.1%}"
                + (
                    f"; the model's matmuls alone reach {statistics.fmean(gemm):.0%} of the peak)"
                    if (gemm := [p["gemm_share_of_peak"] for p in probes if p.get("gemm_share_of_peak")])
                    else ")"
                ),
                "met": mfu >= MFU_GOAL,
            }
        )
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _gemm(probe: dict[str, Any]) -> str:
    if probe.get("gemm_gflops") is None:  # a report from before the probe measured it
        return "-"
    return f"{probe['gemm_gflops']:.1f} GFLOP/s ({probe['gemm_share_of_peak']:.0%} of the peak)"


def _start(warm_up: dict[str, Any] | None) -> str:
    """The checkpoint's start, as the report states it (a report from before the warm-up has none)."""
    if not warm_up or not warm_up["steps"]:
        return "random init with an end-of-turn prior (long_tail_task.py)"
    return (
        f"warmed up for {warm_up['steps']} steps of ~{warm_up['tokens']} tokens (lr {warm_up['lr']:g}, decaying) on "
        "completions of geometric length (long_tail_task.py)"
    )


def render(header: dict[str, Any], summary: list[dict[str, Any]], probes: list[dict[str, Any]]) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in task.SETTINGS.items())
    lines = [
        "# Long-tailed completions: the kit vs TRL's GRPOTrainer",
        "",
        *header_bullets(header),
        load_bullet(header["load_start"], header["load_end"]),
        f"- **Model**: Qwen2-shaped, {header['parameters'] / 1e6:.1f}M parameters, byte-level BPE vocabulary "
        f"{task.VOCAB_SIZE}, {_start(header.get('warm_up'))}; TRL {header['trl']}, transformers "
        f"{header['transformers']}",
        f"- **Steps**: {header['steps']} per side and seed; seeds {', '.join(map(str, header['seeds']))}; "
        f"wall time of the whole run {header['elapsed_s'] / 60:.1f} min",
        "",
        *method_sections(
            f"Shared settings: {settings}. Final reward: mean of the last {WINDOW} steps. s/step: wall time "
            "from one optimizer step's start to the next (generation, scoring, the update); median. Completion "
            "tokens/s: completion tokens generated and trained on per second of wall time. Completion padding: "
            "the share of a batch's completion positions that are padding when it is padded to its longest "
            "completion. The packed / padded probe: `benchmarks/long_tail_probe.py` (its docstring gives the "
            "FLOP count).",
        ),
        "| side | reward, first -> last steps | per seed | s/step (median) | kit train step (median s) "
        "| completion tokens/s | completion mean / longest | completion padding |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for row in summary:
        per_seed = ", ".join(f"{r:.3f}" for r in row["final_reward_per_seed"])
        lines.append(
            f"| {row['label']} | {row['first_reward']:.3f} -> **{row['final_reward']:.3f}** | {per_seed} "
            f"| {row['median_step_s']:.2f} | {_fmt(row.get('median_train_s'), '.2f')} "
            f"| {_fmt(row['completion_tokens_per_s'], '.0f')} | {_fmt(row['mean_completion'], '.0f')} / "
            f"{_fmt(row['longest_completion'], '.0f')} | {_fmt(row['completion_padding'], '.1%')} |"
        )
    if probes:
        lines += [
            "",
            "### The kit's update on the same batches, packed vs padded",
            "",
            "| seed | batches | real tokens | padded positions | padding share | packed s | padded s | speed-up "
            "| predicted | model GFLOP/s packed / padded | matmul peak GFLOP/s | the model's matmuls alone "
            "| MFU packed / padded |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
        ]
        for seed, p in zip(header["seeds"], probes, strict=True):
            real = sum(b["packed_positions"] for b in p["batches"])
            padded = sum(b["padded_positions"] for b in p["batches"])
            lines.append(
                f"| {seed} | {len(p['batches'])} | {real} | {padded} | {p['padding_share']:.1%} | "
                f"{p['packed_s']:.2f} | {p['padded_s']:.2f} | **{p['speedup']:.2f}x** | {p['predicted_speedup']:.2f}x "
                f"| {p['packed_gflops']:.1f} / {p['padded_gflops']:.1f} | {max(p['matmul_gflops'].values()):.1f} "
                f"| {_gemm(p)} | **{p['mfu']:.1%}** / {p['mfu_padded']:.1%} |"
            )
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for goal in header["goals"]:
        lines.append(f"| {goal['goal']} | {goal['figure']} | {'yes' if goal['met'] else '**no**'} |")
    lines += ["", *[f"- {note}" for note in header.get("notes", [])]]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per side (default 12)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 steps per side, one probe batch")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (model, prompts, samplers; default 0)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    parser.add_argument("--keep-rollouts", type=int, default=3, help="kit batches the probe times (default 3)")
    parser.add_argument("--probe-repeats", type=int, default=2, help="timed repeats per batch and layout")
    parser.add_argument("--no-probe", action="store_true", help="skip the packed / padded probe")
    parser.add_argument(
        "--warm-up-steps",
        type=int,
        default=None,
        help=f"supervised warm-up steps of the checkpoint (default {task.WARM_UP['steps']}, --quick {QUICK_WARM_UP}; "
        "0: the random init with an end-of-turn prior, whose lengths drift under RL)",
    )
    parser.add_argument("--note", action="append", default=[], help="a line added to the report's notes")
    parser.add_argument("--output", type=Path, default=None, help="markdown report (.json next to it)")
    parser.add_argument("--workdir", type=Path, default=None, help="where models and runs go (default: temp)")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="no run: render the report again from an earlier run's .json"
    )
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=[*SIDES, "probe"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-output", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.keep_rollouts, args.probe_repeats = 2, 1, 1
    if args.warm_up_steps is None:
        args.warm_up_steps = QUICK_WARM_UP if args.quick else task.WARM_UP["steps"]
    if args.steps < 1 or args.keep_rollouts < 1 or args.probe_repeats < 1:
        parser.error("--steps, --keep-rollouts and --probe-repeats must be >= 1")
    if args.warm_up_steps < 0:
        parser.error(f"--warm-up-steps={args.warm_up_steps} must be >= 0")
    args.keep_rollouts = min(args.keep_rollouts, args.steps)
    if args.side is not None:
        return _child(args)
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        runs = [{**summarize(r["side"], r["seed"], r["record"]), "record": r["record"]} for r in data["runs"]]
        data.update(runs=runs, summary=aggregate(runs))
        data["header"]["goals"] = goals(data["summary"], data["probes"])
        data["header"]["notes"] = data["header"].get("notes", []) + list(args.note)
        write_report(args.output, render(data["header"], data["summary"], data["probes"]), data)
        return 0
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        parser.error(f"--sides={args.sides!r}: allowed values are {', '.join(SIDES)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r} must be comma-separated integers")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds={args.seeds!r} must name at least one seed, each once")

    load_start, began = os.getloadavg()[0], time.perf_counter()
    runs, probes = [], []
    with tempfile.TemporaryDirectory(prefix="long_tail-") as tmp:
        for seed in seeds:
            workdir = (args.workdir or Path(tmp)) / f"seed{seed}"
            task.build_checkpoint(workdir / "model", seed=seed, warm_up_steps=args.warm_up_steps)
            prompts = task.make_prompts((args.steps + 2) * task.SETTINGS["prompts_per_step"], seed=seed)
            (workdir / "prompts.json").write_text(json.dumps(prompts))
            for side in sides:
                record = _run_child(side, workdir, args, seed)
                run = {**summarize(side, seed, record), "record": record}
                runs.append(run)
                print(
                    f"seed {seed} {side}: final reward {run['final_reward']:.3f}, median s/step "
                    f"{run['median_step_s']:.2f}, completion mean {_fmt(run['mean_completion'], '.0f')}",
                    flush=True,
                )
            if "kit" in sides and not args.no_probe:
                probes.append(_run_child("probe", workdir, args, seed))
                print(f"seed {seed} probe: speed-up {probes[-1]['speedup']:.2f}x, MFU {probes[-1]['mfu']:.1%}")
        parameters = task.parameter_count(workdir / "model")
    import transformers
    from vs_trl_report import trl_version

    summary = aggregate(runs)
    header = {
        **run_header("vs_trl_long_tail.py", argv),
        "trl": trl_version(),
        "transformers": transformers.__version__,
        "parameters": parameters,
        "steps": args.steps,
        "seeds": seeds,
        "settings": task.SETTINGS,
        "warm_up": {**task.WARM_UP, "steps": args.warm_up_steps},
        "elapsed_s": time.perf_counter() - began,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "notes": list(args.note),
    }
    header["goals"] = goals(summary, probes)
    report = render(header, summary, probes)
    write_report(args.output, report, {"header": header, "summary": summary, "probes": probes, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
