#!/usr/bin/env python
"""Agentic rollouts with slow tools: the kit's episodes with their environment steps side by side, and one at a time.

* **Checkpoint and task**: ``tiny:multiply`` (a tiny Qwen2 with Qwen2.5-Instruct's chat template, warmed up on
  solved tool-calling episodes) on ``"What is 4821 * 726?"`` with the ``multiply`` tool; reward 1 for the exact
  product in the last turn (``data/tasks/tool_use.py``). 8 prompts x 8 samples a batch (64 episodes), at most 3
  model turns and 208 ids after the prompt, 48 new tokens a turn, temperature 1, ``HFEngine`` on the float32
  weights.
* **Tools**: the shipped ``multiply`` (instant), and the same function behind a latency drawn from a
  long-tailed distribution: a Pareto of shape 1.5 from 0.1 s, capped at 2 s (median 0.16 s, mean 0.26 s), fixed per
  call by its arguments (the same call waits the same whatever the thread order). A search or a
  sandboxed code run costs 0.1-2 s.
* **Variants**: each tool with ``max_concurrent_env_steps`` 32 (the default: the steps of a turn side by
  side) and 1 (one at a time: the runner before concurrency).
* **Measured** per batch (rollouts only, no training; the same prompts and seeds for every variant): the
  rollout's wall time, episodes per second, the engine's share of it (time inside ``generate``; the rest is
  tools, rendering and scoring), the mean reward and tool calls per episode. The variants are interleaved
  batch by batch, so a burst of load hits all of them; the ratios are within one run.

Goal (docs/performance.md): the rollout with the slow tool within 1.3x of the same rollout with the instant
tool. TRL's ``GRPOTrainer(tools=...)`` on the same task: ``benchmarks/vs_trl_tools.py`` (instant tool); not run
with the slow tool here.

    python benchmarks/agentic.py --output docs/reports/performance_agentic.md
    python benchmarks/agentic.py --quick --output /tmp/agentic.md
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import header_bullets, load_bullet, run_header, write_report  # noqa: E402

from lightning_offpolicy.batch import PromptBatch  # noqa: E402
from lightning_offpolicy.data.tasks import get_task  # noqa: E402
from lightning_offpolicy.data.tasks.tool_use import multiply, product_reward  # noqa: E402
from lightning_offpolicy.data.tokenizers import load_tokenizer  # noqa: E402
from lightning_offpolicy.rollout import HFEngine, SamplingConfig  # noqa: E402
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings  # noqa: E402
from lightning_offpolicy.rollout.rollouter import Rollouter  # noqa: E402
from lightning_offpolicy.train.policy import resolve_model_spec  # noqa: E402

PROMPTS_PER_BATCH, SAMPLES = 8, 8
LATENCY_MIN_S, LATENCY_MAX_S, PARETO_SHAPE = 0.1, 2.0, 1.5
GOAL_RATIO = 1.3


def tool_latency(a: int, b: int) -> float:
    """The seconds a call with these arguments waits: a capped Pareto draw fixed by the arguments."""
    uniform = (zlib.crc32(f"{a}*{b}".encode()) + 1) / (2**32 + 1)
    return min(LATENCY_MAX_S, LATENCY_MIN_S / uniform ** (1 / PARETO_SHAPE))


@functools.wraps(multiply)  # the name, docstring and signature the chat template shows the model
def slow_multiply(a: int, b: int) -> int:
    time.sleep(tool_latency(int(a), int(b)))
    return multiply(a, b)


def prompt_batches(count: int, seed: int) -> list[PromptBatch]:
    task, rng = get_task("multiply"), random.Random(seed)
    batches = []
    for _ in range(count):
        samples = [task.sample(rng) for _ in range(PROMPTS_PER_BATCH)]
        batches.append(PromptBatch(prompts=[p for p, _ in samples], metadata=[m for _, m in samples]))
    return batches


class TimedEngine(HFEngine):
    """An HFEngine that adds up the seconds spent in ``generate``."""

    generate_s = 0.0

    def generate(self, prompt_ids, sampling, seed=None):
        started = time.perf_counter()
        try:
            return super().generate(prompt_ids, sampling, seed)
        finally:
            self.generate_s += time.perf_counter() - started


def build_rollouter(model: Any, tokenizer: Any, tool: Any, concurrent: int) -> tuple[Rollouter, TimedEngine]:
    engine = TimedEngine(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    engine.update_weights(model, 0)
    limits = dict(max_turns=3, max_episode_tokens=208, max_tool_result_tokens=16)
    episodes = EpisodeSettings(tools=[tool], max_concurrent_env_steps=concurrent, **limits)
    sampling = SamplingConfig(max_new_tokens=48, temperature=1.0, samples_per_prompt=SAMPLES)
    return Rollouter(engine, tokenizer, product_reward, sampling, seed=0, episodes=episodes), engine


VARIANTS = {
    "instant tool, side by side": (multiply, 32),
    "slow tool, side by side": (slow_multiply, 32),
    "instant tool, one at a time": (multiply, 1),
    "slow tool, one at a time": (slow_multiply, 1),
}


def run(batches: int, seed: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_spec("tiny:multiply")
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rollouters = {name: build_rollouter(model, tokenizer, tool, n) for name, (tool, n) in VARIANTS.items()}
    records: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for index, prompts in enumerate(prompt_batches(batches + 1, seed)):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            rollouter, engine = rollouters[name]
            engine.generate_s = 0.0
            started = time.perf_counter()
            rollout, _ = rollouter.rollout(prompts, index, 0)
            seconds = time.perf_counter() - started
            if index == 0:
                continue  # warm-up: the first forward passes and the tool threads
            stats = rollouter.last_stats or {}
            records[name].append(
                {
                    "rollout_s": seconds,
                    "episodes_per_s": rollout.num_sequences / seconds,
                    "engine_share": engine.generate_s / seconds,
                    "reward": float(rollout.rewards.mean()),
                    "tool_calls_per_episode": float(stats.get("tool_calls_per_episode", float("nan"))),
                    "tool_s_per_episode": float(stats.get("tool_s_per_episode", float("nan"))),
                }
            )
    for rollouter, _ in rollouters.values():
        rollouter.runner.close()
    summary = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in records.items()
    }
    base = summary["instant tool, side by side"]["rollout_s"]
    for values in summary.values():
        values["x_instant_side_by_side"] = values["rollout_s"] / base
    return {"batches": batches, "seed": seed, "per_batch": records, "median": summary}


def render(report: dict[str, Any]) -> str:
    result = report["results"]
    lines = [
        "# Agentic rollouts with slow tools: environment steps side by side",
        "",
        "Generated by `benchmarks/agentic.py` (its docstring has the method). Rollouts only: 64 episodes a batch",
        "of `tiny:multiply` with the `multiply` tool, instant or behind a long-tailed latency (0.1-2 s, mean",
        "~0.26 s), the environment steps of a turn side by side (`max_concurrent_env_steps: 32`, the default) or",
        "one at a time (`1`: the runner before concurrency). Medians over the batches; the variants interleaved.",
        "",
        *header_bullets(report["header"]),
        report["load"],
        f"- **Batches**: {result['batches']} per variant after one warm-up batch, seed {result['seed']}",
        "",
        "| variant | rollout s / batch | x instant, side by side | episodes / s | engine share | tool s / episode "
        "| tool calls / episode | reward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in result["median"].items():
        lines.append(
            f"| {name} | {v['rollout_s']:.2f} | {v['x_instant_side_by_side']:.2f} | {v['episodes_per_s']:.1f} "
            f"| {v['engine_share']:.0%} | {v['tool_s_per_episode']:.2f} | {v['tool_calls_per_episode']:.2f} "
            f"| {v['reward']:.3f} |"
        )
    slow = result["median"]["slow tool, side by side"]["x_instant_side_by_side"]
    serial = result["median"]["slow tool, one at a time"]["x_instant_side_by_side"]
    met = "yes" if slow <= GOAL_RATIO else "**no**"
    lines += [
        "",
        "## Goal",
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        f"| rollout with the slow tool within {GOAL_RATIO}x of the instant tool's | {slow:.2f}x side by side "
        f"({serial:.2f}x one at a time) | {met} |",
        "",
    ]
    return "\n".join(lines)


def run_and_report(
    argv: list[str] | None,
    doc: str,
    script: str,
    measure: Any,
    render_report: Any,
    *machine_extras: str,
    add_arguments: Any = None,
) -> int:
    """Parse ``--batches / --seed / --quick / --output`` (and what ``add_arguments(parser)`` adds), run
    ``measure(batches, seed, **added)`` and write its report."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4, help="timed batches per variant (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="smoke test: one timed batch")
    parser.add_argument("--output", type=Path, default=None, help="markdown report (.json next to it)")
    common = set(vars(parser.parse_args([])))
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    added = {name: value for name, value in vars(args).items() if name not in common}
    load_start = os.getloadavg()[0]
    results = measure(1 if args.quick else args.batches, args.seed, **added)
    report = {
        "header": run_header(script, argv if argv is not None else sys.argv[1:], *machine_extras),
        "load": load_bullet(load_start, os.getloadavg()[0]),
        "results": results,
    }
    write_report(args.output, render_report(report), report)
    return 0


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    return run_and_report(argv, __doc__, "agentic.py", run, render, "1 thread")


if __name__ == "__main__":
    raise SystemExit(main())
