"""The mismatch study's tasks, corrections and conditions (see docs/reports/results.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_offpolicy.correction import preset  # noqa: E402


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


def _corrected(
    correction: tuple[str, str, dict[str, Any], dict[str, Any]],
    short: str,
    name: str,
    task: str,
    group: str,
    max_staleness: int,
    sync_every: int,
    engine: str = "float32",
) -> Condition:
    """The condition of one correction (an entry of :func:`corrections`, named ``short``) in one setting."""
    label, preset_name, kwargs, loss_kwargs = correction
    return Condition(
        name,
        task,
        group,
        label,
        preset_name,
        kwargs,
        max_staleness,
        sync_every,
        engine,
        loss_kwargs,
        prox_method_of(short),
    )


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
            conditions.append(
                _corrected(known[short], short, f"{task}/stale{k}-{short}", task, f"async staleness {k}", k, sync_every)
            )
    noisy = list(args.mismatch_corrections)
    bf16 = list(dict.fromkeys([noisy[0], noisy[-1]]))  # a bf16 engine is close: uncorrected vs the last
    for engine, prefix, group, chosen in (
        ("bfloat16", "bf16", "mismatch bf16 engine", bf16),
        ("noisy", "noisy", "mismatch noisy engine", noisy),
    ):
        for short in chosen:
            conditions.append(_corrected(known[short], short, f"{task}/{prefix}-{short}", task, group, 0, 1, engine))
    return conditions


QUICK_CONDITIONS = ("onpolicy", "stale4-bypass", "stale4-tis")
