#!/usr/bin/env python
"""Tool use side by side: TRL's ``GRPOTrainer(tools=[multiply])`` and the kit's episodes, on the same task.

* **Checkpoint**: ``tiny:multiply`` (a tiny Qwen2, byte-level BPE tokenizer and Qwen2.5-Instruct's chat template
  with its tool branch, warmed up on solved episodes; docs/multi_turn.md), one HF-format directory both sides load
  with its own tokenizer. TRL's ``add_response_schema`` recognises the template, so TRL parses the tool calls with
  its own parser; the kit with its Hermes parser.
* **Task**: ``"What is 4821 * 726?"`` with the ``multiply`` tool (``data/tasks/tool_use.py``). Reward 1 when the
  episode's last assistant turn states the exact product and calls no tool, else 0 (``MultiplyToolTask.reward``).
  TRL passes its reward function the conversation; the score reads its last assistant message.
* **Episodes**: at most 3 model turns (TRL ``max_tool_calling_iterations=2``), at most 96 ids after the prompt,
  model and tool tokens together (TRL ``max_completion_length=96``, which is also each turn's ``max_new_tokens``
  there, so the kit's turns get ``max_new_tokens=96`` too); tool results never cut (the kit's cap is above any
  product's length).
* **Both sides**: 8 prompts x 8 samples per step, temperature 1, no top-k / top-p, AdamW (lr, no weight decay,
  constant), gradient-norm clip 1.0, one optimizer step per batch, PPO clip 0.2 / 0.28, token-mean loss (TRL
  ``loss_type="dapo"``), no KL, float32, HF ``generate``, one thread each. The prompts are one seeded list,
  consumed in order by both sides; each side in its own process.
* **TRL**: ``GRPOTrainer(model=<dir>, processing_class=<its tokenizer>, tools=[multiply], reward_funcs=...)``.
* **Kit**: ``OffPolicyRLModule(model=<dir>)`` + ``RolloutCallback(HFEngine(), episodes=EpisodeSettings(
  tools=[multiply], ...))``.

Per step it records the mean reward of the 64 episodes and the wall time from one step's start to the next. The
report gives, per side, the final training success rate (mean of the last 10 steps), the first step where the
10-step running mean reaches the threshold and the median s/step, per seed and over ``--seeds`` (each seed: its
own prompts and sampler seeds; the checkpoint is the same). Then each side's final model, and the checkpoint
before training, are evaluated by one evaluator (the kit's episode runner) on 200 held-out questions, greedy and
sampled: the success rate with less noise than the last training steps.

Usage::

    python benchmarks/vs_trl_tools.py --seeds 0,1 --jobs 2 --output docs/reports/performance_vs_trl_tools.md
    python benchmarks/vs_trl_tools.py --quick --output /tmp/vs_trl_tools.md     # smoke test, 3 steps
    python benchmarks/vs_trl_tools.py --steps 6 --held-out-prompts 20 --tool-latency long-tailed \
        --output docs/reports/performance_vs_trl_tools_slow_tool.md            # each tool call waits 0.1-2 s

It writes ``<output>.md``, ``<output>.json`` and ``<output>.png`` (the success-rate curves).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness.report import run_header
from vs_trl_report import (
    LABELS,
    aggregate,
    compare,
    header_lines,
    results_lines,
    summarize_run,
    trl_version,
    write_outputs,
)
from vs_trl_sides import TRLStepRecorder, _step_record
from vs_trl_task import WINDOW

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = "tiny:multiply"
#: The settings both sides share (written into the JSON header).
SETTINGS: dict[str, Any] = {
    "prompts_per_step": 8,
    "samples_per_prompt": 8,
    "max_turns": 3,
    "max_episode_tokens": 96,
    "temperature": 1.0,
    "learning_rate": 3e-4,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "eps_clip_low": 0.2,
    "eps_clip_high": 0.28,
    "loss": "token-mean (TRL loss_type='dapo')",
    "kl": 0.0,
    "dtype": "float32",
    "threads": 1,
}
#: The running-mean success rate whose first crossing the report gives.
THRESHOLD = 0.6
TITLE = "Tool use (multiply): kit vs TRL GRPOTrainer(tools=[multiply]), same checkpoint, prompts and settings"
SIDES = ("trl", "kit")


def make_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` multiplication questions from ``MultiplyToolTask`` drawn with ``seed``: prompt and metadata."""
    from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask

    task, rng = MultiplyToolTask(), random.Random(seed)
    return [{"prompt": prompt, "metadata": metadata} for prompt, metadata in (task.sample(rng) for _ in range(count))]


