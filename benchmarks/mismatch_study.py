#!/usr/bin/env python
"""Does the off-policy correction keep RL stable when the rollouts are stale or mismatched?

One command runs the same RL fit (the tiny SFT-warmed Llama ``tiny:reverse``, the real
:class:`~lightning_offpolicy.rollout.RolloutCallback`, :class:`~lightning_offpolicy.module.OffPolicyRLModule`;
same task, prompts, batch, learning rate and number of batches) under several conditions, each
with several seeds:

* **on-policy baseline**: synchronous (``max_staleness=0``), ``HFEngine(dtype="float32")``: the
  engine samples with exactly the trainer's weights, nothing to correct;
* **async staleness**: ``max_staleness`` 4 and 8 optimizer steps (2 and 4 batches behind with
  ``num_minibatches=2``), the same float32 engine, and each correction: bypass (PPO clipped
  against the stale ``pi_rollout`` as if on-policy: what a naive async system does), decoupled PPO
  only (clip against ``pi_prox``, no IS weight), token TIS, geometric mask, sequence (product)
  mask, CISPO anchored on the rollout policy;
* **engine mismatch**: synchronous, with a bfloat16 engine, and with a float32 engine whose
  private weights carry a fixed Gaussian perturbation; uncorrected vs token TIS.

Every run's per-batch series (reward, entropy, staleness, every ``rollout_corr/*`` metric) goes to
a JSON file; a PNG plots reward and mismatch KL per condition; a markdown report gives the table,
the method, the machine and the wall time.

Usage::

    python benchmarks/mismatch_study.py --output-dir docs/results     # the full study (docs/results.md)
    python benchmarks/mismatch_study.py --quick --output-dir /tmp/ms  # a smoke test, < 2 min
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
from lightning_offpolicy.module import OffPolicyRLModule  # noqa: E402
from lightning_offpolicy.rollout import HFEngine, RolloutCallback  # noqa: E402
from lightning_offpolicy.tasks import PromptDataModule  # noqa: E402

#: Optimizer steps per batch (the quickstart's): max_staleness k is k / 2 batches behind.
NUM_MINIBATCHES = 2
#: Per-batch keys recorded besides the ``rollout_corr/*`` keys below.
SERIES_KEYS = (
    "train/reward",
    "train/entropy",
    "train/response_length",
    "staleness/mean",
    "staleness/max",
    "ppo/clip_frac",
    "ppo/approx_kl",
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
class Condition:
    """One cell of the study: how the rollouts are produced and how they are corrected."""

    name: str
    group: str
    label: str
    preset: str
    preset_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_staleness: int = 0
    sync_every: int = 1
    engine: str = "float32"  # "float32" | "bfloat16" | "noisy" (float32 + a fixed Gaussian perturbation)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "preset_kwargs": dict(self.preset_kwargs)}


def build_conditions(args: argparse.Namespace) -> list[Condition]:
    """Every condition of the study, in report order."""
    conditions = [Condition("onpolicy", "on-policy", "on-policy baseline (sync, fp32 engine)", "disabled")]
    corrections: list[tuple[str, str, str, dict[str, Any]]] = [
        ("bypass", "no correction (bypass: PPO vs pi_rollout)", "bypass", {}),
        ("decoupled", "decoupled PPO only (no IS weight)", "disabled", {}),
        ("tis", "token TIS (cap 2)", "token_tis", {"clip_high": 2.0}),
        (
            "geo",
            f"geometric mask [{args.geo_low}, {args.geo_high}]",
            "geo_mis",
            {"low": args.geo_low, "high": args.geo_high},
        ),
        ("seqmis", "sequence mask [0.5, 2]", "seq_mis", {"low": 0.5, "high": 2.0}),
        ("cispo", "CISPO (cap 2, anchor rollout)", "cispo", {"clip_high": 2.0, "anchor": "rollout"}),
    ]
    for k in args.staleness:
        # Push after every batch (num_minibatches optimizer steps): the bound is reached exactly,
        # and sync_every - 1 <= max_staleness holds for every k >= num_minibatches - 1.
        sync_every = min(NUM_MINIBATCHES, k + 1)
        for short, label, name, kwargs in corrections:
            conditions.append(
                Condition(f"stale{k}-{short}", f"async staleness {k}", label, name, kwargs, k, sync_every)
            )
    mismatch = [
        ("bypass", "no correction (bypass: PPO vs pi_rollout)", "bypass", {}),
        ("decoupled", "decoupled PPO only (no IS weight)", "disabled", {}),
        ("tis", "token TIS (cap 2)", "token_tis", {"clip_high": 2.0}),
    ]
    for engine, prefix, group in (
        ("bfloat16", "bf16", "mismatch bf16 engine"),
        ("noisy", "noisy", "mismatch noisy engine"),
    ):
        for short, label, name, kwargs in mismatch:
            conditions.append(Condition(f"{prefix}-{short}", group, label, name, kwargs, 0, 1, engine))
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


def run_one(condition: Condition, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One fit of ``condition`` with ``seed``; returns its per-batch series (runs in a worker process)."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    L.seed_everything(seed, verbose=False)
    module = OffPolicyRLModule(
        model="tiny:reverse",
        optimizer=partial(torch.optim.AdamW, lr=settings["lr"]),
        correction=preset(condition.preset, **condition.preset_kwargs),
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28),  # the quickstart's clip-higher
        num_minibatches=NUM_MINIBATCHES,
        max_tokens_per_microbatch=4096,
        gradient_clip_val=1.0,
        seed=seed,
    )
    callback = RolloutCallback(
        engine=make_engine(condition.engine, settings["noise_scale"]),
        samples_per_prompt=settings["samples_per_prompt"],
        max_new_tokens=settings["max_new_tokens"],
        seed=seed,
        max_staleness=condition.max_staleness,
        sync_every=condition.sync_every,
    )
    recorder = SeriesRecorder()
    version_kl = VersionKL()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=settings["batches"] * NUM_MINIBATCHES,
        callbacks=[callback, recorder, version_kl],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    data = PromptDataModule(task="reverse", prompts_per_step=settings["prompts_per_step"], num_train_prompts=2048)
    trainer.fit(module, data)
    return {
        "condition": condition.name,
        "seed": seed,
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
        if key.startswith(("rollout_corr/", "staleness/", "policy/")):
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


def paired_delta(runs: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Mean ± std over seeds of ``key`` minus the baseline's ``key`` with the same seed (paired runs)."""
    base = {run["seed"]: run["summary"][key] for run in baseline}
    return mean_std([run["summary"][key] - base[run["seed"]] for run in runs if run["seed"] in base])


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
    baseline = runs_by_condition.get("onpolicy")
    lines = [
        "| condition | group | correction | final reward | AUC reward | AUC - on-policy (paired) "
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
            if baseline is None or c.name == "onpolicy"
            else fmt(*paired_delta(runs_by_condition[c.name], baseline, "auc_reward"))
        )
        lines.append(
            f"| `{c.name}` | {c.group} | {c.label} | {fmt(stat('final_reward'), stat('final_reward', 'std'))} "
            f"| {fmt(stat('auc_reward'), stat('auc_reward', 'std'))} | {delta} | {collapsed} "
            f"| {stat('staleness/mean:mean'):.2f} | {sci(stat(VERSION_KL_KEY + ':mean'))} "
            f"| {sci(stat('rollout_corr/kl:mean'))} / {sci(stat('rollout_corr/kl:max'))} "
            f"| {sci(stat('rollout_corr/chi2_token:mean'))} / {sci(stat('rollout_corr/chi2_token:max'))} "
            f"| {reject_cell} | {stat('final_entropy'):.3f} |"
        )
    return lines


