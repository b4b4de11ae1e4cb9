#!/usr/bin/env python
"""Does the off-policy correction keep RL stable when the rollouts are stale or mismatched?

One command runs the same RL fits (the real :class:`~lightning_offpolicy.lightning.callback.RolloutCallback`
and :class:`~lightning_offpolicy.lightning.module.OffPolicyRLModule`) on two tasks, under several conditions,
each with several seeds:

* **tasks**: ``reverse`` (the SFT-warmed tiny Llama ``tiny:reverse``) and ``letter`` (copy the
  prompt's first letter; a random-init tiny Llama saved as an HF checkpoint with its own character
  tokenizer, the task of ``benchmarks/vs_trl.py``);
* **calibration**: first, per task, an on-policy fit at each learning rate of ``--lrs`` measures
  the exact KL between consecutive policy versions; the study then uses the largest learning rate
  whose KL per version is at most 1e-2 nats (the regime of large-model RL is about 1e-3 to 1e-2);
* **on-policy baseline**: synchronous (``max_staleness=0``), ``HFEngine(dtype="float32")``: the
  engine samples with exactly the trainer's weights, nothing to correct;
* **async staleness**: ``max_staleness`` 2, 4 and 8 optimizer steps (1, 2 and 4 batches behind
  with ``num_minibatches=2``), the same float32 engine, and each correction: bypass (PPO clipped
  against the stale ``pi_rollout`` as if on-policy: what a naive async system does), decoupled PPO
  only (clip against ``pi_prox``, no IS weight), token TIS, geometric mask, bypass + geometric mask,
  CISPO anchored on the rollout policy, decoupled PPO + a rollout-KL penalty;
* **engine mismatch**: synchronous, with a bfloat16 engine, and with a float32 engine whose
  private weights carry a fixed Gaussian perturbation.

Every run's per-batch series (reward, entropy, staleness, KL per version, every ``rollout_corr/*``
metric) goes to a JSON file; two PNGs plot the paired reward difference against staleness and the
reward curves per condition; a markdown report gives the calibration, the tables, the method, the
machine and the wall time.

Usage::

    python studies/mismatch_study.py --output-dir docs/reports/results     # the full study (docs/reports/results.md)
    python studies/mismatch_study.py --quick --output-dir /tmp/ms  # a smoke test, < 3 min
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import math
import multiprocessing
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# One intra-op thread per run, set before torch is imported: on a shared 2-core machine a second
# thread waiting for a busy core slows every op down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared harness
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its modules, also where it is imported by path
from harness.report import code_line, cpu_model  # noqa: E402
from mismatch_conditions import (  # noqa: E402
    KL_BAND,
    LOGLINEAR,
    QUICK_CONDITIONS,
    TASKS,
    TASKS_MODEL_LABEL,
    Condition,
    Task,
    build_conditions,
    corrections,
)
from mismatch_report import (  # noqa: E402
    COLLAPSE_DEFINITION,
    _jsonable,
    fmt,
    fmt_delta,
    load_payload,
    mean_std,
    paired_delta,
    sci,
    summarize_condition,
    summarize_run,
    write_outputs,
)
from mismatch_runs import VERSION_KL_KEY, VersionKL, run_one  # noqa: E402

#: What the study's modules give the scripts and tests that import it (studies/prox_loglinear.py).
__all__ = [
    "KL_BAND",
    "LOGLINEAR",
    "TASKS",
    "Task",
    "VersionKL",
    "_jsonable",
    "choose_lr",
    "corrections",
    "fmt",
    "fmt_delta",
    "load_payload",
    "main",
    "mean_std",
    "paired_delta",
    "prepare_model",
    "sci",
]


import torch  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True, help="JSON and PNGs go here")
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="markdown report (default: <output-dir>.md, e.g. docs/reports/results.md)",
    )
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--batches", type=int, default=None, help="batches per run (default: the task's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[2, 4, 8], help="max_staleness values (steps)")
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[1e-3, 7e-4, 5e-4, 3.5e-4],
        help="calibration sweep (factors of sqrt(2): the KL per version moves ~2x per step)",
    )
    parser.add_argument(
        "--lr", nargs="+", default=[], metavar="TASK=LR", help="use this learning rate for TASK (no calibration)"
    )
    known = list(corrections(argparse.Namespace(geo_low=0.0, geo_high=0.0)))
    parser.add_argument(
        "--corrections",
        nargs="+",
        choices=known,
        default=None,
        help="the corrections run at every staleness (default: STALENESS_PLAN: all at 8, fewer at 4 and 2)",
    )
    parser.add_argument(
        "--mismatch-corrections",
        nargs="+",
        choices=known,
        default=["bypass", "decoupled", "tis"],
        help="with the noisy engine (the bf16 engine runs the first and the last of them)",
    )
    # Symmetric in log space, +-0.1 nat on the geometric mean ratio: at ~2e-3 nats per version a
    # 4-step-stale token is ~1e-2 off, and the per-sequence mean of 8-16 tokens spreads ~0.05 around
    # it, so the mask rejects the tail. verl's default [0.999, 1.001] would reject nearly everything.
    parser.add_argument("--geo-low", type=float, default=0.905)
    parser.add_argument("--geo-high", type=float, default=1.105)
    # 0.05 gave rollout_corr/kl ~4e-3 (KL grows with the square of the scale): 0.075 aims at ~1e-2.
    parser.add_argument("--noise-scale", type=float, default=0.075, help="perturbation of the noisy engine")
    parser.add_argument(
        "--conditions", nargs="+", default=None, help="run only these conditions (short names, e.g. stale4-tis)"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes, 1 thread each)")
    parser.add_argument(
        "--reading", type=Path, default=None, help="markdown file appended as '## Reading' (skipped if missing)"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the PNGs and the report from <output-dir>/mismatch_study.json (no training)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 conditions x 2 tasks x 1 seed x 6 small batches, 2-lr calibration"
    )
    args = parser.parse_args(argv)
    args.shape = {}
    if args.quick:
        args.batches, args.seeds, args.staleness, args.lrs = 6, [0], [4], [1e-3, 3e-4]
        args.shape = {"prompts_per_step": 4, "samples_per_prompt": 4}
        args.conditions = args.conditions or list(QUICK_CONDITIONS)
    args.fixed_lr = {}
    for item in args.lr:
        task, _, value = item.partition("=")
        if task not in TASKS or not value:
            parser.error(f"--lr takes TASK=LR with TASK one of {sorted(TASKS)}; got {item!r}")
        args.fixed_lr[task] = float(value)
    if args.report is None:
        args.report = args.output_dir.with_suffix(".md")
    return args


def choose_lr(lrs: Sequence[float], version_kl: Sequence[float]) -> float:
    """The largest learning rate whose KL per version is at most the band's top; else the one nearest the band."""
    within = [lr for lr, kl in zip(lrs, version_kl, strict=True) if math.isfinite(kl) and kl <= KL_BAND[1]]
    if within:
        return max(within)

    def distance(kl: float) -> float:  # in decades outside the band
        return max(math.log10(KL_BAND[0] / kl), math.log10(kl / KL_BAND[1]), 0.0) if kl > 0 else math.inf

    return min(zip(lrs, version_kl, strict=True), key=lambda pair: distance(pair[1]))[0]