def last_reply_reward(completion: list[dict[str, Any]], answer: int) -> float:
    """TRL's side of the reward: ``MultiplyToolTask.reward`` of the conversation's last message, 0 unless it is an
    assistant reply without a tool call (an episode that stopped at a call gave no answer)."""
    from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask

    last = completion[-1] if completion else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0
    return MultiplyToolTask().reward(last.get("content") or "", {"answer": answer})


def trl_reward(prompts: list[Any], completions: list[list[dict[str, Any]]], answer: list[int], **_: Any) -> list[float]:
    """TRL's reward signature: the dataset's ``answer`` column comes as a keyword."""
    return [last_reply_reward(c, a) for c, a in zip(completions, answer, strict=True)]


def check_same_prompt_ids(model_dir: Path, prompt: str) -> int:
    """The kit renders a prompt to the ids TRL generates from (``apply_chat_template(tools=[multiply])``).

    Returns:
        The prompt's length in ids.

    Raises:
        RuntimeError: They differ (the comparison would not be on the same inputs).
    """
    from transformers import AutoTokenizer

    from lightning_offpolicy.data.chat import renderer_for
    from lightning_offpolicy.data.tasks.tool_use import multiply

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kit_ids = renderer_for(tokenizer, [multiply]).prompt_ids(prompt)
    trl_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tools=[multiply], add_generation_prompt=True, tokenize=True
    )
    trl_ids = list(trl_ids["input_ids"] if hasattr(trl_ids, "keys") else trl_ids)
    if kit_ids != trl_ids:
        raise RuntimeError(f"vs_trl_tools: the kit's prompt ids {kit_ids} differ from TRL's {trl_ids}.")
    return len(kit_ids)


#: Held-out prompts of the final evaluation (the task's held-out stream, which no training row draws from);
#: ``--held-out-prompts`` sets it.
HELD_OUT = {"prompts": 200}
#: The multiply tool both sides call: as shipped, or behind agentic.py's long-tailed latency (0.1-2 s, mean 0.26 s).
TOOL_LATENCIES = ("none", "long-tailed")
TOOL = {"latency": "none"}
#: The kit's ``AsyncSettings(max_staleness=N)`` (``--kit-max-staleness``): with N >= 1 an ``HFProcessEngine`` plays the
#: next batch's episodes (its tool calls included) while the trainer steps on this one; 0: synchronous, ``HFEngine()``.
KIT = {"max_staleness": 0}


def the_tool() -> Any:
    """The ``multiply`` both sides are given (the same name, docstring and signature either way)."""
    if TOOL["latency"] == "long-tailed":
        from agentic import slow_multiply

        return slow_multiply
    from lightning_offpolicy.data.tasks.tool_use import multiply

    return multiply


