#!/usr/bin/env python
"""Does the off-policy correction keep RL stable when the rollouts are stale or mismatched?

One command runs the same RL fits (the real :class:`~lightning_offpolicy.lightning.callback.RolloutCallback`
and :class:`~lightning_offpolicy.lightning.module.OffPolicyRLModule`) on two tasks, under several conditions,
each with several seeds:

* **tasks**: ``reverse`` (the SFT-warmed tiny Llama ``tiny:reverse``) and ``letter`` (copy the
  prompt's first letter; a random-init tiny Llama saved as an HF checkpoint with its own character
  tokenizer, the task of ``benchmarks/vs_trl.py``);
* **calibration**: first, per task, an on-policy fit at each learning rate of ``--lrs`` measures
  the exact KL between consecutive policy versions; the study then uses the largest learning rate
  whose KL per version is at most 1e-2 nats (the regime of large-model RL is about 1e-3 to 1e-2);
* **on-policy baseline**: synchronous (``max_staleness=0``), ``HFEngine(dtype="float32")``: the
  engine samples with exactly the trainer's weights, nothing to correct;
* **async staleness**: ``max_staleness`` 2, 4 and 8 optimizer steps (1, 2 and 4 batches behind
  with ``num_minibatches=2``), the same float32 engine, and each correction: bypass (PPO clipped
  against the stale ``pi_rollout`` as if on-policy: what a naive async system does), decoupled PPO
  only (clip against ``pi_prox``, no IS weight), token TIS, geometric mask, bypass + geometric mask,
  CISPO anchored on the rollout policy, decoupled PPO + a rollout-KL penalty;
* **engine mismatch**: synchronous, with a bfloat16 engine, and with a float32 engine whose
  private weights carry a fixed Gaussian perturbation.

Every run's per-batch series (reward, entropy, staleness, KL per version, every ``rollout_corr/*``
metric) goes to a JSON file; two PNGs plot the paired reward difference against staleness and the
reward curves per condition; a markdown report gives the calibration, the tables, the method, the
machine and the wall time.

Usage::

    python benchmarks/mismatch_study.py --output-dir docs/results     # the full study (docs/results.md)
    python benchmarks/mismatch_study.py --quick --output-dir /tmp/ms  # a smoke test, < 3 min
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as _dt
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

# One intra-op thread per run, set before torch is imported: on a shared 2-core machine a second
# thread waiting for a busy core slows every op down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from _report import code_line, cpu_model

ROOT = Path(__file__).resolve().parent.parent

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_offpolicy.correction import PolicyLossConfig, preset  # noqa: E402
from lightning_offpolicy.data.tasks import PromptDataModule  # noqa: E402
from lightning_offpolicy.lightning.callback import RolloutCallback  # noqa: E402
from lightning_offpolicy.lightning.module import OffPolicyRLModule  # noqa: E402
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, SamplingConfig  # noqa: E402

#: Per-batch keys recorded besides the ``rollout_corr/*`` keys below.
SERIES_KEYS = (
    "train/reward",
    "train/entropy",
    "train/response_length",
    "staleness/mean",
    "staleness/max",
    "ppo/clip_frac",
    "ppo/approx_kl",
    "perf/step_s",
)
#: The per-batch series of :class:`VersionKL`: exact KL between consecutive policy versions.
VERSION_KL_KEY = "policy/version_kl"
#: ``rollout_corr/*`` keys not recorded (redundant with ``kl`` or uninformative per batch), which
#: keeps the JSON of the full study near 1 MB; every ``*_reject_rate`` key is kept.
SKIPPED_CORR_KEYS = frozenset(
    f"rollout_corr/{k}" for k in ("log_ppl_diff", "ppl_ratio", "is_weight_min", "is_weight_max", "ess_seq")
)
#: Collapse: the trailing moving average over this many batches ...
COLLAPSE_WINDOW = 20
#: ... stays, to the end of the run, below the initial reward minus this margin ...
COLLAPSE_REWARD_DROP = 0.1
#: ... (initial reward: the mean over the first this many batches) ...
INITIAL_BATCHES = 10
#: ... or the moving average of the entropy stays below this value.
COLLAPSE_ENTROPY = 0.02

COLLAPSE_DEFINITION = (
    f"a run collapses at the first batch b from which, until the end of the run, the {COLLAPSE_WINDOW}-batch "
    f"trailing moving average of `train/reward` stays below the run's initial reward (mean of its first "
    f"{INITIAL_BATCHES} batches) minus {COLLAPSE_REWARD_DROP}, or the {COLLAPSE_WINDOW}-batch moving average of "
    f"`train/entropy` stays below {COLLAPSE_ENTROPY}"
)


@dataclasses.dataclass(frozen=True)
class Task:
    """One RL task of the study and the shape of its batches."""

    name: str
    description: str
    batches: int
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    #: Optimizer steps per batch: ``max_staleness`` k is k / num_minibatches batches behind.
    num_minibatches: int


TASKS: dict[str, Task] = {
    "reverse": Task(
        "reverse",
        "reverse a short digit string; the SFT-warmed tiny Llama `tiny:reverse` (starts near 0.4)",
        batches=150,
        prompts_per_step=16,
        samples_per_prompt=8,
        max_new_tokens=8,
        num_minibatches=2,  # the quickstart's
    ),
    "letter": Task(
        "letter",
        "repeat the prompt's first letter (reward: its share of the first 16 characters); a random-init "
        "tiny Llama saved as an HF checkpoint with a character tokenizer (`benchmarks/vs_trl.py`'s task)",
        batches=300,
        prompts_per_step=8,
        samples_per_prompt=8,
        max_new_tokens=16,
        num_minibatches=1,  # vs_trl's: one step per batch of 64 completions
    ),
}
#: How the report names each task's checkpoint (the letter task's lives in a temporary directory).
TASKS_MODEL_LABEL = {"letter": "vs_trl.build_checkpoint(seed=0) (random init, char tokenizer)"}


#: The KL-per-version band of large-model RL (nats per optimizer step); calibration aims below its top.
KL_BAND = (1e-3, 1e-2)


@dataclasses.dataclass(frozen=True)
class Condition:
    """One cell of the study: the task, how the rollouts are produced and how they are corrected."""

    name: str
    task: str
    group: str
    label: str
    preset: str
    preset_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_staleness: int = 0
    sync_every: int = 1
    engine: str = "float32"  # "float32" | "bfloat16" | "noisy" (float32 + a fixed Gaussian perturbation)
    loss_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: How pi_prox is obtained (OffPolicyCorrectionConfig.prox_method): recomputed, or AReaL's log-linear.
    prox_method: str = "recompute"

    @property
    def short(self) -> str:
        """The name without its task: ``stale4-tis``."""
        return self.name.split("/", 1)[1]

    @property
    def correction(self) -> str:
        """The correction's short name: ``tis`` for ``stale4-tis``, ``bypass`` for ``bf16-bypass``."""
        return self.short.partition("-")[2]

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "preset_kwargs": dict(self.preset_kwargs),
            "loss_kwargs": dict(self.loss_kwargs),
        }


