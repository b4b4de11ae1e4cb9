"""The four parts of the GPU check, each run in its own subprocess: settings, workers, peak memory."""

from __future__ import annotations

import json
import math
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from harness.memory import status_kib  # benchmarks/ is the script's own folder

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
    QWEN25_15B,
    initializer_range=0.2,
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
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