def held_out_success(model: Any, model_dir: str) -> dict[str, float]:
    """The same evaluator for both sides' final models (and the checkpoint): the kit's episode runner on
    ``HELD_OUT["prompts"]`` held-out questions, greedy and sampled (temperature 1, seed 0), with the task's own
    episode settings (``demo.tool_use.tool_use_episodes``) and the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask
    from lightning_offpolicy.demo.tool_use import tool_use_success

    task, tokenizer = MultiplyToolTask(), AutoTokenizer.from_pretrained(model_dir)
    model.eval()
    return {
        mode: tool_use_success(model, tokenizer, task, HELD_OUT["prompts"], greedy=mode == "greedy", seed=0)
        for mode in ("greedy", "sampled")
    }


# --------------------------------------------------------------------------- one side, in its own process


def run_trl(workdir: Path, steps: int, seed: int) -> dict[str, Any]:
    """TRL 1.x ``GRPOTrainer(tools=[multiply])`` with the shared settings; per-step reward and wall time."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    multiply = the_tool()
    rows = json.loads((workdir / "rows.json").read_text())
    model_dir = (workdir / "model").read_text().strip()
    recorder = TRLStepRecorder()

    config = GRPOConfig(
        output_dir=str(workdir / "trl_out"),
        max_steps=steps,
        per_device_train_batch_size=SETTINGS["prompts_per_step"] * SETTINGS["samples_per_prompt"],
        gradient_accumulation_steps=1,
        num_generations=SETTINGS["samples_per_prompt"],
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=SETTINGS["max_episode_tokens"],
        max_tool_calling_iterations=SETTINGS["max_turns"] - 1,
        temperature=SETTINGS["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=SETTINGS["learning_rate"],
        weight_decay=SETTINGS["weight_decay"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=SETTINGS["max_grad_norm"],
        epsilon=SETTINGS["eps_clip_low"],
        epsilon_high=SETTINGS["eps_clip_high"],
        loss_type="dapo",
        beta=0.0,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": row["prompt"]}] for row in rows],
            "answer": [row["metadata"]["answer"] for row in rows],
        }
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=trl_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        tools=[multiply],
        callbacks=[recorder.callback()],
    )
    if trainer.chat_template is not None:
        raise RuntimeError("vs_trl_tools: TRL replaced the checkpoint's chat template; the prompts would differ.")
    began = time.perf_counter()
    trainer.train()
    record = _step_record(recorder.starts, recorder.rewards, began)
    record["held_out"] = held_out_success(trainer.model, model_dir)
    return record


def run_kit(workdir: Path, steps: int, seed: int) -> dict[str, Any]:
    """The kit as a user writes it: ``OffPolicyRLModule(model=<dir>)`` + ``RolloutCallback(HFEngine(),
    episodes=EpisodeSettings(tools=[multiply]))``; per-step reward and wall time."""
    from functools import partial

    import lightning as L
    import torch
    from harness.fit import bare_trainer
    from torch.utils.data import DataLoader

    from lightning_offpolicy.correction import PolicyLossConfig
    from lightning_offpolicy.data.tasks.datamodule import PromptDataset, collate_prompts
    from lightning_offpolicy.data.tasks.tool_use import product_reward
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.rollout import AsyncSettings, HFEngine, HFProcessEngine, SamplingConfig
    from lightning_offpolicy.rollout.multi_turn import EpisodeSettings

    rows = json.loads((workdir / "rows.json").read_text())
    model_dir = (workdir / "model").read_text().strip()
    starts: list[float] = []
    rewards: list[float] = []

    class Record(L.Callback):
        # Placed after the RolloutCallback: its on_train_batch_start has attached the rollout.
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.perf_counter())
            rewards.append(float(batch.rollout.rewards.mean()))

        def on_train_end(self, trainer, pl_module):
            starts.append(time.perf_counter())

    L.seed_everything(seed, verbose=False)
    module = OffPolicyRLModule(
        model=model_dir,
        optimizer=partial(torch.optim.AdamW, lr=SETTINGS["learning_rate"], weight_decay=SETTINGS["weight_decay"]),
        loss=PolicyLossConfig(eps_clip_low=SETTINGS["eps_clip_low"], eps_clip_high=SETTINGS["eps_clip_high"]),
        gradient_clip_val=SETTINGS["max_grad_norm"],
        temperature=SETTINGS["temperature"],
        seed=seed,
    )
    staleness = KIT["max_staleness"]
    rollout = RolloutCallback(
        # Asynchronous: the engine keeps its own float32 copy of the weights, in a process of its own.
        HFProcessEngine(dtype="float32") if staleness else HFEngine(),
        reward_fn=product_reward,
        sampling=SamplingConfig(
            max_new_tokens=SETTINGS["max_episode_tokens"],
            temperature=SETTINGS["temperature"],
            samples_per_prompt=SETTINGS["samples_per_prompt"],
        ),
        seed=seed,
        asynchrony=AsyncSettings(max_staleness=staleness),
        episodes=EpisodeSettings(
            tools=[the_tool()],
            max_turns=SETTINGS["max_turns"],
            max_episode_tokens=SETTINGS["max_episode_tokens"],
            max_tool_result_tokens=SETTINGS["max_episode_tokens"],
        ),
    )
    loader = DataLoader(
        PromptDataset([(row["prompt"], row["metadata"]) for row in rows]),
        batch_size=SETTINGS["prompts_per_step"],
        shuffle=False,
        collate_fn=collate_prompts,
    )
    trainer = bare_trainer(steps, [rollout, Record()])
    began = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    record = _step_record(starts, rewards, began)
    record["held_out"] = held_out_success(module.policy, model_dir)
    return record


