"""One fit of the mismatch study: its engines, its per-batch recorders, the run itself."""

from __future__ import annotations

import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared harness
import lightning as L  # noqa: E402
import torch  # noqa: E402
from harness.fit import bare_trainer  # noqa: E402
from mismatch_conditions import Condition  # noqa: E402

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
    from vs_trl_task import kit_reward, make_prompts

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
    trainer = bare_trainer(
        settings["batches"] * settings["num_minibatches"], [callback, recorder, version_kl], log_every_n_steps=1
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
