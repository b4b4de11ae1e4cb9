#!/usr/bin/env python
"""Wall time per RL step, synchronous vs asynchronous rollouts, at the same work, in one run.

For each engine (the embedded ``HFEngine`` with its own float32 copy, generating in a thread of the
trainer's process; ``HFProcessEngine``, the same in a child process; ``VLLMEngine`` when vLLM is
installed) the same fit runs twice on the tiny ``reverse`` model: the same prompts, the same
batch, the same number of steps:

* **sync**: ``AsyncSettings(max_staleness=0)``: push, generate, then train, one after the other;
* **async**: ``AsyncSettings(max_staleness=u, sync_every=u)`` with ``u`` optimizer steps per
  batch: generation of batch ``j + 1`` overlaps the training of batch ``j``.

The sync run also measures the two components per batch: generation (push + generate + score)
and training (the rest of the step). The ideal asynchronous step is ``max(generation, training)``
(perfect overlap, free synchronisation); the report gives

* ``speed-up = sync step / async step``;
* ``overlap efficiency = ideal step / async step`` (1.0: perfect overlap);
* ``hidden = (sync - async) / min(generation, training)``: the share of the shorter phase the
  overlap hid.

The first ``--warmup`` batches of every run are not counted (engine warm-up, allocator).

With ``--partial`` every engine runs a third fit: asynchronous with ``partial_rollouts=True`` (a
push interrupts the request in flight; the completions continue under the new weights), and the
report compares it with the plain asynchronous run: step time, the trainer's push + wait, and the
fraction of completions interrupted. ``--no-stop`` makes every completion run to
``--max-new-tokens`` (a stop id the model never samples): the long-completion regime where a push
would otherwise wait for a long request.

Usage::

    python benchmarks/async_overlap.py --output docs/reports/performance_async.md     # ~3-6 min on 2 CPU cores
    python benchmarks/async_overlap.py --quick --engines hf --output /tmp/x.md
    python benchmarks/async_overlap.py --partial --no-stop --max-new-tokens 96 \
        --output docs/reports/performance_partial.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from harness.fit import KeptOpen, StepClock, bare_trainer
from harness.report import header_bullets, load_bullet, load_prose, method_sections, run_header, write_report
from harness.timer import PhaseTimer

ROOT = Path(__file__).resolve().parent.parent

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_offpolicy.data.tasks import PromptDataModule  # noqa: E402
from lightning_offpolicy.lightning.callback import RolloutCallback  # noqa: E402
from lightning_offpolicy.lightning.module import OffPolicyRLModule  # noqa: E402
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, HFProcessEngine, SamplingConfig  # noqa: E402

#: The stop id of ``--no-stop`` runs: the padding id, which the SFT-warmed tiny model never samples.
NO_STOP_ID = 0


def run_fit(engine, batches: int, max_staleness: int, steps_per_batch: int, args, partial_rollouts=False) -> dict:
    L.seed_everything(0)
    module = OffPolicyRLModule(
        model="tiny:reverse",
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        num_minibatches=steps_per_batch,
        max_tokens_per_microbatch=4096,
    )
    callback = RolloutCallback(
        engine=engine,
        sampling=SamplingConfig(samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_new_tokens),
        asynchrony=AsyncSettings(
            max_staleness=max_staleness, sync_every=max(1, max_staleness), partial_rollouts=partial_rollouts
        ),
    )
    clock = StepClock()
    clock.after_rollout.rollout = callback
    phases = PhaseTimer()
    phases.wrap(module, "training_step", "train")
    phases.wrap(engine, "generate", "generate")  # the producer thread's when asynchronous
    phases.wrap(engine, "update_weights", "push")
    if max_staleness > 0:  # the trainer's side of a push: waiting for the request in flight + the push
        phases.wrap(callback, "_after_async_step", "push_and_wait")
    trainer = bare_trainer(batches * steps_per_batch, [clock, callback, clock.after_rollout])
    data = PromptDataModule(task="reverse", prompts_per_step=args.prompts_per_step, num_train_prompts=4096)
    trainer.fit(module, data)
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)][args.warmup :]
    generation = clock.rollout_side[args.warmup :]
    skip = args.warmup
    return {
        "step_s": statistics.mean(steps),
        "rollout_side_s": statistics.mean(generation),
        "step_s_median": statistics.median(steps),
        "batches_counted": len(steps),
        "train_s": phases.mean("train", skip),
        "generate_s": phases.mean("generate", skip),
        "push_s": phases.mean("push", skip),
        "push_and_wait_s": phases.mean("push_and_wait", skip),
        "train_cpu_share": phases.cpu_share("train", skip),
        "generate_cpu_share": phases.cpu_share("generate", skip),
        "interrupted_frac": statistics.mean(clock.after_rollout.interrupted_frac[skip:] or [0.0]),
    }


def make_engine(kind: str, args):
    stops = {"eos_token_id": NO_STOP_ID, "stop_token_ids": []} if args.no_stop else {}
    if kind == "hf":
        return HFEngine(dtype="float32", **stops), None
    if kind == "hf_process":
        return HFProcessEngine(dtype="float32", **stops), None
    from lightning_offpolicy.rollout.vllm import StartSettings
    from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine

    start = StartSettings(dtype="float32", max_model_len=args.max_new_tokens + 64, gpu_memory_utilization=0.3)
    engine = VLLMEngine(model=None, start=start, **stops)
    return KeptOpen(engine), engine


def measure(kind: str, args) -> dict:
    u = args.steps_per_batch
    shared, real = make_engine(kind, args)

    def engine():
        return shared if real is not None else make_engine(kind, args)[0]

    partial_run = None
    try:
        if real is not None:  # start the engine outside the measured runs
            run_fit(shared, args.warmup + 1, 0, u, args)
        sync = run_fit(engine(), args.batches, 0, u, args)
        asyn = run_fit(engine(), args.batches, u, u, args)
        if args.partial:
            partial_run = run_fit(engine(), args.batches, u, u, args, partial_rollouts=True)
    finally:
        if real is not None:
            real.close()
    generation = sync["rollout_side_s"]
    training = sync["step_s"] - generation
    ideal = max(generation, training)
    async_step = asyn["step_s"]
    return {
        "engine": kind,
        "sync_step_s": sync["step_s"],
        "async_step_s": async_step,
        "generation_s": generation,
        "training_s": training,
        "ideal_step_s": ideal,
        "speedup": sync["step_s"] / async_step,
        "overlap_efficiency": ideal / async_step,
        "async_over_ideal": async_step / ideal,
        "goal_met": async_step <= OVERLAP_GOAL * ideal,
        "async_wait_s": asyn["rollout_side_s"],
        "hidden_fraction": (sync["step_s"] - asyn["step_s"]) / max(min(generation, training), 1e-9),
        "batches_counted": sync["batches_counted"],
        "max_staleness": u,
        # Where the asynchronous step goes (trainer thread), and what running side by side costs.
        "sync_phases": {k: v for k, v in sync.items() if k.endswith(("_s", "_share"))},
        "async_phases": {k: v for k, v in asyn.items() if k.endswith(("_s", "_share"))},
        "train_slowdown": asyn["train_s"] / max(sync["train_s"], 1e-9),
        "generate_slowdown": asyn["generate_s"] / max(sync["generate_s"], 1e-9),
        "async_other_s": async_step - asyn["train_s"] - asyn["rollout_side_s"] - asyn["push_and_wait_s"],
        "partial": None
        if partial_run is None
        else {
            "step_s": partial_run["step_s"],
            "push_and_wait_s": partial_run["push_and_wait_s"],
            "async_wait_s": partial_run["rollout_side_s"],
            "generate_s": partial_run["generate_s"],
            "interrupted_frac": partial_run["interrupted_frac"],
            "speedup_over_async": async_step / partial_run["step_s"],
        },
    }


#: The goal for the asynchronous step: at most this multiple of max(generation, training).
OVERLAP_GOAL = 1.1


#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]


def render(results: list[dict], argv: list[str], elapsed: float, args) -> str:
    header = run_header("async_overlap.py", argv, f"intra-op threads={torch.get_num_threads()}")
    lines = [
        "# Asynchronous rollouts: overlap of generation and training",
        "",
        *header_bullets(header),
        f"- **Work per batch**: {args.prompts_per_step} prompts x {args.samples_per_prompt} samples x "
        f"{'exactly' if args.no_stop else '<='} {args.max_new_tokens} new tokens, "
        f"{args.steps_per_batch} optimizer steps; "
        f"{args.batches} batches per run, the first {args.warmup} not counted",
        f"- **Wall time of the whole run**: {elapsed:.1f} s",
        load_bullet(args.load_start, os.getloadavg()[0]),
        "",
        *method_sections(
            METHOD,
            "Overlap needs idle cores: with a load above the core count, generation and training compete",
            "with other work and the asynchronous run cannot reach the ideal.",
        ),
        "| engine | sync step s | async step s | generation s | training s | ideal s "
        "| async wait s | speed-up | overlap efficiency | hidden share of the shorter phase |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['sync_step_s']:.3f} | {r['async_step_s']:.3f} | {r['generation_s']:.3f} | "
            f"{r['training_s']:.3f} | {r['ideal_step_s']:.3f} | {r['async_wait_s']:.3f} | {r['speedup']:.2f}x | "
            f"{r['overlap_efficiency']:.2f} | {r['hidden_fraction']:.2f} |"
        )
    lines += [
        "",
        f"Goal: asynchronous step <= {OVERLAP_GOAL}x max(generation, training), measured in the same run.",
        "",
        "| engine | async / ideal | goal |",
        "|---|---:|---|",
    ]
    for r in results:
        lines.append(f"| {r['engine']} | {r['async_over_ideal']:.2f}x | {'met' if r['goal_met'] else 'not met'} |")
    lines += [
        "",
        "## Where the asynchronous step goes",
        "",
        "| engine | async step s | training s (alone -> side by side) | generation s (alone -> side by side) "
        "| push s | trainer waits for a batch s | push + wait for the request in flight s | other s "
        "| CPU share training / generation (side by side) |",
        "|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        a, s_ = r["async_phases"], r["sync_phases"]
        lines.append(
            f"| {r['engine']} | {r['async_step_s']:.3f} | {s_['train_s']:.3f} -> {a['train_s']:.3f} "
            f"({r['train_slowdown']:.2f}x) | {s_['generate_s']:.3f} -> {a['generate_s']:.3f} "
            f"({r['generate_slowdown']:.2f}x) | {a['push_s']:.3f} | {r['async_wait_s']:.3f} | "
            f"{a['push_and_wait_s']:.3f} | {r['async_other_s']:.3f} | "
            f"{a['train_cpu_share']:.2f} / {a['generate_cpu_share']:.2f} |"
        )
    partial_rows = [r for r in results if r["partial"] is not None]
    if partial_rows:
        lines += [
            "",
            "## Partial rollouts",
            "",
            "The asynchronous run again with `partial_rollouts=True`: a push interrupts the generation request in "
            "flight and the interrupted completions continue under the new weights. `push + wait` is the trainer "
            "thread's time in the push, including its wait for the request in flight; `interrupted` is the mean "
            "fraction of a batch's completions that a push cut short; `generate` is the mean seconds per engine "
            "call (a continuation is a call of its own).",
            "",
            "| engine | async step s (push waits) | async step s (partial) | speed-up "
            "| push + wait s (waits -> partial) | trainer waits for a batch s (waits -> partial) | interrupted "
            "| generate call s (waits -> partial) |",
            "|---|---:|---:|---:|---|---|---:|---|",
        ]
        for r in partial_rows:
            p, a = r["partial"], r["async_phases"]
            lines.append(
                f"| {r['engine']} | {r['async_step_s']:.3f} | {p['step_s']:.3f} | {p['speedup_over_async']:.2f}x | "
                f"{a['push_and_wait_s']:.3f} -> {p['push_and_wait_s']:.3f} | "
                f"{r['async_wait_s']:.3f} -> {p['async_wait_s']:.3f} | {p['interrupted_frac']:.2f} | "
                f"{a['generate_s']:.3f} -> {p['generate_s']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engines",
        default="hf,hf_process,vllm",
        help="comma-separated: hf (HFEngine, a producer thread), hf_process (HFProcessEngine, a child process), "
        "vllm (skipped if not installed)",
    )
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--steps-per-batch", type=int, default=2)
    parser.add_argument(
        "--partial", action="store_true", help="also run asynchronously with partial_rollouts=True and compare"
    )
    parser.add_argument(
        "--no-stop", action="store_true", help="completions never stop early: each runs to --max-new-tokens"
    )
    parser.add_argument("--quick", action="store_true", help="a few batches: a smoke test")
    parser.add_argument("--output", type=Path, default=None, help="markdown report (a .json is written next to it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.warmup, args.prompts_per_step, args.samples_per_prompt = 5, 1, 4, 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.load_start = os.getloadavg()[0]
    began = time.perf_counter()
    results = []
    for kind in [k.strip() for k in args.engines.split(",") if k.strip()]:
        if kind == "vllm":
            from lightning_offpolicy.rollout.vllm.inprocess import vllm_available

            if not vllm_available():
                print("vLLM is not installed: skipping the vllm engine", file=sys.stderr)
                continue
        results.append(measure(kind, args))
        print(json.dumps(results[-1]), flush=True)
    write_report(args.output, render(results, argv, time.perf_counter() - began, args), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