def plot(conditions: list[Condition], runs_by_condition, path: Path, smooth: int) -> None:
    """Reward (smoothed, mean over seeds) and mismatch KL per condition, one row of panels per group."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also keeps the test suite headless
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(c.group for c in conditions if c.name != "onpolicy"))
    baseline = [c for c in conditions if c.name == "onpolicy"]
    rows = max(1, len(groups))
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.6 * rows), squeeze=False)
    for row, group in enumerate(groups or ["on-policy"]):
        members = baseline + [c for c in conditions if c.group == group and c.name != "onpolicy"]
        ax_reward, ax_kl = axes[row]
        for index, c in enumerate(members):
            runs = runs_by_condition[c.name]
            # Fixed colours: a condition keeps its colour in both panels even when its KL is not drawn.
            style = (
                {"color": "black", "linestyle": "--"}
                if c.name == "onpolicy"
                else {"color": f"C{index - len(baseline)}"}
            )
            reward = _mean_curve([moving_average(r["series"]["train/reward"], smooth) for r in runs])
            ax_reward.plot(reward, label=c.label, linewidth=1.3, **style)
            kl = _mean_curve([r["series"].get("rollout_corr/kl", []) for r in runs])
            if any(math.isfinite(v) and v != 0 for v in kl):  # bypass: identically 0, nothing for a log axis
                # k1 KL can read slightly negative on one batch: plot its magnitude on the log axis.
                ax_kl.plot(moving_average([abs(v) for v in kl], smooth), label=c.label, linewidth=1.3, **style)
        ax_reward.set_title(f"{group}: train/reward ({smooth}-batch moving avg, mean over seeds)", fontsize=9)
        ax_kl.set_title(
            f"{group}: |rollout_corr/kl| ({smooth}-batch moving avg; bypass reads 0: not drawn)", fontsize=9
        )
        ax_kl.set_yscale("log")
        for ax in (ax_reward, ax_kl):
            ax.set_xlabel("batch")
            ax.grid(alpha=0.3)
        ax_reward.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_curve(curves: list[list[float]]) -> list[float]:
    curves = [c for c in curves if c]
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


METHOD = """\
Every run is the same RL fit: the tiny SFT-warmed Llama `tiny:reverse` (one cached checkpoint:
the same initial weights for all runs), `OffPolicyRLModule` (decoupled PPO, clip [0.8, 1.28],
token-mean, AdamW lr {lr}, gradient clip 1.0, `num_minibatches=2`: 2 optimizer steps per batch),
`RolloutCallback` (GRPO advantages, temperature 1), `PromptDataModule(task="reverse")`;
{batches} batches of {prompts} prompts x {samples} samples x <= {tokens} new tokens. A seed `s`
sets `seed_everything(s)`, the callback's sampler seed and the module's mini-batch shuffle seed;
seed `s` is the same in every condition (paired runs: with a float32 engine the first batch is
identical in every condition).

