#!/usr/bin/env python
"""End-to-end throughput of the quickstart recipe: RL steps and generated tokens per second.

The recipe is ``configs/quickstart.yaml`` itself, built by the kit's own CLI (``OffPolicyCLI``,
``run=False``): the tiny Llama on ``reverse``, 16 prompts x 8 samples, <= 8 new tokens, token TIS,
2 optimizer steps per batch. Only the rollout engine and the staleness change between the runs:

* **(a)** ``HFEngine(dtype="bfloat16")``, synchronous: the config as shipped;
* **(b)** ``HFEngine(dtype="float32")`` (a private float32 copy), asynchronous, ``max_staleness=2``;
* **(c)** ``VLLMEngine`` (the init args of ``configs/vllm.yaml``), synchronous;
* **(d)** the same ``VLLMEngine``, asynchronous, ``max_staleness=2`` (as ``configs/vllm_async.yaml``).

(c) and (d) share one engine, started in an unmeasured warm-up fit (``KeptOpen`` from
``benchmarks/async_overlap.py`` stops the callback from closing it between fits). They are skipped
with a note when vLLM is not installed. Every run trains the same number of batches; the first
``--warmup`` are not counted. Ratios are relative to (a), measured in the same run of this script.

Usage::

    python benchmarks/end_to_end.py --output docs/reports/performance_end_to_end.md   # ~3-5 min on 2 CPU cores
    python benchmarks/end_to_end.py --quick --output /tmp/e2e.md              # HF only, 4 batches
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.fit import KeptOpen, StepClock
from harness.report import header_bullets, load_bullet, load_prose, method_sections, run_header, write_report

ROOT = Path(__file__).resolve().parent.parent

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from lightning_offpolicy.cli import OffPolicyCLI  # noqa: E402
from lightning_offpolicy.data.tasks import PromptDataModule  # noqa: E402
from lightning_offpolicy.lightning.callback import RolloutCallback  # noqa: E402
from lightning_offpolicy.lightning.module import OffPolicyRLModule  # noqa: E402
from lightning_offpolicy.rollout import HFEngine  # noqa: E402

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
VLLM_CONFIG = ROOT / "configs" / "vllm.yaml"
STALENESS = 2


@dataclass(frozen=True)
class RunSpec:
    """One row of the report: which engine, and synchronous or not."""

    key: str
    label: str
    engine: str  # "hf-bf16" (the config's own), "hf-f32", "vllm"
    max_staleness: int


RUNS = [
    RunSpec("a", "HFEngine(bfloat16), sync", "hf-bf16", 0),
    RunSpec("b", f"HFEngine(float32 copy), async max_staleness={STALENESS}", "hf-f32", STALENESS),
    RunSpec("c", "VLLMEngine, sync", "vllm", 0),
    RunSpec("d", f"VLLMEngine, async max_staleness={STALENESS}", "vllm", STALENESS),
]


class Meter(L.Callback):
    """Placed right after the ``RolloutCallback``: what it attached to each batch, and the reward.

    The callback clears its ``last_timing`` and the batch's rollout in its own
    ``on_train_batch_end``, so both are read at batch start, once the rollout is there.
    """

    def __init__(self, rollout: RolloutCallback) -> None:
        self.rollout = rollout
        self.tokens: list[int] = []
        self.generate_s: list[float] = []
        self.rewards: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.tokens.append(batch.rollout.num_response_tokens)
        self.generate_s.append(float(self.rollout.last_timing.get("generate_s", math.nan)))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        reward = trainer.callback_metrics.get("train/reward")
        self.rewards.append(float(reward) if reward is not None else math.nan)


def quickstart() -> dict[str, Any]:
    with open(QUICKSTART) as f:
        return yaml.safe_load(f)


def work_line() -> str:
    """The work per batch, read from the config the runs are built from."""
    cfg = quickstart()
    model, sampling = cfg["model"], cfg["rollout"]["sampling"]
    steps = model.get("ppo_epochs", 1) * model.get("num_minibatches", 1)
    return (
        f"{cfg['data']['init_args']['prompts_per_step']} prompts x {sampling['samples_per_prompt']} samples x "
        f"<= {sampling['max_new_tokens']} new tokens, {steps} optimizer steps (configs/quickstart.yaml)"
    )


def build_fit(batches: int, max_staleness: int) -> tuple[OffPolicyCLI, RolloutCallback]:
    """The quickstart's module, data, trainer and rollout callback, as ``lightning-offpolicy fit`` builds them.

    Overrides: no logger, checkpoint or progress bar (nothing written, nothing printed per step),
    ``max_steps`` for ``batches`` batches, and the staleness.
    """
    model = quickstart()["model"]
    steps_per_batch = int(model.get("ppo_epochs", 1) * model.get("num_minibatches", 1))
    args = [
        "--config", str(QUICKSTART),
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.max_steps={batches * steps_per_batch}",
        f"--rollout.asynchrony.max_staleness={max_staleness}",
        f"--rollout.asynchrony.sync_every={max(1, max_staleness)}",  # as configs/vllm_async.yaml: a push per batch
    ]  # fmt: skip
    cli = OffPolicyCLI(
        OffPolicyRLModule,
        PromptDataModule,
        subclass_mode_data=True,
        args=args,
        run=False,
        save_config_callback=None,
        auto_configure_optimizers=False,
    )
    callback = next(c for c in cli.trainer.callbacks if isinstance(c, RolloutCallback))
    return cli, callback


def run_fit(spec: RunSpec, engine: Any, batches: int, warmup: int) -> dict[str, Any]:
    """Fit ``batches`` batches with ``engine`` (``None``: the config's own) and measure the counted ones."""
    cli, callback = build_fit(batches, spec.max_staleness)
    if engine is not None:
        callback.engine = engine
    inner = getattr(callback.engine, "engine", callback.engine)  # KeptOpen wraps the shared vLLM engine
    clock = StepClock()
    meter = Meter(callback)
    others = [c for c in cli.trainer.callbacks if c is not callback]
    # Order matters: the clock brackets the rollout callback's batch-start hook (the rollout side).
    cli.trainer.callbacks = [clock, callback, clock.after_rollout, meter, *others]
    cli.trainer.fit(cli.model, cli.datamodule)
    steps_per_batch = cli.model.optimizer_steps_per_batch
    if cli.trainer.global_step != batches * steps_per_batch:
        raise RuntimeError(
            f"{spec.label}: {cli.trainer.global_step} optimizer steps, expected {batches * steps_per_batch}"
        )
    # clock.starts: the start of every batch, then the end of training.
    counted = len(clock.starts) - 1 - warmup
    wall = clock.starts[-1] - clock.starts[warmup]
    steps = [b - a for a, b in zip(clock.starts[warmup:], clock.starts[warmup + 1 :], strict=False)]
    tokens = sum(meter.tokens[warmup:])
    generate_s = sum(meter.generate_s[warmup:])
    return {
        "key": spec.key,
        "label": spec.label,
        "engine": type(inner).__name__,
        "engine_dtype": str(getattr(inner, "dtype", "")),
        "max_staleness": spec.max_staleness,
        "batches": batches,
        "batches_counted": counted,
        "optimizer_steps_per_batch": steps_per_batch,
        "wall_s": wall,
        "batches_per_s": counted / wall,
        "optimizer_steps_per_s": counted * steps_per_batch / wall,
        "generated_tokens": tokens,
        "tokens_per_batch": tokens / counted,
        "generated_tokens_per_s": tokens / wall,
        "generate_s": generate_s,
        "engine_tokens_per_s": tokens / generate_s if generate_s > 0 else math.nan,
        "step_s_median": statistics.median(steps),
        "rollout_side_s": statistics.mean(clock.rollout_side[warmup:]),
        "reward_mean": statistics.fmean(meter.rewards[warmup:]),
    }


def make_engine(spec: RunSpec, shared_vllm: Any) -> Any:
    if spec.engine == "hf-bf16":
        return None  # the config's own engine, as shipped
    if spec.engine == "hf-f32":
        return HFEngine(dtype="float32")
    return KeptOpen(shared_vllm)


def start_vllm(warmup: int) -> Any:
    """The shared engine, built with configs/vllm.yaml's init args and started in an unmeasured fit."""
    from lightning_offpolicy.rollout.vllm import StartSettings, WeightSyncSettings
    from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine

    with open(VLLM_CONFIG) as f:
        init_args = yaml.safe_load(f)["rollout"]["engine"].get("init_args", {})
    # The config's groups (``start:``, ``weight_sync:``) are mappings there: built here as jsonargparse does.
    groups = {"start": StartSettings, "weight_sync": WeightSyncSettings}
    engine = VLLMEngine(**{k: groups[k](**v) if k in groups else v for k, v in init_args.items()})
    began = time.perf_counter()
    run_fit(RUNS[2], KeptOpen(engine), warmup + 1, warmup)
    print(f"vLLM engine started and warmed up in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    return engine


def add_ratios(results: list[dict[str, Any]]) -> None:
    base = next((r for r in results if r["key"] == "a"), None)
    for r in results:
        for name in ("batches_per_s", "generated_tokens_per_s", "engine_tokens_per_s"):
            r[f"{name}_vs_a"] = r[name] / base[name] if base else math.nan


#: The report's fixed prose (templates/<this script>.md).
PROSE = load_prose(__file__)
METHOD = PROSE["method"]


def render(results: list[dict[str, Any]], notes: list[str], header: dict[str, Any]) -> str:
    lines = [
        "# End to end: RL steps and generated tokens per second (quickstart recipe)",
        "",
        *header_bullets(header),
        f"- **Work per batch**: {header['work']}; {header['batches']} batches per run, the first "
        f"{header['warmup']} not counted",
        f"- **Wall time of the whole run**: {header['elapsed_s']:.1f} s",
        load_bullet(header["load_start"], header["load_end"]),
        "",
        *method_sections(METHOD),
        "| run | engine, mode | engine dtype | batches/s | optimizer steps/s | generated tokens/s | engine tokens/s "
        "| tokens/batch | median step s | rollout side s | mean reward | batches/s vs (a) | tokens/s vs (a) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| ({r['key']}) | {r['label']} | {r['engine_dtype']} "
            f"| {r['batches_per_s']:.2f} | {r['optimizer_steps_per_s']:.2f} "
            f"| {r['generated_tokens_per_s']:.0f} | {r['engine_tokens_per_s']:.0f} | {r['tokens_per_batch']:.0f} "
            f"| {r['step_s_median']:.3f} | {r['rollout_side_s']:.3f} | {r['reward_mean']:.3f} "
            f"| **{r['batches_per_s_vs_a']:.2f}x** | {r['generated_tokens_per_s_vs_a']:.2f}x |"
        )
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    parser.add_argument("--batches", type=int, default=30, help="batches per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first batches of each run not counted (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke test: HF runs only, 4 batches, 1 warm-up")
    parser.add_argument("--output", type=Path, default=None, help="markdown report (a .json is written next to it)")
    args = parser.parse_args(argv)
    wanted = {k.strip() for k in args.runs.split(",") if k.strip()}
    if args.quick:
        args.batches, args.warmup = 4, 1
        wanted -= {"c", "d"}
    if not 0 <= args.warmup < args.batches:
        parser.error("--warmup must be >= 0 and < --batches")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    notes: list[str] = []
    specs = [s for s in RUNS if s.key in wanted]
    shared_vllm = None
    if any(s.engine == "vllm" for s in specs):
        from lightning_offpolicy.rollout.vllm.inprocess import vllm_available

        if not vllm_available():
            notes.append("vLLM is not installed: rows (c) and (d) were skipped.")
            specs = [s for s in specs if s.engine != "vllm"]
    results = []
    try:
        if any(s.engine == "vllm" for s in specs):
            shared_vllm = start_vllm(args.warmup)
        for spec in specs:
            results.append(run_fit(spec, make_engine(spec, shared_vllm), args.batches, args.warmup))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if shared_vllm is not None:
            shared_vllm.close()
    add_ratios(results)
    if not any(r["key"] == "a" for r in results):
        notes.append("Run (a) was not part of this invocation: no ratios.")
    header = {
        **run_header("end_to_end.py", argv, f"intra-op threads={torch.get_num_threads()}"),
        "work": work_line(),
        "batches": args.batches,
        "warmup": args.warmup,
        "quick": args.quick,
        "elapsed_s": time.perf_counter() - began,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "notes": notes,
    }
    write_report(args.output, render(results, notes, header), {"header": header, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