def run_side(side: str, workdir: Path, steps: int, seed: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(SETTINGS["threads"])
    record = run_trl(workdir, steps, seed) if side == "trl" else run_kit(workdir, steps, seed)
    if len(record["rewards"]) != steps or len(record["step_s"]) != steps:
        raise RuntimeError(
            f"vs_trl_tools: the {side} side recorded {len(record['rewards'])} rewards and {len(record['step_s'])} "
            f"step times for {steps} steps."
        )
    return record


def _checkpoint_held_out(model_dir: str) -> dict[str, float]:
    """The checkpoint's held-out success before any training (one thread, as the sides)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(SETTINGS["threads"])
    return held_out_success(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), model_dir)


def _run_subprocess(side: str, workdir: Path, steps: int, seed: int) -> dict[str, Any]:
    out = workdir / f"{side}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--workdir", str(workdir)]
    cmd += ["--steps", str(steps), "--seed", str(seed), "--side-output", str(out)]
    cmd += ["--learning-rate", repr(SETTINGS["learning_rate"]), "--held-out-prompts", str(HELD_OUT["prompts"])]
    cmd += ["--tool-latency", TOOL["latency"], "--kit-max-staleness", str(KIT["max_staleness"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vs_trl_tools: the {side} side failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _run_from_record(side: str, seed: int, record: dict[str, Any]) -> dict[str, Any]:
    label = LABELS[side]
    if side == "kit" and KIT["max_staleness"]:
        label += f" (async, max_staleness={KIT['max_staleness']}, HFProcessEngine)"
    run = {"side": side, "engine": "hf", "label": label, "seed": seed, **record}
    run.update(summarize_run(record, THRESHOLD))
    return run


def _run_seed(seed: int, sides: list[str], steps: int, root: Path, model_dir: str) -> list[dict[str, Any]]:
    """Both sides on ``seed``'s prompts, one after the other (TRL first)."""
    workdir = root / f"seed{seed}"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "model").write_text(model_dir)
    (workdir / "rows.json").write_text(json.dumps(make_rows(steps * SETTINGS["prompts_per_step"], seed)))
    runs = []
    for side in sides:
        run = _run_from_record(side, seed, _run_subprocess(side, workdir, steps, seed))
        print(
            f"seed {seed} {side}: success {run['first_reward']:.3f} -> {run['final_reward']:.3f}, steps to "
            f"{THRESHOLD}: {run['steps_to_threshold']}, median s/step {run['median_step_s']:.2f}, held-out "
            f"greedy {run['held_out']['greedy']:.3f} sampled {run['held_out']['sampled']:.3f}",
            flush=True,
        )
        runs.append(run)
    return runs


