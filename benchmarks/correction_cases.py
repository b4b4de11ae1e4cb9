"""The correction benchmark's inputs and cases: one preset's step, eager or fused."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from lightning_offpolicy.correction import PRESETS, PolicyLossConfig, compute_correction, policy_loss
from lightning_offpolicy.correction.fused import FusedCorrectionStep
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics


# ------------------------------------------------------------------------------------ inputs
@dataclass
class Inputs:
    prox: torch.Tensor
    rollout: torch.Tensor
    logprobs: torch.Tensor  # not a leaf yet; each case clones it into its own leaf
    mask: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor


def make_inputs(batch: int, seq_len: int, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.randn(batch, seq_len, generator=gen).abs() * 2.0
    rollout = prox + 0.05 * torch.randn(batch, seq_len, generator=gen)
    low = max(1, seq_len // 8)
    lengths = torch.randint(low, seq_len + 1, (batch,), generator=gen)
    lengths[0] = seq_len
    if batch > 1:
        lengths[-1] = 1
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).float()
    # A few large outliers inside the responses (~1 per 2 rows).
    n_out = max(1, batch // 2)
    rows = torch.randint(0, batch, (n_out,), generator=gen)
    cols = (torch.rand(n_out, generator=gen) * lengths[rows].float()).long().clamp(max=seq_len - 1)
    size = 4.0 + 8.0 * torch.rand(n_out, generator=gen)
    sign = torch.where(torch.rand(n_out, generator=gen) < 0.5, -1.0, 1.0)
    rollout[rows, cols] += sign * size
    logprobs = prox + 0.01 * torch.randn(batch, seq_len, generator=gen)
    nan = torch.tensor(float("nan"))
    valid = mask.bool()
    prox, rollout, logprobs = (torch.where(valid, t, nan) for t in (prox, rollout, logprobs))
    advantages = torch.randn(batch, generator=gen)
    return Inputs(prox, rollout, logprobs, mask, advantages, lengths)


# ------------------------------------------------------------------------------------ one case
class Case:
    """One preset: its config, its metric objects, its own logprobs leaf, and a timed step."""

    path = "eager"

    def __init__(self, name: str, inputs: Inputs, loss_cfg: PolicyLossConfig) -> None:
        self.name = name
        self.cfg = PRESETS[name]()
        self.inputs = inputs
        self.loss_cfg = loss_cfg
        # pi_prox, or in bypass mode with a mask the current policy's logprobs (the leaf's values).
        self.prox = self.cfg.ratio_numerator(inputs.prox, inputs.logprobs)
        self.leaf = inputs.logprobs.clone().requires_grad_(True)
        self.corr_metrics = CorrectionMetrics(self.cfg)
        self.loss_metrics = PolicyLossMetrics()
        self.times: list[tuple[float, float, float]] = []
        self.last_loss = float("nan")

    @property
    def key(self) -> str:
        return f"{self.path}:{self.name}"

    def step(self) -> tuple[float, float, float]:
        x = self.inputs
        t0 = time.perf_counter()
        out = compute_correction(self.prox, x.rollout, x.mask, self.cfg)
        t1 = time.perf_counter()
        loss, info = policy_loss(self.leaf, self.prox, x.rollout, x.advantages, x.mask, self.loss_cfg, correction=out)
        loss.backward()
        t2 = time.perf_counter()
        self.corr_metrics.update(stats=out.stats)
        self.loss_metrics.update(info=info)
        t3 = time.perf_counter()
        self.last_loss = float(loss.detach())
        return t1 - t0, t2 - t1, t3 - t2

    def reset(self) -> None:
        """Untimed bookkeeping between steps."""
        self.leaf.grad = None
        self.corr_metrics.reset()
        self.loss_metrics.reset()

    def check_finite(self) -> list[str]:
        """NaN padding must never leak: the loss, the gradient and every metric stay finite."""
        problems = []
        self.reset()
        self.step()
        if not math.isfinite(self.last_loss):
            problems.append(f"loss={self.last_loss}")
        grad = self.leaf.grad
        if grad is None:
            problems.append("no gradient reached logprobs")
        elif not torch.isfinite(grad).all():
            problems.append("non-finite gradient")
        values = {**self.corr_metrics.compute(), **self.loss_metrics.compute()}
        bad = [k for k, v in values.items() if not torch.isfinite(v).all()]
        if bad:
            problems.append("non-finite metrics: " + ", ".join(bad))
        self.reset()
        return problems


class FusedCase(Case):
    """The same step through :class:`FusedCorrectionStep` (``torch.compile`` of correction, loss
    and metric sums); the metrics are fed from the sums computed inside the graph."""

    path = "fused"

    def __init__(self, name: str, inputs: Inputs, loss_cfg: PolicyLossConfig) -> None:
        super().__init__(name, inputs, loss_cfg)
        self.fused = FusedCorrectionStep(self.cfg, loss_cfg, statistics=self.corr_metrics.sums)
        self.fell_back = False

    def step(self) -> tuple[float, float, float]:
        x = self.inputs
        t0 = time.perf_counter()
        out = self.fused(self.leaf, self.prox, x.rollout, x.advantages, x.mask)
        out.loss.backward()
        t1 = time.perf_counter()
        self.corr_metrics.update_from_sums(out.statistics)
        self.loss_metrics.update(info=out.info)
        t2 = time.perf_counter()
        self.fell_back |= not out.compiled
        self.last_loss = float(out.loss.detach())
        return 0.0, t1 - t0, t2 - t1

    def check_finite(self) -> list[str]:
        problems = super().check_finite()
        return problems + (["the compiled graph was not used (eager fallback)"] if self.fell_back else [])


def one_pass_bytes(case: Case) -> int:
    """The least a step must move: its [B, T] inputs read once and the gradient written once."""
    x = case.inputs
    tensors = [x.rollout, x.logprobs, x.mask, x.logprobs] + ([case.prox] if case.prox is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors) + x.advantages.numel() * x.advantages.element_size()