* Engines: `HFEngine(dtype="float32")` keeps a private float32 copy of the weights (refreshed at
  every push), so with `max_staleness=0` it samples with exactly the trainer's weights;
  `HFEngine(dtype="bfloat16")` a bfloat16 copy; the *noisy* engine is the float32 copy plus a fixed
  Gaussian perturbation (`{noise} x rms(tensor)` per tensor, the same noise at every push).
* Asynchronous runs: `RolloutCallback(max_staleness=k, sync_every=2)`: generation in a background
  thread, the weights pushed after every batch; admission control makes every batch after the
  first few exactly `k` optimizer steps stale (`staleness/mean` in the table).
* Recorded per batch (a callback reading `trainer.callback_metrics` after each batch):
  `train/reward`, `train/entropy`, `staleness/*`, `ppo/clip_frac`, `ppo/approx_kl` and the
  `rollout_corr/*` keys the correction logs (all but `log_ppl_diff`, `ppl_ratio`, `is_weight_min`,
  `is_weight_max`, `ess_seq`). In bypass mode pi_prox := pi_rollout, so the
  `rollout_corr/*` metrics read 0 there by construction (not because there is no mismatch).
* Final reward: mean `train/reward` over the last 10% of the batches; AUC: mean `train/reward`
  over the whole run; both as mean ± std over seeds; "AUC - on-policy (paired)": the AUC minus the
  on-policy run's with the same seed, mean ± std over seeds.