def runs_in_workdir(root: Path) -> tuple[list[dict[str, Any]], float]:
    """The runs whose side finished in an earlier invocation's ``--workdir`` (``seed<N>/<side>.json``), in seed
    and side order, and the seconds from its first prompts file to its last record.

    Raises:
        FileNotFoundError: ``root`` holds no finished side.
    """
    runs, times = [], []
    for seed_dir in sorted(root.glob("seed*"), key=lambda path: int(path.name[4:])):
        times.append((seed_dir / "rows.json").stat().st_mtime)
        for side in SIDES:
            path = seed_dir / f"{side}.json"
            if path.exists():
                runs.append(_run_from_record(side, int(seed_dir.name[4:]), json.loads(path.read_text())))
                times.append(path.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(f"vs_trl_tools: no finished side (seed<N>/trl.json or kit.json) in {root}.")
    return runs, max(times) - min(times)


def held_out_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per side: the final models' held-out success rates, greedy and sampled, per seed and their mean."""
    out: dict[str, dict[str, Any]] = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        mine = [r["held_out"] for r in runs if r["side"] == side]
        out[side] = {
            mode: {"mean": sum(h[mode] for h in mine) / len(mine), "per_seed": [h[mode] for h in mine]}
            for mode in ("greedy", "sampled")
        }
    return out


def held_out_lines(header: dict[str, Any], held_out: dict[str, dict[str, Any]]) -> list[str]:
    """The report's held-out table: the checkpoint, then each side's final models."""
    start = header["held_out_start"]
    lines = [
        f"Held-out success of the final models ({header['held_out_prompts']} questions no training step saw, one "
        "episode each, the same evaluator for both sides: the kit's episode runner with the task's own limits), mean "
        "over the seeds:",
        "",
        "| model | greedy | per seed | sampled (temperature 1) | per seed |",
        "|---|---:|---|---:|---|",
        f"| `{header['checkpoint']}` before training | {start['greedy']:.3f} | | {start['sampled']:.3f} | |",
    ]
    for side, modes in held_out.items():
        greedy, sampled = modes["greedy"], modes["sampled"]
        lines.append(
            f"| {LABELS[side]} | **{greedy['mean']:.3f}** | {', '.join(f'{x:.3f}' for x in greedy['per_seed'])} "
            f"| **{sampled['mean']:.3f}** | {', '.join(f'{x:.3f}' for x in sampled['per_seed'])} |"
        )
    if {"trl", "kit"} <= set(held_out):
        lines += [
            "",
            "- held-out success kit - TRL: greedy "
            f"**{held_out['kit']['greedy']['mean'] - held_out['trl']['greedy']['mean']:+.3f}**, sampled "
            f"**{held_out['kit']['sampled']['mean'] - held_out['trl']['sampled']['mean']:+.3f}**.",
        ]
    return lines


def render(
    header: dict[str, Any], summary: list[dict[str, Any]], ratios: dict[str, Any], held_out: dict[str, Any]
) -> str:
    staleness = header.get("kit_max_staleness", 0)
    kit_engine = "HFProcessEngine(dtype='float32')" if staleness else "HFEngine()"
    kit_async = (
        f", asynchrony=AsyncSettings(max_staleness={staleness}): the next batch's episodes, tool calls included, "
        "are played while the trainer steps on this one; TRL is synchronous"
        if staleness
        else ""
    )
    lines = header_lines(header, TITLE)
    lines += ["Training success rate (the reward of the step's 64 episodes):", ""]
    lines += results_lines(summary, ratios, THRESHOLD, speed_goal=None)
    lines += [""] + held_out_lines(header, held_out)
    lines += [
        "",
        f"![success rate per step]({header['plot']})",
        "",
        "## Method",
        "",
        f"One invocation resolves `{header['checkpoint']}` (built locally the first time), checks that the kit "
        "renders a prompt to exactly the ids TRL generates from, and per seed writes "
        f"{header['num_prompts']} questions (that seed) and runs each side on them in its own Python process, "
        f"one after the other (TRL first), with one torch thread; {header['jobs']} seed(s) at a time. The prompt "
        f"is {header['prompt_ids']} ids (Qwen2.5's default system message, the tool's JSON schema, the question). "
        "Shared settings: " + ", ".join(f"{k}={v}" for k, v in header["settings"].items()) + ".",
        "",
        "- **TRL**: `GRPOTrainer(model=<dir>, processing_class=AutoTokenizer(<dir>), tools=[multiply], "
        "reward_funcs=reward)`, `GRPOConfig(per_device_train_batch_size=64, num_generations=8, "
        "steps_per_generation=1, num_iterations=1, max_completion_length=96, max_tool_calling_iterations=2, "
        "epsilon=0.2, epsilon_high=0.28, loss_type='dapo', beta=0, lr_scheduler_type='constant', bf16=False, "
        "shuffle_dataset=False, use_cpu=True)`; the dataset's prompts are one user message each. Its per-step "
        "success rate is the `reward` it logs.",
        "- **Kit**: `OffPolicyRLModule(model=<dir>, optimizer=AdamW(...), loss=PolicyLossConfig(eps_clip_low=0.2, "
        f"eps_clip_high=0.28))` + `RolloutCallback({kit_engine}, reward_fn=product_reward, "
        "sampling=SamplingConfig(samples_per_prompt=8, max_new_tokens=96), episodes=EpisodeSettings(tools=[multiply], "
        f"max_turns=3, max_episode_tokens=96){kit_async})`, otherwise the defaults. Its per-step success rate is the "
        "mean of the batch's rewards.",
        "- **Where the two episode loops differ**: a tool result that would pass the 96-id budget ends TRL's "
        "episode at the call (no answer: reward 0) and the kit's as truncated (reward 0); a last turn cut by the "
        "budget is scored by TRL and earns 0 in the kit (truncated). Both append the tool message as the ids the "
        "chat template renders for it and keep the model's sampled ids as sampled.",
        "- **s/step**: wall time from the start of one optimizer step to the next (generation with the tool "
        "loop, scoring, the update, logging); median over the run.",
        "- Different random streams: the two sides do not draw the same samples from the same seed; compare the "
        "seed means.",
        "- s/step is wall time on a shared machine: the load average above moved during the run.",
    ]
    lines += [f"- {n}" for n in header.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per side (default 100)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 steps per side")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (prompts, samplers; default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (one torch thread each; default 1)")
    parser.add_argument("--sides", default="trl,kit", help="comma-separated subset of trl,kit (default both)")
    parser.add_argument("--learning-rate", type=float, default=SETTINGS["learning_rate"], help="AdamW lr of both sides")
    parser.add_argument(
        "--held-out-prompts", type=int, default=HELD_OUT["prompts"], help="questions of the final evaluation"
    )
    parser.add_argument(
        "--checkpoint",
        default=CHECKPOINT,
        help="the checkpoint both sides train: a tiny: name or an HF-format directory with the Qwen2.5 template "
        f"and the multiply tool's tokens (default {CHECKPOINT})",
    )
    parser.add_argument(
        "--tool-latency",
        choices=TOOL_LATENCIES,
        default="none",
        help="the multiply tool as shipped, or each call waiting 0.1-2 s (long-tailed, benchmarks/agentic.py)",
    )
    parser.add_argument(
        "--kit-max-staleness",
        type=int,
        default=0,
        help="the kit's AsyncSettings(max_staleness=N): N >= 1 plays the next batch's episodes in an HFProcessEngine "
        "while the trainer steps (TRL stays synchronous); default 0 (synchronous, HFEngine())",
    )
    parser.add_argument("--output", type=Path, default=None, help="markdown report (.json and .png next to it)")
    parser.add_argument("--note", action="append", default=[], help="a line added to the report's notes")
    parser.add_argument("--workdir", type=Path, default=None, help="where the prompts and records go (default: temp)")
    parser.add_argument(
        "--from-workdir",
        type=Path,
        default=None,
        help="no run: the report of the sides an earlier (e.g. interrupted) invocation finished in this --workdir",
    )
    # Internal: run one side in this process (the driver starts one subprocess per side).
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-output", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 3
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate={args.learning_rate} must be > 0")
    SETTINGS["learning_rate"] = args.learning_rate
    if args.held_out_prompts < 1:
        parser.error(f"--held-out-prompts={args.held_out_prompts} must be >= 1")
    HELD_OUT["prompts"] = args.held_out_prompts
    TOOL["latency"] = args.tool_latency
    if args.kit_max_staleness < 0:
        parser.error(f"--kit-max-staleness={args.kit_max_staleness} must be >= 0")
    KIT["max_staleness"] = args.kit_max_staleness
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} must be >= 1")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        parser.error(f"--sides={args.sides!r}: allowed values are trl and kit")
    if args.side is not None:  # child process
        record = run_side(args.side, args.workdir, args.steps, args.seed)
        args.side_output.write_text(json.dumps(record) + "\n")
        return 0
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seeds={args.seeds!r} must be comma-separated integers, e.g. 0,1")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds={args.seeds!r} must name at least one seed, each once")

    from lightning_offpolicy.demo.tiny import resolve_model_path

    model_dir = resolve_model_path(args.checkpoint)
    prompt_ids = check_same_prompt_ids(Path(model_dir), make_rows(1, seeds[0])[0]["prompt"])
    held_out_start = _checkpoint_held_out(model_dir)
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    if args.from_workdir is not None:
        try:
            runs, elapsed_s = runs_in_workdir(args.from_workdir)
        except FileNotFoundError as error:
            parser.error(str(error))
        seeds = sorted({run["seed"] for run in runs})
        args.steps = len(runs[0]["rewards"])
    else:
        with tempfile.TemporaryDirectory(prefix="vs_trl_tools-") as tmp:
            root = args.workdir or Path(tmp)
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                per_seed = list(pool.map(lambda s: _run_seed(s, sides, args.steps, root, model_dir), seeds))
        runs = [run for seed_runs in per_seed for run in seed_runs]
        elapsed_s = time.perf_counter() - began
    import transformers

    header = {
        **run_header("vs_trl_tools.py", argv),
        "trl": trl_version(),
        "transformers": transformers.__version__,
        "checkpoint": args.checkpoint,
        "prompt_ids": prompt_ids,
        "steps": args.steps,
        "quick": args.quick,
        "seeds": seeds,
        "jobs": args.jobs,
        "num_prompts": args.steps * SETTINGS["prompts_per_step"],
        "settings": SETTINGS,
        "threshold": THRESHOLD,
        "window": WINDOW,
        "held_out_prompts": HELD_OUT["prompts"],
        "tool_latency": TOOL["latency"],
        "kit_max_staleness": KIT["max_staleness"],
        "held_out_start": held_out_start,
        "speed_goal": None,
        "elapsed_s": elapsed_s,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "notes": list(args.note),
        "plot": args.output.with_suffix(".png").name if args.output is not None else "performance_vs_trl_tools.png",
    }
    summary = aggregate(runs)
    ratios = compare(summary)
    held_out = held_out_summary(runs)
    report = render(header, summary, ratios, held_out)
    print(report)
    if args.output is not None:
        data = {"header": header, "summary": summary, "ratios": ratios, "held_out": held_out, "runs": runs}
        write_outputs(args.output, report, data, title=TITLE, threshold=THRESHOLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
