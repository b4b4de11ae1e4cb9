#!/usr/bin/env python
"""AReaL's log-linear ``pi_prox`` (no proximal forward) against the recomputed one.

Two measurements, each ``prox_method="recompute"`` against ``prox_method="loglinear"``
(:mod:`lightning_offpolicy.correction.prox`), everything else equal:

1. **Training**, with the mismatch study's machinery (``studies/mismatch_study.py``: the real
   ``RolloutCallback`` and ``OffPolicyRLModule``, its two tasks, its learning rates, paired seeds):
   asynchronous rollouts at ``max_staleness`` 4, where ``pi_prox != pi_rollout``, with decoupled
   PPO + token TIS (the study's ``stale4-tis`` and ``stale4-tis-loglinear``). Final reward, AUC,
   the paired difference, ``rollout_corr/kl`` and ``perf/step_s`` (the training step's wall time,
   generation running beside it in its thread).
2. **Step time alone**: the training step on one fixed batch of each task's shape, no generation
   (the same batch every step, its tokens 4 optimizer steps stale), the two methods' fits
   alternated ``--rounds`` times so that the machine's load drifts evenly over both; the median of
   ``perf/step_s`` after the first two steps of each fit, and the policy forwards per batch.

Usage::

    python studies/prox_loglinear.py --output docs/reports/performance_prox_loglinear.md
    python studies/prox_loglinear.py --quick --output /tmp/prox_loglinear.md   # a smoke test
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the study: one intra-op thread per run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the study beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared harness
import lightning as L  # noqa: E402
import mismatch_study as study  # noqa: E402
import torch  # noqa: E402
from harness.fit import bare_trainer  # noqa: E402
from harness.report import code_line, cpu_model  # noqa: E402
from harness.timer import PhaseTimer  # noqa: E402

from lightning_offpolicy.batch import RolloutBatch  # noqa: E402
from lightning_offpolicy.correction import PolicyLossConfig, preset  # noqa: E402
from lightning_offpolicy.lightning.module import OffPolicyRLModule  # noqa: E402
from lightning_offpolicy.train import step  # noqa: E402

#: The study's calibrated learning rates (docs/reports/results.md), so no calibration runs here.
LEARNING_RATES = {"reverse": 3.5e-4, "letter": 7e-4}
STALENESS = 4
CORRECTION = "tis"
#: The two ways to obtain pi_prox, compared: method -> the study's condition.
METHODS = {"recompute": f"stale{STALENESS}-{CORRECTION}", "loglinear": f"stale{STALENESS}-{CORRECTION}-loglinear"}
#: The training rows: both methods, and bypass mode (no pi_prox, no forward either) for reference.
TRAINING = {**METHODS, "bypass (reference)": f"stale{STALENESS}-bypass"}
#: Per-batch series kept in the JSON (the study's JSON has every key; these make the table).
KEPT_SERIES = ("train/reward", "rollout_corr/kl", "perf/step_s", "staleness/mean")


# ------------------------------------------------------------------------------ 1. training
def run_training(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The study's two conditions on both tasks; returns its payload (runs with summaries)."""
    argv = [
        "--output-dir",
        str(workdir / "study"),
        "--report",
        str(workdir / "study.md"),
        "--tasks",
        *args.tasks,
        "--seeds",
        *map(str, args.seeds),
        "--staleness",
        str(STALENESS),
        "--corrections",
        CORRECTION,
        CORRECTION + study.LOGLINEAR,
        "bypass",
        "--conditions",
        *TRAINING.values(),
        "--workers",
        str(args.workers),
        "--lr",
        *(f"{task}={LEARNING_RATES[task]}" for task in args.tasks),
    ]
    if args.batches is not None:
        argv += ["--batches", str(args.batches)]
    if args.quick:
        argv += ["--quick"]
    study.main(argv)
    return study.load_payload(workdir / "study" / "mismatch_study.json")


def training_rows(payload: dict[str, Any], task: str) -> dict[str, dict[str, Any]]:
    """Per training row: the condition's runs and summary."""
    out = {}
    for method, short in TRAINING.items():
        name = f"{task}/{short}"
        out[method] = {
            "runs": [run for run in payload["runs"] if run["condition"] == name],
            "summary": payload["summary"][name],
        }
    return out


