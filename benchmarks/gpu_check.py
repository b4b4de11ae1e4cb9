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

    python benchmarks/gpu_check.py                                  # CUDA: docs/performance_gpu.md / .json
    python benchmarks/gpu_check.py --output-dir /tmp/out --budget-s 380
    python benchmarks/gpu_check.py --cpu-smoke --output-dir /tmp/x  # the same code on CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import math
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
from typing import Any

from _report import status_kib  # benchmarks/ is the script's own folder

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("checkpoint", "fsdp", "lora", "logprobs")

#: Qwen2.5-1.5B-Instruct's config.json (the fields that shape the compute and memory).
QWEN25_15B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    hidden_act="silu",
)
#: --cpu-smoke: the same architecture, tiny (a vocabulary still larger than the tokenizer's). A 2-layer
#: model at the usual init (0.02) passes its input embedding through almost unchanged and, with tied
#: embeddings, predicts its input token again with certainty; at 0.2 its layers shape the output, as the
#: 28 layers of the real shape do at 0.02.
SMOKE_SHAPE: dict[str, Any] = dict(
    initializer_range=0.2,
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    hidden_act="silu",
)
#: Standard deviation of the logits over the tokenizer's ids, on a chat prompt, that the checkpoint's
#: final norm is scaled to. A random model at the default init spreads its probability over all 151936
#: ids (logit std ~0.8), nearly all of which the small tokenizer decodes to nothing: every reward would
#: be 0, every GRPO advantage 0, and the loss and gradient exactly 0. The embedding rows beyond the
#: tokenizer are zeroed (a real checkpoint's padding rows are untrained too) and the final norm's weight
#: scaled, so that completions are text (entropy ~2.5 nats, measured on CPU at this shape) and the
#: rewards of a group differ.
LOGIT_STD = 5.0

#: configs/fsdp.yaml asks for vLLM, asynchronous (max_staleness 2). Without vLLM, the engine that runs
#: with FSDP2 on one device is the HFEngine that shares the trainer's (sharded) module (its lean loop,
#: under no_grad there), synchronously: engines with their own copy refuse a sharded module, which
#: cannot be deep-copied.
FSDP_ENGINE = [
    "--rollout.engine.class_path=lightning_offpolicy.rollout.HFEngine",
    "--rollout.engine.init_args.dtype=null",
    "--rollout.asynchrony.max_staleness=0",
    "--rollout.asynchrony.sync_every=1",
]
#: configs/lora_single_gpu.yaml without vLLM: the HFEngine with its own bf16 copy, asynchronous as shipped.
LORA_ENGINE = [
    "--rollout.engine.class_path=lightning_offpolicy.rollout.HFEngine",
    "--rollout.engine.init_args.dtype=bfloat16",
]
#: --cpu-smoke: sizes small enough for a 2-core machine.
SMOKE_FIT = [
    "--trainer.accelerator=cpu",
    "--data.init_args.prompts_per_step=4",
    "--rollout.sampling.samples_per_prompt=2",
    "--rollout.sampling.max_new_tokens=4",
]

#: (hidden, vocab, token counts) of the logprob part.
LOGPROB_GPU = (1536, 151936, (2048, 4096, 8192))
LOGPROB_SMOKE = (32, 4096, (128, 256))
LOGPROB_METHODS = ("eager", "lean", "fused")
LOGPROB_CHUNK = 1024
TEMPERATURE = 1.0

#: Seconds a part may take at most, and the least it needs to be worth starting (GPU; smoke: its own).
LIMITS = {
    "checkpoint": (150, 30),
    "fsdp": (200, 60),
    "lora": (160, 50),
    "logprobs": (100, 25),
}
SMOKE_LIMITS = {"checkpoint": (120, 10), "fsdp": (180, 15), "lora": (180, 15), "logprobs": (120, 10)}

#: The per-step scalars collected from TensorBoard (every one must be finite).
SCALARS = {
    "reward": "train/reward",
    "grad_norm": "train/grad_norm",
    "rollout_kl": "rollout_corr/kl",
    "approx_kl": "ppo/approx_kl",
    "clip_frac": "ppo/clip_frac",
    "entropy": "train/entropy",
    "response_length": "train/response_length",
    "step_s": "perf/step_s",
    "generate_s": "rollout/generate_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
    "generated_tokens_per_s": "rollout/tokens_per_s",
    "policy_version": "train/policy_version",
    "staleness_max": "staleness/max",
}
REQUIRED = ("loss", "reward", "grad_norm", "rollout_kl", "step_s")