def task_settings(args: argparse.Namespace, task: str, model: str, lr: float | None = None) -> dict[str, Any]:
    spec = TASKS[task]
    return {
        "model": model,
        "lr": lr,
        "batches": args.batches or spec.batches,
        "prompts_per_step": args.shape.get("prompts_per_step", spec.prompts_per_step),
        "samples_per_prompt": args.shape.get("samples_per_prompt", spec.samples_per_prompt),
        "max_new_tokens": spec.max_new_tokens,
        "num_minibatches": spec.num_minibatches,
        "noise_scale": args.noise_scale,
    }


def prepare_model(task: str, workdir: Path) -> str:
    """The checkpoint every run of ``task`` starts from (built once, here, not raced for in the workers)."""
    if task == "reverse":
        from lightning_offpolicy.demo.tiny import resolve_model_path

        resolve_model_path("tiny:reverse")
        return "tiny:reverse"
    from vs_trl_task import build_checkpoint

    return str(build_checkpoint(workdir / "letter_model", seed=0))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render_only:
        print(write_outputs(load_payload(args.output_dir / "mismatch_study.json"), args))
        return 0
    torch.set_num_threads(1)
    conditions = {task: build_conditions(args, task) for task in args.tasks}
    if args.conditions:
        every = {c.short for cs in conditions.values() for c in cs}
        unknown = set(args.conditions) - every
        if unknown:
            raise SystemExit(f"unknown conditions {sorted(unknown)}; known: {sorted(every)}")
        conditions = {task: [c for c in cs if c.short in args.conditions] for task, cs in conditions.items()}
    # The code the workers import now: read before the runs, since the tree may change during a long study.
    code = code_line()
    began = time.perf_counter()
    done = 0

    def report(run: dict[str, Any], total: int) -> None:
        print(
            f"[{time.perf_counter() - began:7.0f} s] {run['condition']:>24} seed {run['seed']} lr {run['lr']:g}: "
            f"final reward {run['summary']['final_reward']:.3f}, AUC {run['summary']['auc_reward']:.3f}, "
            f"KL/version {run['summary'][VERSION_KL_KEY + ':mean']:.1e}, {run['wall_s']:.0f} s ({done}/{total})",
            flush=True,
        )

    def run_all(pool, jobs: list[tuple[Condition, int, dict[str, Any]]]) -> list[dict[str, Any]]:
        nonlocal done
        done = 0
        futures = [pool.submit(run_one, c, seed, settings) for c, seed, settings in jobs]
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            run["summary"] = summarize_run(run)
            done += 1
            report(run, len(jobs))
        return [future.result() for future in futures]  # in job order

    settings: dict[str, dict[str, Any]] = {}
    calibration: dict[str, dict[str, Any]] = {}
    # spawn, not fork: the workers must not inherit the parent's torch thread pools.
    context = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="mismatch_study_") as workdir,
        concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool,
    ):
        models = {task: prepare_model(task, Path(workdir)) for task in args.tasks}
        # Phase 1: the learning rate per task, from the KL per version of full-length on-policy fits
        # (early batches move a policy differently from late ones); the chosen rate's fit is then the
        # on-policy baseline of the first seed.
        to_calibrate = [task for task in args.tasks if task not in args.fixed_lr]
        jobs = []
        for task in to_calibrate:
            onpolicy = build_conditions(args, task)[0]
            jobs += [(onpolicy, args.seeds[0], task_settings(args, task, models[task], lr)) for lr in args.lrs]
        if jobs:
            print(f"calibration: {len(jobs)} on-policy fits", flush=True)
        calibration_runs = run_all(pool, jobs)
        reused = []
        for task in args.tasks:
            if task in args.fixed_lr:
                calibration[task] = {"given": args.fixed_lr[task]}
                lr = args.fixed_lr[task]
            else:
                mine = [run for run, (c, _, _) in zip(calibration_runs, jobs, strict=True) if c.task == task]
                kls = [run["summary"][VERSION_KL_KEY + ":mean"] for run in mine]
                lr = choose_lr(args.lrs, kls)
                calibration[task] = {
                    "lrs": list(args.lrs),
                    "version_kl": kls,
                    "auc_reward": [run["summary"]["auc_reward"] for run in mine],
                    "final_reward": [run["summary"]["final_reward"] for run in mine],
                    "seed": args.seeds[0],
                    "chosen": lr,
                }
                if any(c.short == "onpolicy" for c in conditions[task]):
                    reused.append(mine[args.lrs.index(lr)])
            settings[task] = task_settings(args, task, TASKS_MODEL_LABEL.get(task, models[task]), lr)
            print(f"{task}: lr {lr:g}", flush=True)
        # Phase 2: every other condition x seed, seed-major so that early results cover every condition.
        have = {(run["condition"], run["seed"]) for run in reused}
        jobs = [
            (c, seed, {**settings[task], "model": models[task]})
            for seed in args.seeds
            for task in args.tasks
            for c in conditions[task]
            if (c.name, seed) not in have
        ]
        runs = reused + run_all(pool, jobs)
    elapsed = time.perf_counter() - began
    ordered = [c for task in args.tasks for c in conditions[task]]
    by_key = {(run["condition"], run["seed"]): run for run in runs}
    summaries = {c.name: summarize_condition([by_key[(c.name, s)] for s in args.seeds]) for c in ordered}
    machine = (
        f"{cpu_model()}, nproc={os.cpu_count()}, torch {torch.__version__} (intra-op threads=1 per run, "
        f"{args.workers} runs in parallel), Python {platform.python_version()}"
    )
    payload = {
        "meta": {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine,
            "code": code,
            "command": " ".join(shlex.quote(a) for a in ["python", "studies/mismatch_study.py", *argv]),
            "wall_s": elapsed,
            "settings": {"tasks": settings, "seeds": args.seeds, "workers": args.workers},
            "calibration": calibration,
            "collapse_definition": COLLAPSE_DEFINITION,
        },
        "conditions": [c.to_dict() for c in ordered],
        "summary": summaries,
        "runs": [by_key[(c.name, s)] for c in ordered for s in args.seeds],
    }
    print(write_outputs(payload, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