# ------------------------------------------------------------------------------ 2. step time alone
class StepTimes(L.Callback):
    """``perf/step_s`` of every training batch, and the seconds it spent in the timed pieces."""

    def __init__(self, phases: PhaseTimer, pieces: tuple[str, ...]) -> None:
        self.phases = phases  # the timed wrappers record each call under its piece's name
        self.seconds: dict[str, list[float]] = {"step_s": [], **{name: [] for name in pieces}}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds["step_s"].append(float(trainer.callback_metrics["perf/step_s"]))
        for name in self.seconds:
            if name != "step_s":
                self.seconds[name].append(self.phases.take(name))


def task_model(task: str, workdir: Path) -> str:
    return study.prepare_model(task, workdir)


def fixed_batch(policy: torch.nn.Module, spec: study.Task, pad_token_id: int, version: int) -> RolloutBatch:
    """A batch of the task's shape: random tokens, each response ``max_new_tokens`` long (the
    longest the task allows), rollout logprobs the policy's plus noise, every token ``STALENESS``
    versions old."""
    gen = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    rows = spec.prompts_per_step * spec.samples_per_prompt
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(4, 11, (1,), generator=gen)),), generator=gen) for _ in range(rows)
    ]
    responses = [torch.randint(3, vocab, (spec.max_new_tokens,), generator=gen) for _ in range(rows)]
    batch = RolloutBatch.from_sequences(
        prompt_ids=[p.tolist() for p in prompts],
        response_ids=[r.tolist() for r in responses],
        rewards=torch.rand(rows, generator=gen),
        advantages=torch.randn(rows, generator=gen),
        group_ids=[i // spec.samples_per_prompt for i in range(rows)],
        policy_versions=[version - STALENESS] * rows,
        rollout_logprobs=[[0.0] * spec.max_new_tokens] * rows,
        pad_token_id=pad_token_id,
    )
    with torch.no_grad():
        own = step.response_logprobs(policy, batch, temperature=1.0)
    noise = 0.05 * torch.randn(own.shape, generator=gen)
    return batch.with_fields(rollout_logprobs=(own + noise) * batch.response_mask)


def time_steps(model: str, spec: study.Task, method: str, steps: int) -> tuple[dict[str, list[float]], int]:
    """One fit of ``steps`` batches (the same batch) with ``prox_method=method``.

    Returns:
        Per batch: the step's seconds (``step_s``), those spent in the proximal forward
        (``prox_forward_s``, what loglinear saves) and in the correction (``correction_s``: once per
        batch with recompute, per micro-batch with the interpolation, which loglinear adds); and the
        policy forwards per batch.
    """
    L.seed_everything(0, verbose=False)
    module = OffPolicyRLModule(
        model=model,
        optimizer=partial(torch.optim.AdamW, lr=1e-7),  # the weights barely move: the timing is the point
        correction=preset("token_tis", clip_high=2.0).replace(prox_method=method),
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28),
        num_minibatches=spec.num_minibatches,
        max_tokens_per_microbatch=4096,
    )
    module.configure_model()
    module.policy_version = 100
    batch = fixed_batch(module.policy, spec, module.tokenizer.pad_token_id, module.policy_version)
    forwards = []
    module.policy.base_model.register_forward_hook(lambda *_: forwards.append(1))
    phases = PhaseTimer()
    phases.wrap(module, "_no_grad_logprobs", "prox_forward_s")
    timer = StepTimes(phases, ("prox_forward_s", "correction_s"))
    trainer = bare_trainer(steps * spec.num_minibatches, [timer], log_every_n_steps=1)
    from torch.utils.data import DataLoader

    try:  # the module calls them through the step module: wrapped there for the fit
        for name in ("apply_correction", "loglinear_prox"):
            phases.wrap(step, name, "correction_s")
        trainer.fit(module, DataLoader([batch] * steps, batch_size=None, collate_fn=lambda x: x))
    finally:
        phases.unwrap()
    return timer.seconds, len(forwards) // steps