# =============================================================================== worker side
def _device(spec: dict) -> str:
    return "cpu" if spec["smoke"] else "cuda"


def _device_info(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), device_memory_bytes=props.total_memory)
    else:
        info.update(device_name=platform.processor() or platform.machine(), device_memory_bytes=None)
    return info


class PeakMemory:
    """Peak bytes allocated since :meth:`reset`: CUDA's allocator counter, or on CPU the process's
    peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` where Linux allows; else lifetime)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.resettable = True

    def current(self) -> int:
        import torch

        if self.device == "cuda":
            return torch.cuda.memory_allocated()
        return (status_kib("VmRSS") or 0) * 1024

    def reset(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.resettable = False

    def peak(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        hwm = status_kib("VmHWM")
        if hwm is None:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return hwm * 1024


def _reverse_texts(n: int = 2000) -> list[str]:
    """Prompts and answers of the reverse task (the configs' task): the tokenizer's training corpus."""
    import random

    from lightning_offpolicy.data.tasks import PromptDataModule

    task = PromptDataModule(task="reverse").task
    rng = random.Random(0)
    texts: list[str] = []
    for _ in range(n):
        prompt, meta = task.sample(rng)
        texts += [prompt, str(meta["answer"])]
    return texts


def worker_checkpoint(spec: dict) -> dict:
    """A random-weight Qwen2 checkpoint of the requested shape, in bf16, with tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lightning_offpolicy.demo.tiny_bpe import SPECIAL_TOKENS, chat_prompt_ids, train_bpe_tokenizer

    device = _device(spec)
    started = time.perf_counter()
    tokenizer = train_bpe_tokenizer(_reverse_texts(), vocab_size=512)  # ChatML template by default
    pad, _, eos = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    shape = dict(spec["shape"])
    config = Qwen2Config(**shape, pad_token_id=pad, eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    build_s = time.perf_counter() - started
    used = len(tokenizer)
    prompt = chat_prompt_ids(tokenizer, "rev abcde=")
    with torch.no_grad():
        model.get_input_embeddings().weight[used:].zero_()  # the head's rows too: tied
        ids = torch.tensor([prompt], device=device)
        std = float(model(input_ids=ids).logits[..., :used].float().std())
        model.model.norm.weight.mul_(LOGIT_STD / std)
        logits = model(input_ids=ids).logits[0, -1].float()
        probs = torch.softmax(logits, -1)
        entropy = float(-(probs * torch.log_softmax(logits, -1)).sum())
        in_tokenizer = float(probs[:used].sum())
    model.generation_config.eos_token_id = [eos, pad]
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    target = Path(spec["dir"])
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    return {
        **_device_info(device),
        "params": params,
        "tied_embeddings": tied,
        "tokenizer_ids": used,
        "logit_std_before": std,
        "next_token_entropy": entropy,
        "next_token_mass_in_tokenizer": in_tokenizer,
        "config": {k: getattr(model.config, k, None) for k in shape},
        "checkpoint_bytes": size,
        "build_s": build_s,
        "total_s": time.perf_counter() - started,
    }


def _read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    found = {key: tag for key, tag in SCALARS.items() if tag in tags}
    return {key: [(e.step, e.wall_time, e.value) for e in events.Scalars(tag)] for key, tag in found.items()}


def worker_fit(spec: dict) -> dict:
    """``lightning-offpolicy fit`` (the CLI's ``main``) with the part's arguments; figures from its TensorBoard."""
    import torch

    from lightning_offpolicy import cli
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.train import step as step_functions

    device = _device(spec)
    batches: list[dict] = []  # per training batch: its optimizer steps and micro-batch losses
    corrected_loss = step_functions.corrected_loss
    training_step = OffPolicyRLModule.training_step

    def recording_loss(*args: Any, **kwargs: Any):
        loss, info = corrected_loss(*args, **kwargs)
        if batches:
            batches[-1]["micro_losses"].append(float(loss.detach()))
        return loss, info

    def recording_step(self, batch, batch_idx):
        batches.append({"optimizer_steps": self.optimizer_steps_per_batch, "micro_losses": []})
        print(f"batch {batch_idx}: training step at {time.perf_counter() - started:.1f} s", flush=True)
        return training_step(self, batch, batch_idx)

    step_functions.corrected_loss = recording_loss
    OffPolicyRLModule.training_step = recording_step
    work = Path(spec["workdir"])
    argv = ["fit", "--config", str(ROOT / spec["config"]), *spec["args"]]
    print("lightning-offpolicy", shlex.join(argv), flush=True)
    sys.argv = ["lightning-offpolicy", *argv]  # as the console script runs it
    started = time.perf_counter()
    cli.main()
    wall = time.perf_counter() - started
    peak = peak_reserved = None
    if device == "cuda":
        torch.cuda.synchronize()
        peak, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:
        peak = (status_kib("VmHWM") or 0) * 1024
    (run_dir,) = [p for p in (work / "runs" / spec["name"]).iterdir() if p.is_dir()]
    scalars = _read_scalars(run_dir)
    losses = [sum(b["micro_losses"]) / max(b["optimizer_steps"], 1) for b in batches]
    steps = sorted({s for values in scalars.values() for s, _, _ in values})
    rows = []
    walls = dict((s, w) for s, w, _ in scalars.get("policy_version", []))
    for i, s in enumerate(steps):
        row: dict[str, Any] = {"batch": s}
        for key, values in scalars.items():
            at_step = [v for step, _, v in values if step == s]
            if at_step:
                row[key] = at_step[-1]
        row["loss"] = losses[s] if s < len(losses) else None
        if i and s in walls and steps[i - 1] in walls:
            row["batch_wall_s"] = walls[s] - walls[steps[i - 1]]
        rows.append(row)
    ckpt = run_dir / "checkpoints"
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.exists() else 0
    shutil.rmtree(ckpt, ignore_errors=True)  # a 1.5B sharded checkpoint is ~9 GB of disk
    bad = [
        f"batch {row['batch']} {key}={row.get(key)!r}"
        for row in rows
        for key in REQUIRED
        if not (isinstance(row.get(key), float) and math.isfinite(row[key]))
    ]
    if not rows:
        bad.append("no step was logged")
    final_version = rows[-1].get("policy_version") if rows else None
    if final_version != spec["max_steps"]:
        bad.append(f"train/policy_version ended at {final_version}, not max_steps={spec['max_steps']}")
    return {
        **_device_info(device),
        "argv": argv,
        "wall_s": wall,
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": peak_reserved,
        "checkpoint_bytes": ckpt_bytes,
        "batches_trained": len(batches),
        "rows": rows,
        "problems": bad,
    }


def _logprob_step(method: str, hidden, weight, targets):
    import torch

    from lightning_offpolicy.logprobs import token_logprobs
    from lightning_offpolicy.logprobs.fused import fused_linear_token_logprobs

    if method == "fused":
        return fused_linear_token_logprobs(hidden, weight, targets, temperature=TEMPERATURE, chunk_size=LOGPROB_CHUNK)
    logits = torch.nn.functional.linear(hidden, weight)
    if method == "lean":
        return token_logprobs(logits, targets, TEMPERATURE, chunk_size=LOGPROB_CHUNK)
    return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, targets[..., None]).squeeze(-1)


def worker_logprobs(spec: dict) -> dict:
    """Eager / lean / fused token logprobs (forward + backward) from bf16 hidden states and a tied head."""
    import torch

    device = _device(spec)
    width, vocab, token_counts = spec["shape"]
    meter = PeakMemory(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, width, device=device, generator=gen) * (LOGIT_STD / width**0.5)).to(dtype)
    weight.requires_grad_(True)
    for tokens in token_counts:
        hidden = torch.randn(1, tokens, width, device=device, generator=gen).to(dtype).requires_grad_(True)
        targets = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
        logits_bytes = tokens * vocab * 2  # one bf16 [T, V] logits tensor
        reference = None
        with torch.no_grad():  # float32 logprobs of the first 64 rows: the accuracy check
            z = torch.nn.functional.linear(hidden[0, :64].float(), weight.float()) / TEMPERATURE
            reference = torch.log_softmax(z, -1).gather(-1, targets[0, :64, None]).squeeze(-1)
        for method in LOGPROB_METHODS:
            row: dict[str, Any] = {"tokens": tokens, "vocab": vocab, "hidden": width, "method": method}
            try:
                _logprob_step(method, hidden[:, :64], weight, targets[:, :64]).sum().backward()  # warm-up
                times, peaks = [], []
                for _ in range(spec["repeats"]):
                    hidden.grad = weight.grad = None
                    sync()
                    base = meter.current()
                    meter.reset()
                    t0 = time.perf_counter()
                    lp = _logprob_step(method, hidden, weight, targets)
                    lp.sum().backward()
                    sync()
                    times.append(time.perf_counter() - t0)
                    peaks.append(meter.peak() - base)
                    diff = float((lp.detach()[0, :64].float() - reference).abs().max())
                    del lp
                row.update(
                    time_s=min(times),
                    times_s=times,
                    peak_extra_bytes=max(peaks),
                    peak_extra_x_logits=max(peaks) / logits_bytes,
                    max_abs_diff_fp32=diff,
                    grad_bytes=(hidden.numel() + weight.numel()) * 2,
                )
            except Exception as err:  # an OOM of one method at one length is a result, not the end
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            hidden.grad = weight.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del hidden, targets
    ratios = []
    for tokens in token_counts:
        by = {r["method"]: r for r in rows if r["tokens"] == tokens and "error" not in r}
        entry: dict[str, Any] = {"tokens": tokens}
        for other in ("eager", "lean"):
            if other in by and "fused" in by:
                fused = by["fused"]
                # On CPU (--cpu-smoke) a small step may not raise the peak RSS at all: no ratio then.
                if fused["peak_extra_bytes"] > 0:
                    entry[f"{other}_over_fused_peak"] = by[other]["peak_extra_bytes"] / fused["peak_extra_bytes"]
                entry[f"{other}_over_fused_time"] = by[other]["time_s"] / max(fused["time_s"], 1e-12)
        ratios.append(entry)
    return {**_device_info(device), "rows": rows, "ratios": ratios, "peak_resettable": meter.resettable}