#: The rollout-KL penalty's coefficient (k2 = (log pi_theta - log pi_rollout)^2 / 2 per token): its
#: gradient, coef * log-ratio, is ~0.1 per token at staleness 8 next to the policy term's |A| ~ 1.
ROLLOUT_KL_COEF = 1.0


#: Suffix of a correction's variant with AReaL's log-linear pi_prox (``prox_method="loglinear"``: no
#: proximal forward), e.g. ``tis-loglinear``; every correction with a pi_prox has one.
LOGLINEAR = "-loglinear"


def corrections(args: argparse.Namespace) -> dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """Every correction of the study: short name -> (label, preset, preset kwargs, loss kwargs).

    Those with a pi_prox (not bypass mode) also come as ``<name>-loglinear`` (see :data:`LOGLINEAR`).
    """
    table = _corrections(args)
    for short, (label, name, kwargs, loss_kwargs) in list(table.items()):
        if preset(name).needs_prox:  # the preset's defaults: its kwargs never switch bypass mode
            table[short + LOGLINEAR] = (f"{label}, log-linear pi_prox (AReaL)", name, kwargs, loss_kwargs)
    return table


def prox_method_of(short: str) -> str:
    """The ``prox_method`` of a correction's short name (``tis-loglinear`` -> ``loglinear``)."""
    return "loglinear" if short.endswith(LOGLINEAR) else "recompute"


def _corrections(args: argparse.Namespace) -> dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]]:
    geo = {"low": args.geo_low, "high": args.geo_high}
    return {
        "bypass": ("no correction (bypass: PPO vs pi_rollout)", "bypass", {}, {}),
        "decoupled": ("decoupled PPO only (no IS weight)", "disabled", {}, {}),
        "tis": ("decoupled + token TIS (cap 2)", "token_tis", {"clip_high": 2.0}, {}),
        "geo": (f"decoupled + geometric mask [{args.geo_low}, {args.geo_high}]", "geo_mis", geo, {}),
        "bypass-geo": (
            f"bypass + geometric mask [{args.geo_low}, {args.geo_high}]",
            "bypass_ppo_clip_geo_rs",
            geo,
            {},
        ),
        "cispo": ("CISPO (cap 2, anchor rollout)", "cispo", {"clip_high": 2.0, "anchor": "rollout"}, {}),
        "rkl": (
            f"decoupled + rollout-KL penalty (k2, coef {ROLLOUT_KL_COEF:g})",
            "disabled",
            {},
            {"rollout_kl_coef": ROLLOUT_KL_COEF},
        ),
    }


#: The corrections run at each staleness (the default plan; ``--corrections`` runs one list at every
#: level). Every correction where the mismatch is largest; the main contenders below it, to keep
#: ``make study`` near an hour on 2 cores.
STALENESS_PLAN = {
    8: ["bypass", "decoupled", "tis", "geo", "bypass-geo", "cispo", "rkl"],
    4: ["bypass", "decoupled", "tis", "bypass-geo"],
    2: ["bypass", "decoupled", "tis"],
}


def build_conditions(args: argparse.Namespace, task: str) -> list[Condition]:
    """Every condition of the study on ``task``, in report order."""
    known = corrections(args)
    conditions = [
        Condition(f"{task}/onpolicy", task, "on-policy", "on-policy baseline (sync, fp32 engine)", "disabled")
    ]
    for k in args.staleness:
        chosen = args.corrections or STALENESS_PLAN.get(k, list(known))
        # Push after every batch (num_minibatches optimizer steps): the bound is reached exactly,
        # and sync_every - 1 <= max_staleness holds for every k >= num_minibatches - 1.
        sync_every = min(TASKS[task].num_minibatches, k + 1)
        for short in chosen:
            label, name, kwargs, loss_kwargs = known[short]
            conditions.append(
                Condition(
                    f"{task}/stale{k}-{short}",
                    task,
                    f"async staleness {k}",
                    label,
                    name,
                    kwargs,
                    k,
                    sync_every,
                    loss_kwargs=loss_kwargs,
                    prox_method=prox_method_of(short),
                )
            )
    noisy = list(args.mismatch_corrections)
    bf16 = list(dict.fromkeys([noisy[0], noisy[-1]]))  # a bf16 engine is close: uncorrected vs the last
    for engine, prefix, group, chosen in (
        ("bfloat16", "bf16", "mismatch bf16 engine", bf16),
        ("noisy", "noisy", "mismatch noisy engine", noisy),
    ):
        for short in chosen:
            label, name, kwargs, loss_kwargs = known[short]
            conditions.append(
                Condition(
                    f"{task}/{prefix}-{short}",
                    task,
                    group,
                    label,
                    name,
                    kwargs,
                    0,
                    1,
                    engine,
                    loss_kwargs,
                    prox_method_of(short),
                )
            )
    return conditions


QUICK_CONDITIONS = ("onpolicy", "stale4-bypass", "stale4-tis")


# ------------------------------------------------------------------------------ one run


