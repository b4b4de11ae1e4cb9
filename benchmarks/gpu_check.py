#!/usr/bin/env python
"""What only a GPU can show: the shipped GPU recipes run on CUDA in bf16, and the logprob memory at V = 151936.

One run, four parts, each in a fresh subprocess (its own CUDA context and peak-memory counter), so a
failing part leaves its error in the report and the next part still runs:

* ``checkpoint``: a random-weight checkpoint shaped like Qwen2.5-1.5B-Instruct (Qwen2, hidden 1536,
  28 layers, 12 heads, 2 KV heads, MLP 8960, vocabulary 151936, tied embeddings), with a byte-level
  BPE tokenizer and the ChatML chat template of :mod:`lightning_offpolicy.demo.tiny_bpe` saved beside it.
  Nothing is downloaded.
* ``fsdp``: ``lightning-offpolicy fit --config configs/fsdp.yaml`` on that checkpoint, one GPU
  (ModelParallelStrategy, FSDP2 ``fully_shard`` per decoder layer, bf16, gradient checkpointing), with
  ``lightning_offpolicy.rollout.HFEngine`` instead of vLLM (see ``FSDP_ENGINE`` for why it shares the
  trainer's weights and generates synchronously there).
* ``lora``: ``lightning-offpolicy fit --config configs/lora_single_gpu.yaml`` likewise, with
  ``HFEngine(dtype="bfloat16")`` instead of vLLM (its own bf16 copy, asynchronous as the config asks).
* ``logprobs``: peak memory and time of the token logprobs from the hidden states at V = 151936,
  bf16: eager (logits, then ``log_softmax``), lean (logits, then the chunked ``token_logprobs``) and
  fused (``fused_linear_token_logprobs``, no logits), for a few sequence lengths, ratios from the same run.

The fits run the CLI's own ``main`` in the subprocess, with two read-only wrappers that record the
loss of every micro-batch (the module logs no loss scalar); every other figure is read back from the
TensorBoard files the run wrote. ``--budget-s`` bounds the whole run: a part starts only if the time
left covers it and the parts after it, and a part that overruns is stopped.

Usage::

    python benchmarks/gpu_check.py                                  # CUDA: docs/reports/performance_gpu.md / .json
    python benchmarks/gpu_check.py --output-dir /tmp/out --budget-s 380
    python benchmarks/gpu_check.py --cpu-smoke --output-dir /tmp/x  # the same code on CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_parts import (
    FSDP_ENGINE,
    LIMITS,
    LOGPROB_GPU,
    LOGPROB_SMOKE,
    LORA_ENGINE,
    PARTS,
    QWEN25_15B,
    SMOKE_FIT,
    SMOKE_LIMITS,
    SMOKE_SHAPE,
    worker_main,
)
from gpu_check_report import _gb, render

ROOT = Path(__file__).resolve().parent.parent
# =============================================================================== worker side


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "lightning", "transformers", "peft", "torchmetrics", "jsonargparse", "tensorboard"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_part(part: str, spec: dict, timeout: float, work: Path, log_sink) -> dict:
    """Run one part in a fresh subprocess (its own process group); its result, or its error."""
    spec_path, result_path, log_path = work / f"{part}.spec.json", work / f"{part}.result.json", work / f"{part}.log"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if spec["smoke"]:
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, str(spec_path), str(result_path)]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True)
        timed_out = False
        next_note = started + 30
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.perf_counter()
            if now - started > timeout:
                timed_out = True
                _kill_group(proc)
                break
            if now >= next_note:
                last = next((x for x in reversed(_tail(log_path, 600).splitlines()) if x.strip()), "")
                print(f"  ... {part}: {now - started:.0f} s | {last[-150:]}", flush=True)
                next_note = now + 30
    elapsed = time.perf_counter() - started
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    if log_sink is not None:
        log_sink.write(f"\n===== {part} (exit {proc.returncode}, {elapsed:.1f} s) =====\n{text}")
        log_sink.flush()
    failed = {"status": "error", "elapsed_s": elapsed, "log_tail": text[-3000:]}
    if timed_out:
        return {**failed, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not result_path.exists():
        return {**failed, "error": f"exit status {proc.returncode}"}
    result = json.loads(result_path.read_text())
    problems = result.get("problems") or []
    status = "ok" if not problems else "error"
    out = {"status": status, "elapsed_s": elapsed, **result}
    if problems:
        out["error"] = "; ".join(problems[:10])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--output-dir", type=Path, default=None, help="where performance_gpu.md / .json go (default docs/reports/)"
    )
    p.add_argument("--budget-s", type=float, default=380.0, help="wall-clock budget of the whole run (seconds)")
    p.add_argument("--cpu-smoke", action="store_true", help="the same code on CPU with a tiny model and 2 steps")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps per fit (default 8; smoke 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed logprob steps per case (default 3; smoke 1)")
    p.add_argument("--workdir", type=Path, default=None, help="checkpoint and runs (default: a temporary directory)")
    p.add_argument("--keep-workdir", action="store_true", help="do not delete the working directory at the end")
    p.add_argument("--worker-log", type=Path, default=None, help="also write every part's full output here")
    p.add_argument(
        "--fit-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more CLI argument for both fits, e.g. --fit-arg=--model.packing=off (repeatable)",
    )
    p.add_argument("--worker", nargs=3, metavar=("PART", "SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        part, spec_path, result_path = args.worker
        return worker_main(part, Path(spec_path), Path(result_path))

    started = time.perf_counter()
    smoke = args.cpu_smoke
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or set(parts) - set(PARTS):
        p.error(f"--parts: a subset of {', '.join(PARTS)}, got {args.parts!r}")
    parts = [x for x in PARTS if x in parts]  # dependency order: the checkpoint first
    max_steps = args.max_steps or (4 if smoke else 8)
    repeats = args.repeats or (1 if smoke else 3)
    out_dir = args.output_dir or (ROOT / "docs" / "reports")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    limits = SMOKE_LIMITS if smoke else LIMITS
    ckpt_dir = work / "qwen2.5-1.5b-shaped"
    print(f"gpu_check: {'CPU smoke' if smoke else 'CUDA'}, parts {', '.join(parts)}, budget {args.budget_s:.0f} s, "
          f"work {work}", flush=True)  # fmt: skip
    print("versions: " + ", ".join(f"{k} {v}" for k, v in _versions().items()), flush=True)
    fit_common = (
        [
            f"--model.model={ckpt_dir}",
            f"--trainer.max_steps={max_steps}",
            f"--trainer.logger.init_args.save_dir={work / 'runs'}",
            f"--trainer.default_root_dir={work}",
            "--trainer.enable_progress_bar=false",
        ]
        + (SMOKE_FIT if smoke else [])
        + args.fit_arg
    )
    specs: dict[str, dict] = {
        "checkpoint": {"shape": SMOKE_SHAPE if smoke else QWEN25_15B, "dir": str(ckpt_dir)},
        "fsdp": {
            "config": "configs/fsdp.yaml",
            "name": "fsdp",
            "args": fit_common + FSDP_ENGINE + ["--trainer.devices=1"],
        },
        "lora": {"config": "configs/lora_single_gpu.yaml", "name": "lora_single_gpu", "args": fit_common + LORA_ENGINE},
        "logprobs": {"shape": LOGPROB_SMOKE if smoke else LOGPROB_GPU, "repeats": repeats},
    }
    notes = {
        "fsdp": (
            "`lightning-offpolicy fit --config configs/fsdp.yaml` with `"
            + " ".join(specs["fsdp"]["args"])
            + "`: ModelParallelStrategy on one device (FSDP2 `fully_shard` per decoder layer), bf16, gradient "
            "checkpointing. The engine is `HFEngine` sharing the sharded module (its lean sampling loop), "
            "synchronously, instead of the config's asynchronous vLLM engine: engines with their own copy "
            "(`HFEngine(dtype=...)`, `HFProcessEngine`) refuse a sharded module, which cannot be deep-copied."
        ),
        "lora": (
            "`lightning-offpolicy fit --config configs/lora_single_gpu.yaml` with `"
            + " ".join(specs["lora"]["args"])
            + "`: LoRA rank 32 on every linear layer of the bf16 base, gradient checkpointing, asynchronous "
            "rollouts (max_staleness 2) from `HFEngine`'s own bf16 copy instead of vLLM."
        ),
    }
    for spec in specs.values():
        spec.update(smoke=smoke, workdir=str(work), max_steps=max_steps)
    results: dict[str, dict] = {}
    log_sink = open(args.worker_log, "w") if args.worker_log else None  # noqa: SIM115
    try:
        for i, part in enumerate(parts):
            elapsed = time.perf_counter() - started
            reserve = sum(limits[later][1] for later in parts[i + 1 :])
            timeout = min(limits[part][0], args.budget_s - elapsed - reserve)
            if part in ("fsdp", "lora") and results.get("checkpoint", {}).get("status", "ok") != "ok":
                results[part] = {"status": "skipped", "error": "no checkpoint (the checkpoint part did not succeed)"}
            elif part in ("fsdp", "lora") and "checkpoint" not in parts and not (ckpt_dir / "config.json").exists():
                results[part] = {"status": "skipped", "error": f"no checkpoint at {ckpt_dir} (run the checkpoint part)"}
            elif timeout < limits[part][1]:
                results[part] = {"status": "skipped", "error": f"budget: {args.budget_s - elapsed:.0f} s left"}
            else:
                print(f"[{elapsed:6.1f} s] {part}: starting (limit {timeout:.0f} s)", flush=True)
                results[part] = run_part(part, specs[part], timeout, work, log_sink)
            r = results[part]
            summary = r.get("error") or ""
            if r["status"] == "ok" and "peak_allocated_bytes" in r:
                summary = f"peak {_gb(r['peak_allocated_bytes'])} GiB, wall {r['wall_s']:.1f} s"
            print(f"[{time.perf_counter() - started:6.1f} s] {part}: {r['status']} {summary[:400]}", flush=True)
            if r["status"] == "error" and r.get("log_tail"):
                print("\n".join("    " + x for x in r["log_tail"].strip().splitlines()[-15:]), flush=True)
    finally:
        if log_sink is not None:
            log_sink.close()
        if not args.keep_workdir and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    first = next((r for r in results.values() if r.get("device_name")), {})
    header = {
        "title": "GPU check: FSDP2 and LoRA recipes on CUDA, logprob memory at V = 151936"
        + (" (CPU smoke run)" if smoke else ""),
        "smoke": smoke,
        "device_name": first.get("device_name"),
        "device_memory_bytes": first.get("device_memory_bytes"),
        "torch_runtime": first.get("torch"),
        "cuda": first.get("cuda"),
        "versions": _versions(),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "code": _code_line(),
        "command": "python "
        + shlex.join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "budget_s": args.budget_s,
        "elapsed_s": time.perf_counter() - started,
        "max_steps": max_steps,
        "repeats": repeats,
    }
    data = {"header": header, "notes": notes, "parts": results}
    md, js = out_dir / "performance_gpu.md", out_dir / "performance_gpu.json"
    md.write_text(render(data))
    js.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {md} and {js} ({header['elapsed_s']:.0f} s)", flush=True)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def _code_line() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from harness.report import code_line

        return code_line()
    except Exception:  # no git on the machine: not worth failing the report
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