* Collapse: {collapse}.
* The kl / chi2 / reject columns are the per-run mean and max over the batches, averaged over
  seeds; "seq reject" is `rollout_corr/total_seq_reject_rate` (masks only).
* KL per version: how far one optimizer step moves the policy, the exact KL(pi_v || pi_v+1) (a sum
  over the vocabulary) between consecutive versions, averaged over the response tokens of a fixed
  probe (the run's first 32 training sequences) and over the run's steps. Large-model RL runs at
  about 1e-3 to 1e-2 per version; a token `k` versions stale is off-policy by roughly `k` times that."""


def render(payload: dict[str, Any], runs_by_condition, paths: dict[str, Path], reading: Path | None) -> str:
    """The markdown report of a study, from its stored payload (what the JSON holds)."""
    meta, settings = payload["meta"], payload["meta"]["settings"]
    conditions = [Condition(**c) for c in payload["conditions"]]
    summaries = payload["summary"]
    report_dir = paths["report"].parent
    rel_plot = os.path.relpath(paths["plot"], report_dir)
    rel_json = os.path.relpath(paths["json"], report_dir)
    run_times = [r["wall_s"] for runs in runs_by_condition.values() for r in runs]
    elapsed, seeds = meta["wall_s"], settings["seeds"]
    lines = [
        "# Mismatch study: does the off-policy correction keep RL stable?",
        "",
        f"- **Machine**: {meta['machine']}",
        f"- **Date**: {meta['date']}",
        f"- **Code**: {meta['code']}",
        f"- **Command**: `{meta['command']}`",
        f"- **Runs**: {len(conditions)} conditions x {len(seeds)} seeds (seeds {', '.join(map(str, seeds))}), "
        f"{settings['batches']} batches each",
        f"- **Wall time of the whole study**: {elapsed / 60:.1f} min ({elapsed:.0f} s); one run: "
        f"{statistics.fmean(run_times):.0f} s on average (min {min(run_times):.0f}, max {max(run_times):.0f})",
        f"- **Data**: every run's per-batch series in [`{rel_json}`]({rel_json}); curves in [`{rel_plot}`]({rel_plot})",
        "",
        "## Method",
        "",
        METHOD.format(
            lr=settings["lr"],
            batches=settings["batches"],
            prompts=settings["prompts_per_step"],
            samples=settings["samples_per_prompt"],
            tokens=settings["max_new_tokens"],
            noise=settings["noise_scale"],
            collapse=meta["collapse_definition"],
        ),
        "",
        "## Results",
        "",
        *table(conditions, summaries, runs_by_condition),
        "",
        f"![reward and mismatch KL per condition]({rel_plot})",
        "",
    ]
    if reading is not None and reading.exists():
        lines += ["## Reading", "", reading.read_text().strip(), ""]
    return "\n".join(lines)


def write_outputs(payload: dict[str, Any], args: argparse.Namespace) -> str:
    """Write the JSON, the PNG and the markdown report of ``payload``; return the report."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": args.output_dir / "mismatch_study.json",
        "plot": args.output_dir / "mismatch_study.png",
        "report": args.report,
    }
    payload = _jsonable(payload)
    paths["json"].write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    conditions = [Condition(**c) for c in payload["conditions"]]
    runs_by_condition = {c.name: [r for r in payload["runs"] if r["condition"] == c.name] for c in conditions}
    batches = payload["meta"]["settings"]["batches"]
    plot(conditions, runs_by_condition, paths["plot"], smooth=max(1, min(10, batches // 10)))
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
    parser.add_argument("--output-dir", type=Path, required=True, help="JSON and PNG go here")
    parser.add_argument(
        "--report", type=Path, default=None, help="markdown report (default: <output-dir>.md, e.g. docs/results.md)"
    )
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[4, 8], help="max_staleness values (steps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    # At lr 1e-3 a 4-step-stale engine is ~0.17 nat/token away (rollout_corr/kl), so the geometric
    # mean ratio of a sequence sits near exp(-0.17) = 0.84: the default [0.99, 1.01] would reject
    # nearly everything. +-0.51 in log space rejects the tail instead.
    parser.add_argument("--geo-low", type=float, default=0.6)
    parser.add_argument("--geo-high", type=float, default=1.67)
    # 0.05 gave rollout_corr/kl ~4e-3 (KL grows with the square of the scale): 0.075 aims at ~1e-2.
    parser.add_argument("--noise-scale", type=float, default=0.075, help="perturbation of the noisy engine")
    parser.add_argument("--conditions", nargs="+", default=None, help="run only these conditions (names)")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes, 1 thread each)")
    parser.add_argument(
        "--reading", type=Path, default=None, help="markdown file appended as '## Reading' (skipped if missing)"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the PNG and the report from <output-dir>/mismatch_study.json (no training)",
    )
    parser.add_argument("--quick", action="store_true", help="3 conditions x 1 seed x 6 small batches")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.seeds, args.prompts_per_step, args.samples_per_prompt = 6, [0], 4, 4
        args.staleness = [4]
        args.conditions = args.conditions or list(QUICK_CONDITIONS)
    if args.report is None:
        args.report = args.output_dir.with_suffix(".md")
    return args


def _jsonable(value: Any) -> Any:
    """Strict JSON: NaN / inf become null; floats keep 6 significant digits (the series are noisy anyway)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.render_only:
        print(write_outputs(load_payload(args.output_dir / "mismatch_study.json"), args))
        return 0
    torch.set_num_threads(1)
    conditions = build_conditions(args)
    if args.conditions:
        unknown = set(args.conditions) - {c.name for c in conditions}
        if unknown:
            raise SystemExit(f"unknown conditions {sorted(unknown)}; known: {[c.name for c in conditions]}")
        conditions = [c for c in conditions if c.name in args.conditions]
    # Build the cached SFT checkpoint once, here, rather than racing to build it in every worker.
    from lightning_offpolicy.tiny import resolve_model_path

    resolve_model_path("tiny:reverse")
    settings = {
        "lr": args.lr,
        "batches": args.batches,
        "prompts_per_step": args.prompts_per_step,
        "samples_per_prompt": args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "noise_scale": args.noise_scale,
    }
    jobs = [(c, seed) for seed in args.seeds for c in conditions]  # seed-major: early results cover every condition
    # The code the workers import now: read before the runs, since the tree may change during a long study.
    code = code_line()
    began = time.perf_counter()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    # spawn, not fork: the workers must not inherit the parent's torch thread pools.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        futures = {pool.submit(run_one, c, seed, settings): (c.name, seed) for c, seed in jobs}
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            run["summary"] = summarize_run(run)
            results[futures[future]] = run
            print(
                f"[{time.perf_counter() - began:7.0f} s] {run['condition']:>18} seed {run['seed']}: "
                f"final reward {run['summary']['final_reward']:.3f}, AUC {run['summary']['auc_reward']:.3f}, "
                f"{run['wall_s']:.0f} s ({len(results)}/{len(jobs)})",
                flush=True,
            )
    elapsed = time.perf_counter() - began
    summaries = {c.name: summarize_condition([results[(c.name, s)] for s in args.seeds]) for c in conditions}
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
            "settings": {**settings, "seeds": args.seeds, "workers": args.workers},
            "collapse_definition": COLLAPSE_DEFINITION,
            "final_window": final_window(args.batches),
        },
        "conditions": [c.to_dict() for c in conditions],
        "summary": summaries,
        "runs": [results[(c.name, s)] for c in conditions for s in args.seeds],
    }
    print(write_outputs(payload, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
