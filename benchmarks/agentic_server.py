#!/usr/bin/env python
"""Agentic rollouts on a vLLM server: episodes turn by turn against each episode going on alone.

* **Checkpoint and task**: ``tiny:reverse`` (the tiny Llama warmed up on reversing a word, heads of dim 64 as
  vLLM's CPU attention needs; ``tiny:multiply``'s Qwen2 of 8 heads of dim 64 on hidden 128 is not servable:
  vLLM's Qwen2 derives its head size from hidden / heads), 8 prompts x 8 samples a batch of the ``reverse``
  task, served by one local vLLM server (``launch_local_server``, float32, the checkpoint's own weights)
  through ``RemoteVLLMEngine``; at most 3 model turns and 160 ids after the prompt, 48 new tokens a turn,
  temperature 1 (turn lengths from a few tokens to the cap).
* **Long-tailed turns** (``--model long-tail``): ``benchmarks/long_tail_task.py``'s warmed-up 10M Qwen2 (its turns
  end after a geometric number of tokens, mean ~128) with a ChatML template, its prompts, 256 new tokens a turn
  and 900 ids after the prompt, each reply scored by that task's score: turn lengths from one token to the cap.
* **Environment**: each reply answered with ``"again"`` until the third, after a latency fixed by the reply's
  text, drawn from ``benchmarks/agentic.py``'s long-tailed distribution (a Pareto from 0.1 s capped at 2 s,
  mean 0.26 s: a tool, a sandbox, a judge), or at once; each reply scored by the task's reward, a third each.
  The environment steps of a turn run side by side (the default ``max_concurrent_env_steps``).
* **Variants**: each environment with the episodes going on alone (the servers' default: each episode's next
  turn sent as soon as its environment answered, ``concurrent_calls`` = ``connection.max_concurrent_requests``)
  and turn by turn (the same engine saying it serves one call at a time: every going episode's next turn in one
  call after all the turn's steps, the runner before).
* **Measured** per batch (rollouts only; the same prompts and seeds for every variant): the rollout's wall
  time, episodes per second, the server's busy share (the part of the rollout with at least one ``generate``
  call in flight; the rest it idles, waiting for the environment), the generate calls, turns and reward per
  episode. The variants are interleaved batch by batch; the ratios are within one run. The two modes seed
  later turns differently (by turn, or by episode and turn): their episodes are other samples of one policy.

    python benchmarks/agentic_server.py --output docs/reports/performance_agentic_server.md
    python benchmarks/agentic_server.py --model long-tail --output docs/reports/performance_agentic_server_long_turns.md
    python benchmarks/agentic_server.py --quick --output /tmp/agentic_server.md
"""

from __future__ import annotations

import functools
import random
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentic import LATENCY_MAX_S, LATENCY_MIN_S, PARETO_SHAPE, run_and_report  # noqa: E402
from harness.report import header_bullets  # noqa: E402

from lightning_offpolicy.batch import PromptBatch  # noqa: E402
from lightning_offpolicy.data.environments import StepResult  # noqa: E402
from lightning_offpolicy.data.rewards import environment_reward  # noqa: E402
from lightning_offpolicy.data.tasks import get_task  # noqa: E402
from lightning_offpolicy.data.tokenizers import load_tokenizer  # noqa: E402
from lightning_offpolicy.rollout import SamplingConfig  # noqa: E402
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings  # noqa: E402
from lightning_offpolicy.rollout.rollouter import Rollouter  # noqa: E402
from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine, StartSettings, launch_local_server  # noqa: E402
from lightning_offpolicy.train.policy import resolve_model_spec  # noqa: E402

PROMPTS_PER_BATCH, SAMPLES = 8, 8
VARIANTS = {
    "instant environment, each episode alone": (False, True),
    "slow environment, each episode alone": (True, True),
    "instant environment, turn by turn": (False, False),
    "slow environment, turn by turn": (True, False),
}
BASE = "instant environment, each episode alone"


def latency(text: str) -> float:
    """The seconds the environment takes to answer ``text``: a capped Pareto draw fixed by the text."""
    uniform = (zlib.crc32(text.encode()) + 1) / (2**32 + 1)
    return min(LATENCY_MAX_S, LATENCY_MIN_S / uniform ** (1 / PARETO_SHAPE))


Score = Callable[[str, str, dict[str, Any]], float]
"""``(prompt, reply, metadata) -> reward`` of one reply."""