class NoisyHFEngine(HFEngine):
    """The embedded float32 engine with a fixed Gaussian perturbation of its private weights.

    A stand-in for a systematically different inference engine (quantisation, other kernels):
    after every ``update_weights`` each tensor gets the same noise, ``scale * rms(tensor at the
    first push) * N(0, 1)``, drawn once from its own generator (the global RNG, which seeds the
    sampler and the trainer, is left untouched, so runs stay paired across conditions).
    """

    def __init__(self, scale: float, noise_seed: int = 1234) -> None:
        super().__init__(dtype="float32")
        self.scale = scale
        self.noise_seed = noise_seed
        self._noise: dict[str, torch.Tensor] | None = None

    def update_weights(self, source: Any, version: int) -> None:
        super().update_weights(source, version)
        params = dict(self.model.named_parameters())
        if self._noise is None:
            generator = torch.Generator().manual_seed(self.noise_seed)
            self._noise = {}
            for name in sorted(params):
                p = params[name].detach()
                rms = p.float().square().mean().sqrt()
                self._noise[name] = (torch.randn(p.shape, generator=generator) * self.scale * rms).to(p.dtype)
        with torch.no_grad():
            for name, p in params.items():
                p.add_(self._noise[name])


class SeriesRecorder(L.Callback):
    """Collects the logged scalars of every training batch (placed after the RolloutCallback)."""

    def __init__(self) -> None:
        self.series: dict[str, list[float]] = {}
        self.batches = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        keys = [k for k in SERIES_KEYS if k in metrics] + sorted(
            k for k in metrics if k.startswith("rollout_corr/") and k not in SKIPPED_CORR_KEYS
        )
        for key in keys:
            # A key that appears late (none does today) is padded so every series has one value per batch.
            values = self.series.setdefault(key, [math.nan] * self.batches)
            values.append(float(metrics[key]))
        self.batches += 1
        for values in self.series.values():
            if len(values) < self.batches:
                values.append(math.nan)