def worker_main(part: str, spec_path: Path, result_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    if spec["smoke"]:
        import torch

        torch.set_num_threads(1)
    fn = {"checkpoint": worker_checkpoint, "fsdp": worker_fit, "lora": worker_fit, "logprobs": worker_logprobs}[part]
    result = fn(spec)
    result_path.write_text(json.dumps(result, indent=1, default=str))
    return 0


# =============================================================================== driver side
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


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _gb(x: Any) -> str:
    return f"{x / 2**30:.2f}" if _finite(x) else "-"


def _num(x: Any, fmt: str = ".4g") -> str:
    return format(x, fmt) if _finite(x) else "-"


def render(data: dict) -> str:
    h = data["header"]
    out = [f"# {h['title']}", ""]
    out += [
        f"* **Device**: {h.get('device_name') or '-'} ({_gb(h.get('device_memory_bytes'))} GiB), "
        f"torch {h.get('torch_runtime') or h['versions'].get('torch')}, CUDA {h.get('cuda') or '-'}",
        "* **Versions**: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
        f"* **Machine**: {h['machine']}",
        f"* **Date**: {h['date']}; **code**: {h['code']}",
        f"* **Command**: `{h['command']}`",
        f"* **Wall time**: {h['elapsed_s']:.0f} s of a {h['budget_s']:.0f} s budget",
        "",
        "Every part ran in its own subprocess (a fresh CUDA context, so its peak memory is its own). Peak "
        "memory is `torch.cuda.max_memory_allocated()` (on CPU, `--cpu-smoke`: the process's peak RSS). "
        "The model is random-weight, shaped like Qwen2.5-1.5B-Instruct: the figures are about the "
        "machinery (memory, time, finite numbers), not about learning.",
        "",
        "In the fit tables, `loss` is the mean over a batch's optimizer steps of the sum of their micro-batch "
        "losses (the module logs no loss: a wrapper around `lightning_offpolicy.train.step.corrected_loss` records "
        "it). GRPO advantages have zero mean per group and the PPO ratio starts at 1, so the loss is near 0 "
        "by construction; the gradient norm shows that the backward ran. The other columns are the logged "
        "`train/*`, `rollout_corr/kl`, `ppo/*`, `perf/step_s` (the training step), `rollout/generate_s` "
        "scalars; `batch wall s` is the time between two batches' logs.",
        "",
    ]
    parts = data["parts"]
    ck = parts.get("checkpoint", {})
    out += ["## Checkpoint", ""]
    if ck.get("status") == "ok":
        cfg = ck["config"]
        out.append(
            f"Qwen2 {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, MLP "
            f"{cfg.get('intermediate_size')}, {cfg.get('num_attention_heads')} heads / "
            f"{cfg.get('num_key_value_heads')} KV heads, vocabulary {cfg.get('vocab_size')}, tied embeddings "
            f"{ck['tied_embeddings']}: {ck['params'] / 1e9:.4g}B parameters, {ck['checkpoint_bytes'] / 1e9:.3g} GB "
            f"on disk (bf16), a {ck['tokenizer_ids']}-id BPE tokenizer with ChatML; built in {ck['total_s']:.1f} s. "
            f"Random weights; the rows beyond the tokenizer zeroed and the final norm scaled by "
            f"{LOGIT_STD / ck['logit_std_before']:.2f} (logit std {ck['logit_std_before']:.2f} -> {LOGIT_STD}): "
            f"next-token entropy on a chat prompt {ck['next_token_entropy']:.2f} nats, "
            f"{ck['next_token_mass_in_tokenizer']:.3f} of the probability on the tokenizer's ids."
        )
    else:
        out.append(_failure(ck))
    out.append("")
    for name, title in (("fsdp", "configs/fsdp.yaml"), ("lora", "configs/lora_single_gpu.yaml")):
        part = parts.get(name, {})
        out += [f"## `{title}`", ""]
        out.append(data["notes"][name])
        out.append("")
        if "rows" not in part:
            out += [_failure(part), ""]
            continue
        if part.get("status") != "ok":
            out += [f"**Problems**: {part.get('error')}", ""]
        out.append(
            f"Fit wall time {part['wall_s']:.1f} s (model load, {part['batches_trained']} batches, the final "
            f"checkpoint of {part['checkpoint_bytes'] / 1e9:.2f} GB); peak allocated "
            f"**{_gb(part['peak_allocated_bytes'])} GiB**, peak reserved {_gb(part.get('peak_reserved_bytes'))} GiB."
        )
        out += [
            "",
            "| batch | optimizer steps | loss | grad norm | reward | rollout_corr/kl | ppo/approx_kl | clip frac "
            "| entropy | resp. len | step s | generate s | batch wall s | train tok/s | generated tok/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in part["rows"]:
            out.append(
                f"| {r['batch']} | {_num(r.get('policy_version'), '.0f')} | {_num(r.get('loss'))} "
                f"| {_num(r.get('grad_norm'))} | {_num(r.get('reward'))} | {_num(r.get('rollout_kl'))} "
                f"| {_num(r.get('approx_kl'))} | {_num(r.get('clip_frac'))} | {_num(r.get('entropy'))} "
                f"| {_num(r.get('response_length'), '.1f')} | {_num(r.get('step_s'), '.3f')} "
                f"| {_num(r.get('generate_s'), '.3f')} | {_num(r.get('batch_wall_s'), '.3f')} "
                f"| {_num(r.get('train_tokens_per_s'), '.0f')} | {_num(r.get('generated_tokens_per_s'), '.0f')} |"
            )
        out.append("")
    lp = parts.get("logprobs", {})
    vocab = lp["rows"][0]["vocab"] if lp.get("rows") else LOGPROB_GPU[1]
    out += [f"## Token logprobs at V = {vocab} (hidden states -> logprobs, forward + backward)", ""]
    if "rows" not in lp:
        out += [_failure(lp), ""]
    else:
        out += [
            "bf16 hidden states `[1, T, H]` and head weight `[V, H]` (both requiring grad). eager: "
            "`log_softmax(linear(h, W).float() / t).gather(...)`; lean: `token_logprobs(linear(h, W), ...)` "
            f"(chunk {LOGPROB_CHUNK}, the trainer's fallback); fused: `fused_linear_token_logprobs` (the "
            "trainer's default, no logits). Peak extra: peak allocated during the step minus what was "
            "allocated before it, `hidden.grad` and `weight.grad` included; `x logits`: in units of one bf16 "
            f"`[T, V]` logits tensor. Best of {data['header']['repeats']} steps after a warm-up. "
            "`max |diff|`: against float32 `log_softmax` on the first 64 rows.",
            "",
            "| T | method | time fwd+bwd (ms) | peak extra (GiB) | x logits | max abs diff |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for r in lp["rows"]:
            if "error" in r:
                out.append(f"| {r['tokens']} | {r['method']} | {r['error']} | | | |")
                continue
            out.append(
                f"| {r['tokens']} | {r['method']} | {r['time_s'] * 1e3:.2f} | {_gb(r['peak_extra_bytes'])} "
                f"| {r['peak_extra_x_logits']:.3f} | {r['max_abs_diff_fp32']:.1e} |"
            )
        out += ["", "| T | eager / fused peak | eager / fused time | lean / fused peak | lean / fused time |"]
        out.append("|---:|---:|---:|---:|---:|")
        for r in lp["ratios"]:
            out.append(
                f"| {r['tokens']} | {_num(r.get('eager_over_fused_peak'), '.2f')} "
                f"| {_num(r.get('eager_over_fused_time'), '.2f')} | {_num(r.get('lean_over_fused_peak'), '.2f')} "
                f"| {_num(r.get('lean_over_fused_time'), '.2f')} |"
            )
        out.append("")
    out += ["## Status", "", "| part | status | seconds | error |", "|---|---|---:|---|"]
    for name in PARTS:
        p = parts.get(name, {"status": "not run"})
        err = (p.get("error") or "").replace("|", "/").replace("\n", " ")[:300]
        out.append(f"| {name} | {p.get('status')} | {_num(p.get('elapsed_s'), '.1f')} | {err} |")
    out.append("")
    return "\n".join(out)


def _failure(part: dict) -> str:
    if not part:
        return "Not run."
    text = f"**{part.get('status', 'not run')}**: {part.get('error', '')}"
    tail = part.get("log_tail")
    if tail:
        text += "\n\n```\n" + "\n".join(tail.strip().splitlines()[-25:]) + "\n```"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", type=Path, default=None, help="where performance_gpu.md / .json go (default docs/)")
    p.add_argument("--budget-s", type=float, default=380.0, help="wall-clock budget of the whole run (seconds)")
    p.add_argument("--cpu-smoke", action="store_true", help="the same code on CPU with a tiny model and 2 steps")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps per fit (default 8; smoke 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed logprob steps per case (default 3; smoke 1)")
    p.add_argument("--workdir", type=Path, default=None, help="checkpoint and runs (default: a temporary directory)")
    p.add_argument("--keep-workdir", action="store_true", help="do not delete the working directory at the end")
    p.add_argument("--worker-log", type=Path, default=None, help="also write every part's full output here")
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
    out_dir = args.output_dir or (ROOT / "docs")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    limits = SMOKE_LIMITS if smoke else LIMITS
    ckpt_dir = work / "qwen2.5-1.5b-shaped"
    print(f"gpu_check: {'CPU smoke' if smoke else 'CUDA'}, parts {', '.join(parts)}, budget {args.budget_s:.0f} s, "
          f"work {work}", flush=True)  # fmt: skip
    print("versions: " + ", ".join(f"{k} {v}" for k, v in _versions().items()), flush=True)
    fit_common = [
        f"--model.model={ckpt_dir}",
        f"--trainer.max_steps={max_steps}",
        f"--trainer.logger.init_args.save_dir={work / 'runs'}",
        f"--trainer.default_root_dir={work}",
        "--trainer.enable_progress_bar=false",
    ] + (SMOKE_FIT if smoke else [])
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
        from _report import code_line

        return code_line()
    except Exception:  # no git on the machine: not worth failing the report
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