class Again:
    """Answers "again" until the third reply, slowly or at once; each reply scored by ``score`` (a third each)."""

    def __init__(self, slow: bool, score: Score) -> None:
        self.slow, self.score = slow, score

    def reset(self, prompt: str, metadata: dict[str, Any]) -> None:
        self.prompt, self.metadata, self.replies = prompt, metadata, 0

    def step(self, reply: str) -> StepResult:
        if self.slow:
            time.sleep(latency(f"{self.metadata.get('answer', self.prompt)}|{self.replies}|{reply}"))
        self.replies += 1
        reward = self.score(self.prompt, reply, self.metadata) / 3
        return StepResult(messages=[{"role": "user", "content": "again"}], reward=reward, done=self.replies >= 3)


@dataclass
class Setup:
    """A ``--model``'s checkpoint, prompts, reply score and turn limits."""

    model_dir: str
    batches: Callable[[int, int], list[PromptBatch]]
    score: Score
    turn_tokens: int
    episode_tokens: int


def reverse_setup(workdir: Path) -> Setup:
    """``tiny:reverse`` and its task: turns of a few tokens."""
    task = get_task("reverse")

    def batches(count: int, seed: int) -> list[PromptBatch]:
        rng, out = random.Random(seed), []
        for _ in range(count):
            samples = [task.sample(rng) for _ in range(PROMPTS_PER_BATCH)]
            out.append(PromptBatch(prompts=[p for p, _ in samples], metadata=[m for _, m in samples]))
        return out

    return Setup(resolve_model_spec("tiny:reverse"), batches, lambda _, reply, meta: task.reward(reply, meta), 48, 160)