def run_step_times(args: argparse.Namespace, models: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task in args.tasks:
        spec = study.TASKS[task]
        seconds: dict[str, dict[str, list[float]]] = {method: {} for method in METHODS}
        forwards: dict[str, int] = {}
        for _ in range(args.rounds):
            for method in METHODS:
                times, per_batch = time_steps(models[task], spec, method, args.steps)
                for piece, values in times.items():  # the first steps warm the allocator and the caches
                    seconds[method].setdefault(piece, []).extend(values[2:])
                forwards[method] = per_batch
        out[task] = {
            "rows": spec.prompts_per_step * spec.samples_per_prompt,
            "max_new_tokens": spec.max_new_tokens,
            "num_minibatches": spec.num_minibatches,
            "seconds": seconds,
            "median_s": {m: {piece: statistics.median(v) for piece, v in s.items()} for m, s in seconds.items()},
            "forwards_per_batch": forwards,
        }
        print(f"{task}: step time {out[task]['median_s']}, forwards {forwards}", flush=True)
    return out


# ------------------------------------------------------------------------------ report
def _mean_std(values: list[float]) -> str:
    mean, std = study.mean_std(values)
    return study.fmt(mean, std)


def render(payload: dict[str, Any]) -> str:
    meta, training, steps = payload["meta"], payload["training"], payload["step_time"]
    step_meta = payload["step_time_meta"]
    lines = [
        "# Log-linear pi_prox (AReaL's `prox_logp_method=loglinear`) against the recomputed one",
        "",
        f"- **Machine**: {meta['machine']}",
        f"- **Training runs**: {meta['date']}, {meta['code']}, `{meta['command']}`, {meta['wall_s'] / 60:.1f} min",
        f"- **Step time alone**: {step_meta['date']}, {step_meta['code']}, `{step_meta['command']}`, "
        f"{step_meta['wall_s'] / 60:.1f} min",
        "",
        "Decoupled PPO + token TIS (cap 2) at `max_staleness` 4 on the mismatch study's two tasks "
        "(`studies/mismatch_study.py`, its calibrated learning rates; docs/reports/results.md has the method), "
        f"seeds {', '.join(map(str, meta['seeds']))}, paired. The only difference between the recompute and "
        "loglinear rows of a task is `OffPolicyCorrectionConfig.prox_method`; the bypass row "
        "(`OffPolicyCorrectionConfig.bypass()`: no pi_prox, PPO clipped against pi_rollout, no weight) is the "
        "other way to skip the proximal forward. AUC: mean `train/reward` over the run; final: "
        "over its last 10%; the paired differences are the row minus recompute with the same seed, mean "
        "and 95% CI (Student t), bold where it excludes 0. `rollout_corr/kl` compares each row's own "
        "pi_prox with pi_rollout (the recomputed one, or the interpolated one; in bypass mode pi_theta, per "
        "micro-batch). `perf/step_s`: the "
        "training step's mean wall time in those runs (generation runs beside it); the isolated step "
        "time below is the one to read for speed.",
        "",
        "## Training",
        "",
        "| task | pi_prox | final reward | AUC reward | AUC - recompute (paired, 95% CI) "
        "| final - recompute (paired, 95% CI) | rollout_corr/kl mean | perf/step_s mean | run wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, rows in training.items():
        base = rows["recompute"]["runs"]
        for method in rows:
            runs = rows[method]["runs"]
            summaries = [r["summary"] for r in runs]
            if method == "recompute":
                auc_delta = final_delta = "-"
            else:
                auc_delta = study.fmt_delta(*study.paired_delta(runs, base, "auc_reward")[:2])
                final_delta = study.fmt_delta(*study.paired_delta(runs, base, "final_reward")[:2])
            lines.append(
                f"| `{task}` | {method} | {_mean_std([s['final_reward'] for s in summaries])} "
                f"| {_mean_std([s['auc_reward'] for s in summaries])} | {auc_delta} | {final_delta} "
                f"| {study.sci(statistics.fmean(s['rollout_corr/kl:mean'] for s in summaries))} "
                f"| {statistics.fmean(s['perf/step_s:mean'] for s in summaries):.3f} "
                f"| {statistics.fmean(r['wall_s'] for r in runs):.0f} |"
            )
    lines += [
        "",
        "## Step time alone",
        "",
        "| task | batch | optimizer steps per batch | policy forwards per batch (recompute / loglinear) "
        "| step s, recompute | step s, loglinear | loglinear / recompute | proximal forward s (saved) "
        "| correction s, recompute / loglinear |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task, t in steps.items():
        rec, log = t["median_s"]["recompute"], t["median_s"]["loglinear"]
        lines.append(
            f"| `{task}` | {t['rows']} rows x <= {t['max_new_tokens']} tokens | {t['num_minibatches']} "
            f"| {t['forwards_per_batch']['recompute']} / {t['forwards_per_batch']['loglinear']} "
            f"| {rec['step_s']:.4f} | {log['step_s']:.4f} | {log['step_s'] / rec['step_s']:.2f} "
            f"| {rec['prox_forward_s']:.4f} | {rec['correction_s']:.4f} / {log['correction_s']:.4f} |"
        )
    lines += [
        "",
        f"Medians per batch over {step_meta['rounds']} alternated fits per method and task, {step_meta['steps']} steps "
        "each, the first 2 of each fit dropped. The proximal forward is the no-gradient pass recompute runs "
        "(what loglinear saves); the correction is `compute_correction` with the interpolation, once per batch "
        "with recompute and per micro-batch with loglinear (what it adds). A batch that is one optimizer step "
        "in one micro-batch (`letter`) already takes the recomputed pi_prox from that step's own forward (one "
        "forward per batch either way), so loglinear saves nothing there.",
    ]
    if payload.get("reading"):
        lines += ["", "## Reading", "", payload["reading"].strip()]
    return "\n".join(lines) + "\n"


def _meta(command: str, **extra: Any) -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, nproc={os.cpu_count()}, torch {torch.__version__}, intra-op threads=1, Python "
        f"{platform.python_version()}",
        "code": code_line(),
        "command": command,
        "began": time.perf_counter(),
        **extra,
    }


def _kept(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``rows`` with each run's series cut to :data:`KEPT_SERIES`."""
    for row in rows.values():
        for run in row["runs"]:
            run["series"] = {k: v for k, v in run["series"].items() if k in KEPT_SERIES}
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="markdown report; the JSON goes beside it")
    parser.add_argument("--tasks", nargs="+", choices=sorted(study.TASKS), default=list(study.TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=None, help="batches per training run (default: the task's)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternated step-time fits per method")
    parser.add_argument("--steps", type=int, default=12, help="batches per step-time fit")
    parser.add_argument("--reading", type=Path, default=None, help="markdown appended as '## Reading'")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the report from the JSON beside --output (no runs)"
    )
    parser.add_argument(
        "--only",
        choices=["training", "step_time"],
        default=None,
        help="run this part only; the other keeps its results from the JSON beside --output",
    )
    parser.add_argument("--quick", action="store_true", help="the study's --quick shape, 1 seed, 1 short round")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.steps = [0], 1, 4
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    json_path = args.output.with_suffix(".json")
    if args.render_only:
        payload = json.loads(json_path.read_text())
    else:
        torch.set_num_threads(1)
        # A part not run keeps its results (and their meta) from the JSON beside --output.
        payload = json.loads(json_path.read_text()) if args.only else {}
        command = " ".join(shlex.quote(a) for a in ["python", "studies/prox_loglinear.py", *argv])
        with tempfile.TemporaryDirectory(prefix="prox_loglinear_") as tmp:
            workdir = Path(tmp)
            models = {task: task_model(task, workdir) for task in args.tasks}
            if args.only in (None, "step_time"):
                meta = _meta(command, rounds=args.rounds, steps=args.steps)
                payload["step_time"] = run_step_times(args, models)
                payload["step_time_meta"] = {**meta, "wall_s": time.perf_counter() - meta.pop("began")}
            if args.only in (None, "training"):
                meta = _meta(command, seeds=args.seeds)
                meta["machine"] += f" ({args.workers} runs in parallel)"
                study_payload = run_training(args, workdir)
                payload["training"] = {task: _kept(training_rows(study_payload, task)) for task in args.tasks}
                payload["meta"] = {**meta, "wall_s": time.perf_counter() - meta.pop("began")}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(study._jsonable(payload), separators=(",", ":")) + "\n")
        payload = json.loads(json_path.read_text())
    for rows in payload["training"].values():
        for row in rows.values():
            for run in row["runs"]:  # null (non-finite) values back as NaN
                run["summary"] = {k: (math.nan if v is None else v) for k, v in run["summary"].items()}
    if args.reading is not None and args.reading.exists():
        payload["reading"] = args.reading.read_text()
    report = render(payload)
    args.output.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