class VersionKL(L.Callback):
    """Exact per-token KL(pi_v || pi_v+1) between consecutive policy versions, on a fixed probe.

    How far one optimizer step moves the policy sets how much a token ``k`` versions stale is off
    policy: large-model RL runs at about 1e-3 to 1e-2 nats per version. The probe is the response
    positions of the run's first training batch (its first ``PROBE_SEQUENCES`` sequences), fixed for
    the run. Before every optimizer step and after every batch the policy's full next-token
    distributions there are computed; each pair of consecutive versions gives the exact KL (a sum
    over the vocabulary, not a sampled estimate), averaged over the probe's response tokens.
    :attr:`per_batch` holds, per training batch, the mean over its optimizer steps.
    """

    PROBE_SEQUENCES = 32

    def __init__(self) -> None:
        self.per_batch: list[float] = []
        self._probe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._last: tuple[int, torch.Tensor] | None = None
        self._batch: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._probe is None:
            rollout = batch.rollout
            n = self.PROBE_SEQUENCES
            start = rollout.prompt_length
            mask = torch.zeros_like(rollout.attention_mask[:n], dtype=torch.bool)
            mask[:, start - 1 : -1] = rollout.response_mask[:n].bool()  # logits at t predict token t + 1
            self._probe = (rollout.input_ids[:n], rollout.attention_mask[:n], mask)
        self._observe(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._observe(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._observe(pl_module)
        self.per_batch.append(statistics.fmean(self._batch) if self._batch else math.nan)
        self._batch = []

    @torch.no_grad()
    def _observe(self, pl_module) -> None:
        version = int(pl_module.policy_version)
        if self._last is not None and self._last[0] == version:
            return
        input_ids, attention_mask, positions = self._probe
        logits = pl_module.policy(input_ids=input_ids, attention_mask=attention_mask).logits
        logp = torch.log_softmax(logits[positions].double(), dim=-1)
        if self._last is not None:
            before_version, before = self._last
            kl = (before.exp() * (before - logp)).sum(-1).mean()
            self._batch.append(float(kl) / (version - before_version))
        self._last = (version, logp)


def make_engine(kind: str, noise_scale: float) -> HFEngine:
    if kind == "noisy":
        return NoisyHFEngine(noise_scale)
    return HFEngine(dtype=kind)


def task_data(task: str, settings: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """``(data, reward_fn)`` of a fit on ``task``: a datamodule or a loader, and the reward (None: the datamodule's)."""
    if task == "reverse":
        data = PromptDataModule(task="reverse", prompts_per_step=settings["prompts_per_step"], num_train_prompts=2048)
        return data, None
    from torch.utils.data import DataLoader
    from vs_trl import kit_reward, make_prompts

    from lightning_offpolicy.data.tasks.datamodule import PromptDataset, collate_prompts

    # As in vs_trl: a fresh prompt for every row of every batch, in a seed-dependent order.
    prompts = make_prompts(settings["batches"] * settings["prompts_per_step"], seed=seed)
    loader = DataLoader(
        PromptDataset([(p, {}) for p in prompts]),
        batch_size=settings["prompts_per_step"],
        shuffle=False,
        collate_fn=collate_prompts,
    )
    return loader, kit_reward


def run_one(condition: Condition, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One fit of ``condition`` with ``seed``; returns its per-batch series (runs in a worker process).

    ``settings``: the task's ``model``, ``lr``, ``batches``, batch shape and ``noise_scale``.
    """
    torch.set_num_threads(1)
    started = time.perf_counter()
    L.seed_everything(seed, verbose=False)
    module = OffPolicyRLModule(
        model=settings["model"],
        optimizer=partial(torch.optim.AdamW, lr=settings["lr"]),
        correction=preset(condition.preset, **condition.preset_kwargs).replace(prox_method=condition.prox_method),
        # The quickstart's clip-higher.
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, **condition.loss_kwargs),
        num_minibatches=settings["num_minibatches"],
        max_tokens_per_microbatch=4096,
        gradient_clip_val=1.0,
        seed=seed,
    )
    data, reward_fn = task_data(condition.task, settings, seed)
    callback = RolloutCallback(
        engine=make_engine(condition.engine, settings["noise_scale"]),
        reward_fn=reward_fn,
        sampling=SamplingConfig(
            samples_per_prompt=settings["samples_per_prompt"], max_new_tokens=settings["max_new_tokens"]
        ),
        seed=seed,
        asynchrony=AsyncSettings(max_staleness=condition.max_staleness, sync_every=condition.sync_every),
    )
    recorder = SeriesRecorder()
    version_kl = VersionKL()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=settings["batches"] * settings["num_minibatches"],
        callbacks=[callback, recorder, version_kl],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, data)
    return {
        "condition": condition.name,
        "seed": seed,
        "lr": settings["lr"],
        "batches": recorder.batches,
        "wall_s": time.perf_counter() - started,
        "series": {**recorder.series, VERSION_KL_KEY: version_kl.per_batch},
    }


# ------------------------------------------------------------------------------ summaries


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average; the first ``window - 1`` entries average what is there."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def collapse_step(reward: Sequence[float], entropy: Sequence[float]) -> int | None:
    """First batch from which the run stays collapsed to its end (see ``COLLAPSE_DEFINITION``), else None."""
    if len(reward) < COLLAPSE_WINDOW:
        return None
    threshold = statistics.fmean(reward[:INITIAL_BATCHES]) - COLLAPSE_REWARD_DROP
    reward_ma = moving_average(reward, COLLAPSE_WINDOW)
    entropy_ma = moving_average(entropy, COLLAPSE_WINDOW) if entropy else [math.inf] * len(reward)
    first = None
    # Walk back from the end while the run is collapsed; only full windows count.
    for b in range(len(reward) - 1, COLLAPSE_WINDOW - 2, -1):
        if reward_ma[b] < threshold or entropy_ma[b] < COLLAPSE_ENTROPY:
            first = b
        else:
            break
    return first


def final_window(n: int) -> int:
    """Batches in the 'final' window: the last 10% of the run (at least one)."""
    return max(1, round(n / 10))


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    series = run["series"]
    reward = series["train/reward"]
    entropy = series.get("train/entropy", [])
    summary: dict[str, Any] = {
        "final_reward": statistics.fmean(reward[-final_window(len(reward)) :]),
        "auc_reward": statistics.fmean(reward),
        "initial_reward": statistics.fmean(reward[:INITIAL_BATCHES]),
        "final_entropy": statistics.fmean(entropy[-final_window(len(entropy)) :]) if entropy else math.nan,
        "collapse_step": collapse_step(reward, entropy),
    }
    for key, values in series.items():
        if key.startswith(("rollout_corr/", "staleness/", "policy/", "perf/")):
            finite = [v for v in values if math.isfinite(v)]
            summary[f"{key}:mean"] = statistics.fmean(finite) if finite else math.nan
            summary[f"{key}:max"] = max(finite) if finite else math.nan
    return summary


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize_condition(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for run in runs for k in run["summary"] if k != "collapse_step"})
    out: dict[str, Any] = {"seeds": [run["seed"] for run in runs]}
    for key in keys:
        mean, std = mean_std([run["summary"].get(key, math.nan) for run in runs])
        out[key] = {"mean": mean, "std": std}
    out["collapse_steps"] = [run["summary"]["collapse_step"] for run in runs]
    return out


#: Two-sided 95% Student-t quantiles by degrees of freedom (a few seeds: the normal 1.96 would be too narrow).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_delta(runs: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str) -> tuple[float, float, int]:
    """``key`` minus the baseline's ``key`` with the same seed (paired runs): mean, 95% CI half-width, n."""
    base = {run["seed"]: run["summary"][key] for run in baseline}
    deltas = [run["summary"][key] - base[run["seed"]] for run in runs if run["seed"] in base]
    deltas = [d for d in deltas if math.isfinite(d)]
    if not deltas:
        return math.nan, math.nan, 0
    n = len(deltas)
    half = T95.get(n - 1, 1.96) * statistics.stdev(deltas) / math.sqrt(n) if n > 1 else math.nan
    return statistics.fmean(deltas), half, n


def fmt_delta(mean: float, half: float) -> str:
    """``+0.012 [-0.004, +0.028]``: the mean and its 95% CI; bold when the CI excludes 0."""
    if not math.isfinite(mean):
        return "n/a"
    if not math.isfinite(half):
        return f"{mean:+.3f}"
    text = f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"
    return f"**{text}**" if abs(mean) > half else text


def reject_key(keys: Sequence[str]) -> str | None:
    """The summary's reject-rate key: the union of the masks (``total_seq_reject_rate``) when a mask is on."""
    has_mask = any(k.endswith("_reject_rate") and "/total_" not in k for k in keys)
    return "rollout_corr/total_seq_reject_rate" if has_mask else None


# ------------------------------------------------------------------------------ outputs


def fmt(mean: float, std: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def sci(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.1e}" if value != 0 and abs(value) < 1e-2 else f"{value:.3f}"


def table(conditions: list[Condition], summaries: dict[str, dict[str, Any]], runs_by_condition) -> list[str]:
    """One task's table (``conditions`` all on one task, its on-policy baseline first)."""
    baseline = runs_by_condition.get(f"{conditions[0].task}/onpolicy")
    lines = [
        "| condition | group | correction | final reward | AUC reward | AUC - on-policy (paired, 95% CI) "
        "| collapsed (batch) | staleness/mean | KL per version | kl mean / max | chi2_token mean / max "
        "| seq reject mean / max | final entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in conditions:
        s = summaries[c.name]

        def stat(key: str, field: str = "mean", s: dict[str, Any] = s) -> float:
            value = s.get(key, {}).get(field)
            return math.nan if value is None else value  # null in the JSON: not finite / not logged

        collapses = [b for b in s["collapse_steps"] if b is not None]
        collapsed = f"{len(collapses)}/{len(s['collapse_steps'])}" + (
            f" ({', '.join(str(b) for b in collapses)})" if collapses else ""
        )
        keys = [k for run in runs_by_condition[c.name] for k in run["series"]]
        reject = reject_key(keys)
        reject_cell = f"{stat(reject + ':mean'):.3f} / {stat(reject + ':max'):.3f}" if reject else "-"
        delta = (
            "-"
            if baseline is None or c.short == "onpolicy"
            else fmt_delta(*paired_delta(runs_by_condition[c.name], baseline, "auc_reward")[:2])
        )
        lines.append(
            f"| `{c.short}` | {c.group} | {c.label} | {fmt(stat('final_reward'), stat('final_reward', 'std'))} "
            f"| {fmt(stat('auc_reward'), stat('auc_reward', 'std'))} | {delta} | {collapsed} "
            f"| {stat('staleness/mean:mean'):.2f} | {sci(stat(VERSION_KL_KEY + ':mean'))} "
            f"| {sci(stat('rollout_corr/kl:mean'))} / {sci(stat('rollout_corr/kl:max'))} "
            f"| {sci(stat('rollout_corr/chi2_token:mean'))} / {sci(stat('rollout_corr/chi2_token:max'))} "
            f"| {reject_cell} | {stat('final_entropy'):.3f} |"
        )
    return lines


def calibration_table(calibration: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| task | learning rate | KL per version | AUC reward | final reward | chosen |",
        "|---|---|---|---|---|---|",
    ]
    for task, cal in calibration.items():
        if "given" in cal:
            lines.append(f"| {task} | {cal['given']:g} | (given with --lr, not calibrated) | | | yes |")
            continue
        rows = zip(cal["lrs"], cal["version_kl"], cal["auc_reward"], cal["final_reward"], strict=True)
        for lr, kl, auc, final in rows:
            chosen = "**yes**" if lr == cal["chosen"] else ""
            lines.append(f"| {task} | {lr:g} | {sci(kl)} | {auc:.3f} | {final:.3f} | {chosen} |")
    return lines


def plot_summary(conditions: list[Condition], runs_by_condition, path: Path) -> None:
    """Per task: paired AUC difference to on-policy against staleness (per correction), and per engine."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also keeps the test suite headless
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(c.task for c in conditions))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(13, 4.2 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        mine = [c for c in conditions if c.task == task]
        baseline = runs_by_condition.get(f"{task}/onpolicy", [])
        ax_stale, ax_engine = axes[row]
        stale = [c for c in mine if c.max_staleness > 0]
        corrections_here = list(dict.fromkeys(c.correction for c in stale))
        labels = {c.correction: c.label for c in stale}
        version_kl = []
        for index, short in enumerate(corrections_here):
            points = [(0, 0.0, 0.0)]  # the baseline itself
            for c in stale:
                if c.correction == short and baseline:
                    mean, half, _ = paired_delta(runs_by_condition[c.name], baseline, "auc_reward")
                    points.append((c.max_staleness, mean, half if math.isfinite(half) else 0.0))
                    version_kl += [r["summary"][VERSION_KL_KEY + ":mean"] for r in runs_by_condition[c.name]]
            xs, ys, errs = zip(*sorted(points), strict=True)
            shift = (index - (len(corrections_here) - 1) / 2) * 0.07  # keep the error bars apart
            ax_stale.errorbar(
                [x + shift for x in xs],
                ys,
                yerr=errs,
                label=labels[short],
                color=f"C{index}",
                marker="o",
                markersize=3,
                linewidth=1.2,
                capsize=2,
            )
        ax_stale.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
        kl = statistics.fmean(v for v in version_kl if math.isfinite(v)) if version_kl else math.nan
        levels = sorted({0, *(c.max_staleness for c in stale)})
        ax_stale.set_xticks(levels)
        ax_stale.set_xticklabels(
            [f"{k}\n~{k * kl:.1e} nats" if k and math.isfinite(kl) else str(k) for k in levels], fontsize=8
        )
        ax_stale.set_xlabel(f"max_staleness (optimizer steps); x KL per version ({sci(kl)}) = expected token KL")
        ax_stale.set_ylabel("AUC reward - on-policy (paired, 95% CI)")
        ax_stale.set_title(f"{task}: asynchronous staleness", fontsize=10)
        ax_stale.legend(fontsize=7, loc="lower left")
        engines = [c for c in mine if c.engine != "float32"]
        groups = list(dict.fromkeys(c.engine for c in engines))
        shorts = list(dict.fromkeys(c.correction for c in engines))
        width = 0.8 / max(1, len(shorts))
        for index, short in enumerate(shorts):
            labelled = False
            for g, engine in enumerate(groups):
                match = [c for c in engines if c.engine == engine and c.correction == short]
                if not match or not baseline:
                    continue
                mean, half, _ = paired_delta(runs_by_condition[match[0].name], baseline, "auc_reward")
                ax_engine.bar(
                    g + (index - (len(shorts) - 1) / 2) * width,
                    mean,
                    width,
                    yerr=half if math.isfinite(half) else 0,
                    color=f"C{corrections_here.index(short) if short in corrections_here else index}",
                    capsize=2,
                    label=None if labelled else match[0].label,
                )
                labelled = True
        ax_engine.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
        ax_engine.set_xticks(range(len(groups)))
        ax_engine.set_xticklabels([f"{e} engine (sync)" for e in groups])
        ax_engine.set_title(f"{task}: engine mismatch", fontsize=10)
        ax_engine.legend(fontsize=7, loc="lower left")
        for ax in (ax_stale, ax_engine):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(conditions: list[Condition], runs_by_condition, path: Path) -> None:
    """Reward (smoothed, mean over seeds) and mismatch KL per condition, one row of panels per task and group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys((c.task, c.group) for c in conditions if c.short != "onpolicy")) or [
        (conditions[0].task, "on-policy")
    ]
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 3.4 * len(rows)), squeeze=False)
    for row, (task, group) in enumerate(rows):
        members = [c for c in conditions if c.task == task and (c.short == "onpolicy" or c.group == group)]
        batches = min(len(r["series"]["train/reward"]) for c in members for r in runs_by_condition[c.name])
        smooth = max(1, min(10, batches // 10))
        ax_reward, ax_kl = axes[row]
        others = [c for c in members if c.short != "onpolicy"]  # a study may run without the baseline
        for c in members:
            runs = runs_by_condition[c.name]
            # Fixed colours: a condition keeps its colour in both panels even when its KL is not drawn.
            style = {"color": "black", "linestyle": "--"} if c.short == "onpolicy" else {"color": f"C{others.index(c)}"}
            reward = _mean_curve([moving_average(r["series"]["train/reward"], smooth) for r in runs])
            ax_reward.plot(reward, label=c.label, linewidth=1.3, **style)
            kl = _mean_curve([r["series"].get("rollout_corr/kl", []) for r in runs])
            if any(math.isfinite(v) and v != 0 for v in kl):  # bypass: identically 0, nothing for a log axis
                # k1 KL can read slightly negative on one batch: plot its magnitude on the log axis.
                ax_kl.plot(moving_average([abs(v) for v in kl], smooth), label=c.label, linewidth=1.3, **style)
        ax_reward.set_title(f"{task}, {group}: train/reward ({smooth}-batch moving avg, mean over seeds)", fontsize=9)
        ax_kl.set_title(f"{task}, {group}: |rollout_corr/kl| (not drawn where it reads 0)", fontsize=9)
        ax_kl.set_yscale("log")
        for ax in (ax_reward, ax_kl):
            ax.set_xlabel("batch")
            ax.grid(alpha=0.3)
        ax_reward.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    curves = [c for c in curves if c]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


METHOD = """\
Every run is an RL fit with `OffPolicyRLModule` (decoupled PPO, clip [0.8, 1.28], token-mean,
AdamW, gradient clip 1.0) and `RolloutCallback` (GRPO advantages, temperature 1), on one of two
tasks (per task: the learning rate from the calibration, the batch shape and the number of batches
below). A seed `s` sets `seed_everything(s)`, the callback's sampler seed and the module's
mini-batch shuffle seed; seed `s` is the same in every condition (paired runs: with a float32
engine the first batch is identical in every condition of a task).

{tasks}

* Calibration: per task, one full-length on-policy fit (seed {seed}) at each learning rate; the
  study uses the largest one whose KL per version is at most {band_top:g} nats (the top of the
  {band_low:g}..{band_top:g} band of large-model RL), or the one nearest the band if none is. The
  chosen rate's fit is the on-policy baseline of seed {seed}.
* KL per version: how far one optimizer step moves the policy, the exact KL(pi_v || pi_v+1) (a sum
  over the vocabulary) between consecutive versions, averaged over the response tokens of a fixed
  probe (the run's first 32 training sequences) and over the run's steps. A token `k` versions
  stale is off-policy by roughly `k` times that (the x axis of the plot).
* Engines: `HFEngine(dtype="float32")` keeps a private float32 copy of the weights (refreshed at
  every push), so with `max_staleness=0` it samples with exactly the trainer's weights;
  `HFEngine(dtype="bfloat16")` a bfloat16 copy; the *noisy* engine is the float32 copy plus a fixed
  Gaussian perturbation (`{noise} x rms(tensor)` per tensor, the same noise at every push).
* Asynchronous runs: `AsyncSettings(max_staleness=k)`: generation in a background thread, the
  weights pushed after every batch; admission control makes every batch after the first few
  exactly `k` optimizer steps stale (`staleness/mean` in the tables).
* Recorded per batch (a callback reading `trainer.callback_metrics` after each batch):
  `train/reward`, `train/entropy`, `staleness/*`, `ppo/clip_frac`, `ppo/approx_kl` and the
  `rollout_corr/*` keys the correction logs (all but `log_ppl_diff`, `ppl_ratio`, `is_weight_min`,
  `is_weight_max`, `ess_seq`). In bypass mode (no pi_prox) the `rollout_corr/*` metrics compare
  pi_theta, per micro-batch, with pi_rollout; runs at commit dc8d338 or earlier (see **Code**)
  logged 0 there by construction (not because there was no mismatch).
* Final reward: mean `train/reward` over the last 10% of the batches; AUC: mean `train/reward`
  over the whole run; both as mean ± std over seeds. "AUC - on-policy (paired)": the AUC minus the
  on-policy run's with the same seed; mean and 95% confidence interval over seeds (Student t),
  **bold** where the interval excludes 0.
* Collapse: {collapse}.
* The kl / chi2 / reject columns are the per-run mean and max over the batches, averaged over
  seeds; "seq reject" is `rollout_corr/total_seq_reject_rate` (masks only)."""


def render(payload: dict[str, Any], runs_by_condition, paths: dict[str, Path], reading: Path | None) -> str:
    """The markdown report of a study, from its stored payload (what the JSON holds)."""
    meta, settings = payload["meta"], payload["meta"]["settings"]
    conditions = [Condition(**c) for c in payload["conditions"]]
    summaries = payload["summary"]
    report_dir = paths["report"].parent
    rel = {key: os.path.relpath(paths[key], report_dir) for key in ("plot", "curves", "json")}
    run_times = [r["wall_s"] for runs in runs_by_condition.values() for r in runs]
    elapsed, seeds = meta["wall_s"], settings["seeds"]
    tasks = list(dict.fromkeys(c.task for c in conditions))
    task_lines = []
    for task in tasks:
        t = settings["tasks"][task]
        task_lines.append(
            f"* `{task}`: {TASKS[task].description}. Checkpoint: `{t['model']}`. lr {t['lr']:g}, "
            f"{t['batches']} batches of {t['prompts_per_step']} prompts x {t['samples_per_prompt']} samples x "
            f"<= {t['max_new_tokens']} new tokens, `num_minibatches={t['num_minibatches']}` "
            f"({t['num_minibatches']} optimizer step{'s' if t['num_minibatches'] > 1 else ''} per batch)."
        )
    calibration = meta.get("calibration", {})
    cal_any = next((c for c in calibration.values() if "lrs" in c), {})
    lines = [
        "# Mismatch study: does the off-policy correction keep RL stable?",
        "",
        f"- **Machine**: {meta['machine']}",
        f"- **Date**: {meta['date']}",
        f"- **Code**: {meta['code']}",
        f"- **Command**: `{meta['command']}`",
        f"- **Runs**: {len(conditions)} conditions ({', '.join(tasks)}) x {len(seeds)} seeds "
        f"(seeds {', '.join(map(str, seeds))}), after a calibration of "
        f"{sum(len(c.get('lrs', [])) for c in calibration.values())} fits",
        f"- **Wall time of the whole study**: {elapsed / 60:.1f} min ({elapsed:.0f} s); one run: "
        f"{statistics.fmean(run_times):.0f} s on average (min {min(run_times):.0f}, max {max(run_times):.0f})",
        f"- **Data**: every run's per-batch series in [`{rel['json']}`]({rel['json']}); summary plot "
        f"[`{rel['plot']}`]({rel['plot']}); reward curves [`{rel['curves']}`]({rel['curves']})",
        "",
        "## Method",
        "",
        METHOD.format(
            tasks="\n".join(task_lines),
            seed=cal_any.get("seed", seeds[0]),
            band_low=KL_BAND[0],
            band_top=KL_BAND[1],
            noise=next(iter(settings["tasks"].values()))["noise_scale"],
            collapse=meta["collapse_definition"],
        ),
        "",
        "## Calibration",
        "",
        *calibration_table(calibration),
        "",
        "## Results",
        "",
        f"![paired AUC difference against staleness and per engine]({rel['plot']})",
        "",
    ]
    for task in tasks:
        lines += [
            f"### `{task}`",
            "",
            *table([c for c in conditions if c.task == task], summaries, runs_by_condition),
            "",
        ]
    lines += [f"Reward curves of every condition: [`{rel['curves']}`]({rel['curves']}).", ""]
    if reading is not None and reading.exists():
        lines += ["## Reading", "", reading.read_text().strip(), ""]
    return "\n".join(lines)


def write_outputs(payload: dict[str, Any], args: argparse.Namespace) -> str:
    """Write the JSON, the PNGs and the markdown report of ``payload``; return the report."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": args.output_dir / "mismatch_study.json",
        "plot": args.output_dir / "mismatch_study.png",
        "curves": args.output_dir / "mismatch_curves.png",
        "report": args.report,
    }
    payload = _jsonable(payload)
    paths["json"].write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    conditions = [Condition(**c) for c in payload["conditions"]]
    runs_by_condition = {c.name: [r for r in payload["runs"] if r["condition"] == c.name] for c in conditions}
    plot_summary(conditions, runs_by_condition, paths["plot"])
    plot_curves(conditions, runs_by_condition, paths["curves"])
    report = render(payload, runs_by_condition, paths, args.reading)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(report)
    return report


def load_payload(path: Path) -> dict[str, Any]:
    """A stored study, with null (non-finite) values back as NaN and the summaries recomputed."""
    payload = json.loads(path.read_text())
    for run in payload["runs"]:
        run["series"] = {k: [math.nan if v is None else v for v in vs] for k, vs in run["series"].items()}
        run["summary"] = summarize_run(run)
    conditions = [Condition(**c) for c in payload["conditions"]]
    payload["summary"] = {
        c.name: summarize_condition([r for r in payload["runs"] if r["condition"] == c.name]) for c in conditions
    }
    return payload


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True, help="JSON and PNGs go here")
    parser.add_argument(
        "--report", type=Path, default=None, help="markdown report (default: <output-dir>.md, e.g. docs/results.md)"
    )
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--batches", type=int, default=None, help="batches per run (default: the task's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[2, 4, 8], help="max_staleness values (steps)")
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[1e-3, 7e-4, 5e-4, 3.5e-4],
        help="calibration sweep (factors of sqrt(2): the KL per version moves ~2x per step)",
    )
    parser.add_argument(
        "--lr", nargs="+", default=[], metavar="TASK=LR", help="use this learning rate for TASK (no calibration)"
    )
    known = list(corrections(argparse.Namespace(geo_low=0.0, geo_high=0.0)))
    parser.add_argument(
        "--corrections",
        nargs="+",
        choices=known,
        default=None,
        help="the corrections run at every staleness (default: STALENESS_PLAN: all at 8, fewer at 4 and 2)",
    )
    parser.add_argument(
        "--mismatch-corrections",
        nargs="+",
        choices=known,
        default=["bypass", "decoupled", "tis"],
        help="with the noisy engine (the bf16 engine runs the first and the last of them)",
    )
    # Symmetric in log space, +-0.1 nat on the geometric mean ratio: at ~2e-3 nats per version a
    # 4-step-stale token is ~1e-2 off, and the per-sequence mean of 8-16 tokens spreads ~0.05 around
    # it, so the mask rejects the tail. verl's default [0.999, 1.001] would reject nearly everything.
    parser.add_argument("--geo-low", type=float, default=0.905)
    parser.add_argument("--geo-high", type=float, default=1.105)
    # 0.05 gave rollout_corr/kl ~4e-3 (KL grows with the square of the scale): 0.075 aims at ~1e-2.
    parser.add_argument("--noise-scale", type=float, default=0.075, help="perturbation of the noisy engine")
    parser.add_argument(
        "--conditions", nargs="+", default=None, help="run only these conditions (short names, e.g. stale4-tis)"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes, 1 thread each)")
    parser.add_argument(
        "--reading", type=Path, default=None, help="markdown file appended as '## Reading' (skipped if missing)"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the PNGs and the report from <output-dir>/mismatch_study.json (no training)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 conditions x 2 tasks x 1 seed x 6 small batches, 2-lr calibration"
    )
    args = parser.parse_args(argv)
    args.shape = {}
    if args.quick:
        args.batches, args.seeds, args.staleness, args.lrs = 6, [0], [4], [1e-3, 3e-4]
        args.shape = {"prompts_per_step": 4, "samples_per_prompt": 4}
        args.conditions = args.conditions or list(QUICK_CONDITIONS)
    args.fixed_lr = {}
    for item in args.lr:
        task, _, value = item.partition("=")
        if task not in TASKS or not value:
            parser.error(f"--lr takes TASK=LR with TASK one of {sorted(TASKS)}; got {item!r}")
        args.fixed_lr[task] = float(value)
    if args.report is None:
        args.report = args.output_dir.with_suffix(".md")
    return args


def choose_lr(lrs: Sequence[float], version_kl: Sequence[float]) -> float:
    """The largest learning rate whose KL per version is at most the band's top; else the one nearest the band."""
    within = [lr for lr, kl in zip(lrs, version_kl, strict=True) if math.isfinite(kl) and kl <= KL_BAND[1]]
    if within:
        return max(within)

    def distance(kl: float) -> float:  # in decades outside the band
        return max(math.log10(KL_BAND[0] / kl), math.log10(kl / KL_BAND[1]), 0.0) if kl > 0 else math.inf

    return min(zip(lrs, version_kl, strict=True), key=lambda pair: distance(pair[1]))[0]


def _jsonable(value: Any) -> Any:
    """Strict JSON: NaN / inf become null; floats keep 6 significant digits (the series are noisy anyway)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def task_settings(args: argparse.Namespace, task: str, model: str, lr: float | None = None) -> dict[str, Any]:
    spec = TASKS[task]
    return {
        "model": model,
        "lr": lr,
        "batches": args.batches or spec.batches,
        "prompts_per_step": args.shape.get("prompts_per_step", spec.prompts_per_step),
        "samples_per_prompt": args.shape.get("samples_per_prompt", spec.samples_per_prompt),
        "max_new_tokens": spec.max_new_tokens,
        "num_minibatches": spec.num_minibatches,
        "noise_scale": args.noise_scale,
    }


def prepare_model(task: str, workdir: Path) -> str:
    """The checkpoint every run of ``task`` starts from (built once, here, not raced for in the workers)."""
    if task == "reverse":
        from lightning_offpolicy.demo.tiny import resolve_model_path

        resolve_model_path("tiny:reverse")
        return "tiny:reverse"
    from vs_trl import build_checkpoint

    return str(build_checkpoint(workdir / "letter_model", seed=0))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render_only:
        print(write_outputs(load_payload(args.output_dir / "mismatch_study.json"), args))
        return 0
    torch.set_num_threads(1)
    conditions = {task: build_conditions(args, task) for task in args.tasks}
    if args.conditions:
        every = {c.short for cs in conditions.values() for c in cs}
        unknown = set(args.conditions) - every
        if unknown:
            raise SystemExit(f"unknown conditions {sorted(unknown)}; known: {sorted(every)}")
        conditions = {task: [c for c in cs if c.short in args.conditions] for task, cs in conditions.items()}
    # The code the workers import now: read before the runs, since the tree may change during a long study.
    code = code_line()
    began = time.perf_counter()
    done = 0

    def report(run: dict[str, Any], total: int) -> None:
        print(
            f"[{time.perf_counter() - began:7.0f} s] {run['condition']:>24} seed {run['seed']} lr {run['lr']:g}: "
            f"final reward {run['summary']['final_reward']:.3f}, AUC {run['summary']['auc_reward']:.3f}, "
            f"KL/version {run['summary'][VERSION_KL_KEY + ':mean']:.1e}, {run['wall_s']:.0f} s ({done}/{total})",
            flush=True,
        )

    def run_all(pool, jobs: list[tuple[Condition, int, dict[str, Any]]]) -> list[dict[str, Any]]:
        nonlocal done
        done = 0
        futures = [pool.submit(run_one, c, seed, settings) for c, seed, settings in jobs]
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            run["summary"] = summarize_run(run)
            done += 1
            report(run, len(jobs))
        return [future.result() for future in futures]  # in job order

    settings: dict[str, dict[str, Any]] = {}
    calibration: dict[str, dict[str, Any]] = {}
    # spawn, not fork: the workers must not inherit the parent's torch thread pools.
    context = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="mismatch_study_") as workdir,
        concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool,
    ):
        models = {task: prepare_model(task, Path(workdir)) for task in args.tasks}
        # Phase 1: the learning rate per task, from the KL per version of full-length on-policy fits
        # (early batches move a policy differently from late ones); the chosen rate's fit is then the
        # on-policy baseline of the first seed.
        to_calibrate = [task for task in args.tasks if task not in args.fixed_lr]
        jobs = []
        for task in to_calibrate:
            onpolicy = build_conditions(args, task)[0]
            jobs += [(onpolicy, args.seeds[0], task_settings(args, task, models[task], lr)) for lr in args.lrs]
        if jobs:
            print(f"calibration: {len(jobs)} on-policy fits", flush=True)
        calibration_runs = run_all(pool, jobs)
        reused = []
        for task in args.tasks:
            if task in args.fixed_lr:
                calibration[task] = {"given": args.fixed_lr[task]}
                lr = args.fixed_lr[task]
            else:
                mine = [run for run, (c, _, _) in zip(calibration_runs, jobs, strict=True) if c.task == task]
                kls = [run["summary"][VERSION_KL_KEY + ":mean"] for run in mine]
                lr = choose_lr(args.lrs, kls)
                calibration[task] = {
                    "lrs": list(args.lrs),
                    "version_kl": kls,
                    "auc_reward": [run["summary"]["auc_reward"] for run in mine],
                    "final_reward": [run["summary"]["final_reward"] for run in mine],
                    "seed": args.seeds[0],
                    "chosen": lr,
                }
                if any(c.short == "onpolicy" for c in conditions[task]):
                    reused.append(mine[args.lrs.index(lr)])
            settings[task] = task_settings(args, task, TASKS_MODEL_LABEL.get(task, models[task]), lr)
            print(f"{task}: lr {lr:g}", flush=True)
        # Phase 2: every other condition x seed, seed-major so that early results cover every condition.
        have = {(run["condition"], run["seed"]) for run in reused}
        jobs = [
            (c, seed, {**settings[task], "model": models[task]})
            for seed in args.seeds
            for task in args.tasks
            for c in conditions[task]
            if (c.name, seed) not in have
        ]
        runs = reused + run_all(pool, jobs)
    elapsed = time.perf_counter() - began
    ordered = [c for task in args.tasks for c in conditions[task]]
    by_key = {(run["condition"], run["seed"]): run for run in runs}
    summaries = {c.name: summarize_condition([by_key[(c.name, s)] for s in args.seeds]) for c in ordered}
    machine = (
        f"{cpu_model()}, nproc={os.cpu_count()}, torch {torch.__version__} (intra-op threads=1 per run, "
        f"{args.workers} runs in parallel), Python {platform.python_version()}"
    )
    payload = {
        "meta": {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine,
            "code": code,
            "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/mismatch_study.py", *argv]),
            "wall_s": elapsed,
            "settings": {"tasks": settings, "seeds": args.seeds, "workers": args.workers},
            "calibration": calibration,
            "collapse_definition": COLLAPSE_DEFINITION,
        },
        "conditions": [c.to_dict() for c in ordered],
        "summary": summaries,
        "runs": [by_key[(c.name, s)] for c in ordered for s in args.seeds],
    }
    print(write_outputs(payload, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