def long_tail_setup(workdir: Path) -> Setup:
    """long_tail_task.py's warmed-up checkpoint (built into ``workdir``) with a ChatML template: long-tailed turns."""
    import long_tail_task
    from transformers import AutoTokenizer

    from lightning_offpolicy.demo.tiny_bpe import CHATML_TEMPLATE

    model_dir = long_tail_task.build_checkpoint(workdir / "long-tail", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHATML_TEMPLATE  # episodes render their turns as chat messages
    tokenizer.save_pretrained(model_dir)

    def batches(count: int, seed: int) -> list[PromptBatch]:
        prompts = long_tail_task.make_prompts(count * PROMPTS_PER_BATCH, seed)
        return [
            PromptBatch(prompts=prompts[i : i + PROMPTS_PER_BATCH], metadata=[{}] * PROMPTS_PER_BATCH)
            for i in range(0, len(prompts), PROMPTS_PER_BATCH)
        ]

    return Setup(str(model_dir), batches, lambda prompt, reply, _: long_tail_task.score(prompt, reply), 256, 900)


SETUPS = {"reverse": reverse_setup, "long-tail": long_tail_setup}


class TimedServerEngine(RemoteVLLMEngine):
    """A RemoteVLLMEngine that records each ``generate`` call's interval; ``alone=False``: one call at a time."""

    def __init__(self, *args: Any, alone: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.alone = alone
        self.intervals: list[tuple[float, float]] = []
        self.turn_lengths: list[int] = []
        self._intervals_lock = threading.Lock()

    @property
    def concurrent_calls(self) -> int:
        return super().concurrent_calls if self.alone else 1

    def generate(self, prompt_ids, sampling, seed=None):
        started, completions = time.perf_counter(), []
        try:
            completions = super().generate(prompt_ids, sampling, seed)
            return completions
        finally:
            with self._intervals_lock:
                self.intervals.append((started, time.perf_counter()))
                self.turn_lengths += [len(c.token_ids) for c in completions]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals (the time at least one call was in flight)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def turn_length_stats(lengths: list[int]) -> dict[str, float]:
    """Mean, median, 90th percentile and longest of the turns' generated tokens."""
    ordered = sorted(lengths)
    return {
        "turn_tokens_mean": statistics.mean(ordered),
        "turn_tokens_median": float(statistics.median(ordered)),
        "turn_tokens_p90": float(ordered[int(0.9 * (len(ordered) - 1))]),
        "turn_tokens_max": float(ordered[-1]),
    }


def run(batches: int, seed: int, model: str = "reverse") -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agentic_server-") as workdir:
        return _run(batches, seed, model, SETUPS[model](Path(workdir)))


def _run(batches: int, seed: int, model: str, setup: Setup) -> dict[str, Any]:
    tokenizer = load_tokenizer(setup.model_dir)
    server = launch_local_server(
        setup.model_dir, start=StartSettings(dtype="float32", kv_cache_space_gib=1), startup_timeout_s=600
    )
    turn_lengths: dict[str, list[int]] = {name: [] for name in VARIANTS}
    try:
        rollouters = {}
        for name, (slow, alone) in VARIANTS.items():
            engine = TimedServerEngine(
                server.base_url,
                alone=alone,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                request_timeout_s=300,
            )
            episodes = EpisodeSettings(
                environment=functools.partial(Again, slow, setup.score),
                max_turns=3,
                max_episode_tokens=setup.episode_tokens,
            )
            sampling = SamplingConfig(max_new_tokens=setup.turn_tokens, temperature=1.0, samples_per_prompt=SAMPLES)
            rollouter = Rollouter(engine, tokenizer, environment_reward, sampling, seed=0, episodes=episodes)
            rollouters[name] = (rollouter, engine)
        records: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for index, prompts in enumerate(setup.batches(batches + 1, seed)):
            for name in names[index % len(names) :] + names[: index % len(names)]:
                rollouter, engine = rollouters[name]
                engine.intervals, engine.turn_lengths = [], []
                started = time.perf_counter()
                rollout, _ = rollouter.rollout(prompts, index, 0)
                seconds = time.perf_counter() - started
                if index == 0:
                    continue  # warm-up: the server's first batches and the step threads
                stats = rollouter.last_stats or {}
                turn_lengths[name] += engine.turn_lengths
                records[name].append(
                    {
                        "rollout_s": seconds,
                        "episodes_per_s": rollout.num_sequences / seconds,
                        "server_busy_share": busy_seconds(engine.intervals) / seconds,
                        "calls": float(len(engine.intervals)),
                        "reward": float(rollout.rewards.mean()),
                        "turns_per_episode": float(stats.get("turns_per_episode", float("nan"))),
                    }
                )
        for rollouter, engine in rollouters.values():
            rollouter.runner.close()
            engine.close()
    finally:
        server.close()
    summary = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in records.items()
    }
    for name, values in summary.items():
        values["x_base"] = values["rollout_s"] / summary[BASE]["rollout_s"]
        values.update(turn_length_stats(turn_lengths[name]))
    return {
        "batches": batches,
        "seed": seed,
        "model": model,
        "turn_tokens": setup.turn_tokens,
        "per_batch": records,
        "median": summary,
    }


def render(report: dict[str, Any]) -> str:
    result = report["results"]
    median = result["median"]
    checkpoint = MODEL_NAMES[result.get("model", "reverse")]
    lines = [
        "# Agentic rollouts on a vLLM server: each episode alone against turn by turn",
        "",
        "Generated by `benchmarks/agentic_server.py` (its docstring has the method). Rollouts only: 64 episodes a",
        f"batch of {checkpoint} (3 model turns of at most {result.get('turn_tokens', 48)} new tokens), the environment "
        "answering at once or after a long-tailed latency",
        "(0.1-2 s, mean ~0.26 s), on one local vLLM server: each episode's next turn sent as soon as its environment",
        "answered (the default on the servers) or every going episode's next turn in one call per turn. Medians",
        "over the batches; the variants interleaved.",
        "",
        *header_bullets(report["header"]),
        report["load"],
        f"- **Batches**: {result['batches']} per variant after one warm-up batch, seed {result['seed']}",
        "",
        f"| variant | rollout s / batch | x {BASE} | episodes / s | server busy | generate calls | turns / episode "
        "| turn tokens mean / median / p90 / max | reward |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, v in median.items():
        turns = (
            f"{v['turn_tokens_mean']:.1f} / {v['turn_tokens_median']:.0f} / {v['turn_tokens_p90']:.0f} / "
            f"{v['turn_tokens_max']:.0f}"
            if "turn_tokens_mean" in v
            else "-"
        )
        lines.append(
            f"| {name} | {v['rollout_s']:.2f} | {v['x_base']:.2f} | {v['episodes_per_s']:.1f} "
            f"| {v['server_busy_share']:.0%} | {v['calls']:.0f} | {v['turns_per_episode']:.2f} | {turns} "
            f"| {v['reward']:.3f} |"
        )
    alone = median["slow environment, each episode alone"]["rollout_s"]
    by_turn = median["slow environment, turn by turn"]["rollout_s"]
    lines += [
        "",
        f"With the slow environment, turn by turn takes **{by_turn / alone:.2f}x** the time of each episode alone.",
        "",
    ]
    return "\n".join(lines)


MODEL_NAMES = {
    "reverse": "`tiny:reverse`",
    "long-tail": "long_tail_task.py's warmed-up 10M Qwen2 (geometric turn lengths)",
}


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--model",
        choices=tuple(SETUPS),
        default="reverse",
        help="tiny:reverse (turns of a few tokens, default) or long-tail (long_tail_task.py's checkpoint: turns "
        "of geometric length, mean ~128 tokens, up to 256)",
    )


def main(argv: list[str] | None = None) -> int:
    return run_and_report(
        argv, __doc__, "agentic_server.py", run, render, "vLLM CPU server", add_arguments=add_arguments
    )


if __name__ == "__main__":
    raise SystemExit(main())
