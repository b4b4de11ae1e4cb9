"""torchmetrics classes for the off-policy mismatch, exact across devices.

Every state is a running sum, count, max or min (float64 sums, ``dist_reduce_fx`` ``"sum"`` /
``"max"`` / ``"min"``), never a mean of means: two ranks on half batches report exactly what one
rank reports on the whole batch. Each metric updates from the
:class:`~lightning_offpolicy.correction.CorrectionStats` of ``compute_correction`` (or the
:class:`~lightning_offpolicy.correction.PolicyLossInfo` of ``policy_loss``); the functional twins
(``*_sums``) return the sums one update adds.

Conventions (``rho_t = pi_prox / pi_rollout`` of a sampled token, from log space clamped to
[-20, 20]; ``S_i = sum_t log rho_t`` over the response of sequence ``i``; means over response
tokens or over sequences with at least one response token):

============================  ===============================================================
``kl``                        ``mean_t(log pi_rollout - log pi_prox)``: the k1 estimate of
                              KL(pi_rollout || pi_prox) on the rollout's own samples
``k3_kl``                     ``mean_t(rho - 1 - log rho)`` (non-negative, lower variance)
``log_ppl_diff``              ``mean_i(-S_i / n_i)``: log PPL(trainer) - log PPL(engine)
``ppl_ratio``                 ``mean_i exp(-S_i / n_i)``: PPL(trainer) / PPL(engine)
``chi2_token``                ``mean_t(rho_t^2) - 1``
``chi2_seq``                  ``mean_i(exp(S_i)^2) - 1`` (``exp`` clamped as above)
``ess`` / ``ess_seq``         ``(sum rho)^2 / (N sum rho^2)`` over tokens / sequences, in (0, 1]
``is_weight_*``               mean / min / max / fraction truncated of the applied IS weights
                              over the tokens that reach the loss
``<mask>_token_reject_rate``  tokens a mask removed / response tokens (``total``: any mask)
``<mask>_seq_reject_rate``    sequences a mask touched / sequences
``abs_logprob_diff_*``        mean / max of ``|log rho_t|``
============================  ===============================================================

The OPSM mask (``opsm_mask``) is decided by the loss, from ``pi_theta`` and the advantages: its
rates come from :class:`~lightning_offpolicy.correction.PolicyLossInfo`, as
``ppo/opsm_mask_token_reject_rate`` and ``ppo/opsm_mask_seq_reject_rate`` (:class:`OPSMRejectionRate`).

An empty update (no response token) leaves every state unchanged; a metric with nothing
accumulated computes 0 (1 for the weight mean / min / max, the neutral weight).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torchmetrics import Metric, MetricCollection

from lightning_offpolicy.correction.config import OffPolicyCorrectionConfig
from lightning_offpolicy.correction.correction import CorrectionStats
from lightning_offpolicy.metrics.base import Extreme, FromSums, RatioOfSums
from lightning_offpolicy.metrics.policy_loss import PolicyLossMetrics
from lightning_offpolicy.metrics.sums import (
    F64,
    Level,
    abs_logprob_diff_sums,
    check_level,
    chi2_sums,
    ess_sums,
    log_ppl_sums,
    mismatch_kl_sums,
    rejection_sums,
    weight_sums,
)

__all__ = [
    "AbsLogProbDiffMax",
    "AbsLogProbDiffMean",
    "ChiSquared",
    "CorrectionMetrics",
    "EffectiveSampleSize",
    "ImportanceWeightClipFraction",
    "ImportanceWeightMax",
    "ImportanceWeightMean",
    "ImportanceWeightMin",
    "LogPerplexityDiff",
    "MismatchKL",
    "PerplexityRatio",
    "PolicyLossMetrics",
    "RejectionRate",
]


class MismatchKL(RatioOfSums):
    r"""KL(pi_rollout || pi_prox) per response token, estimated on the rollout's samples.

    ``k1``: :math:`\frac{1}{N}\sum_t (\log\pi_{rollout} - \log\pi_{prox})`;
    ``k3``: :math:`\frac{1}{N}\sum_t (\rho_t - 1 - \log\rho_t)`.

    Args:
        estimator: ``"k1"`` or ``"k3"``.

    Example:
        >>> import torch
        >>> from lightning_offpolicy.correction import compute_correction
        >>> stats = compute_correction(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -0.5]]),
        ...                            torch.ones(1, 2)).stats
        >>> metric = MismatchKL("k1"); metric.update(stats); metric.compute()
        tensor(0., dtype=torch.float64)
    """

    def __init__(self, estimator: Literal["k1", "k3"] = "k1", **kwargs: Any) -> None:
        if estimator not in ("k1", "k3"):
            raise ValueError(f"MismatchKL: estimator={estimator!r} is not known; allowed: 'k1', 'k3'.")
        super().__init__(**kwargs)
        self.estimator = estimator

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return mismatch_kl_sums(stats, self.estimator)


class LogPerplexityDiff(RatioOfSums):
    """Mean over sequences of ``log PPL(pi_prox) - log PPL(pi_rollout) = -mean_t log rho_t``."""

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return log_ppl_sums(stats)


class PerplexityRatio(RatioOfSums):
    """Mean over sequences of ``PPL(pi_prox) / PPL(pi_rollout)``."""

    empty_value = 1.0

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return log_ppl_sums(stats, exponentiate=True)


class ChiSquared(RatioOfSums):
    r"""Chi-squared divergence of pi_prox from pi_rollout: :math:`E[\rho^2] - 1`.

    Args:
        level: ``"token"`` (:math:`\rho_t`) or ``"sequence"`` (:math:`\prod_t \rho_t`).
    """

    def __init__(self, level: Level = "token", **kwargs: Any) -> None:
        check_level("ChiSquared", level)
        super().__init__(**kwargs)
        self.level = level

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return chi2_sums(stats, self.level)

    def compute(self) -> torch.Tensor:
        if self.denominator <= 0:
            return torch.tensor(0.0, dtype=F64, device=self.denominator.device)
        return self.numerator / self.denominator - 1.0


class EffectiveSampleSize(FromSums, Metric):
    r"""Normalised effective sample size of the raw ratios: :math:`(\sum\rho)^2 / (N \sum\rho^2)`.

    1 when the engine and the trainer agree; small when a few samples would dominate an
    importance-weighted estimate.

    Args:
        level: ``"token"`` or ``"sequence"``.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, level: Level = "token", **kwargs: Any) -> None:
        check_level("EffectiveSampleSize", level)
        super().__init__(**kwargs)
        self.level = level
        for name in ("sum_w", "sum_w2", "count"):
            self.add_state(name, default=torch.tensor(0.0, dtype=F64), dist_reduce_fx="sum")

    def _accumulate(self, sum_w: torch.Tensor, sum_w2: torch.Tensor, count: torch.Tensor) -> None:
        self.sum_w += sum_w.to(self.sum_w.device)
        self.sum_w2 += sum_w2.to(self.sum_w2.device)
        self.count += count.to(self.count.device)

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        """``(sum rho, sum rho^2, count)`` one update adds."""
        return ess_sums(stats, self.level)

    def compute(self) -> torch.Tensor:
        if self.count <= 0 or self.sum_w2 <= 0:
            return torch.tensor(1.0, dtype=F64, device=self.count.device)
        return self.sum_w.square() / (self.count * self.sum_w2)


class ImportanceWeightMean(RatioOfSums):
    """Mean applied IS weight over the tokens that reach the loss."""

    empty_value = 1.0

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return weight_sums(stats)


class ImportanceWeightClipFraction(RatioOfSums):
    """Fraction of the tokens that reach the loss whose IS weight was truncated."""

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return weight_sums(stats, clipped=True)


class ImportanceWeightMax(Extreme):
    """Largest applied IS weight over the tokens that reach the loss."""

    reduce = "max"
    empty_value = 1.0

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.weights, stats.kept


class ImportanceWeightMin(Extreme):
    """Smallest applied IS weight over the tokens that reach the loss."""

    reduce = "min"
    empty_value = 1.0

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.weights, stats.kept


class AbsLogProbDiffMean(RatioOfSums):
    """Mean of ``|log pi_prox - log pi_rollout|`` over response tokens."""

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return abs_logprob_diff_sums(stats)


class AbsLogProbDiffMax(Extreme):
    """Max of ``|log pi_prox - log pi_rollout|`` over response tokens."""

    reduce = "max"

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.log_rho.abs(), stats.response_mask


class RejectionRate(RatioOfSums):
    """Fraction of response tokens (or sequences) that one rejection mask removed.

    Args:
        mask: a mask name of :attr:`OffPolicyCorrectionConfig.mask_names`, or ``"total"`` for the
            tokens / sequences removed by any mask.
        level: ``"token"`` or ``"sequence"`` (a sequence counts once any of its tokens is removed).
    """

    def __init__(self, mask: str = "total", level: Level = "token", **kwargs: Any) -> None:
        check_level("RejectionRate", level)
        super().__init__(**kwargs)
        self.mask = mask
        self.level = level

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return rejection_sums(stats, self.mask, self.level)


class CorrectionMetrics(MetricCollection):
    """Every ``rollout_corr/`` metric for one correction config, updated with ``update(stats)``.

    ``compute()`` syncs across ranks and returns ``{"rollout_corr/kl": ..., ...}``, ready for
    ``LightningModule.log_dict``; call ``reset()`` afterwards on every rank.

    Args:
        config: the correction; one token and one sequence rejection rate is tracked for each
            of its enabled masks, plus ``total``.
        prefix: key prefix of the logged values.
    """

    def __init__(self, config: OffPolicyCorrectionConfig | None = None, prefix: str = "rollout_corr/") -> None:
        config = config if config is not None else OffPolicyCorrectionConfig.disabled()
        metrics: dict[str, Metric] = {
            "kl": MismatchKL("k1"),
            "k3_kl": MismatchKL("k3"),
            "log_ppl_diff": LogPerplexityDiff(),
            "ppl_ratio": PerplexityRatio(),
            "chi2_token": ChiSquared("token"),
            "chi2_seq": ChiSquared("sequence"),
            "ess": EffectiveSampleSize("token"),
            "ess_seq": EffectiveSampleSize("sequence"),
            "is_weight_mean": ImportanceWeightMean(),
            "is_weight_min": ImportanceWeightMin(),
            "is_weight_max": ImportanceWeightMax(),
            "is_weight_clip_frac": ImportanceWeightClipFraction(),
            "abs_logprob_diff_mean": AbsLogProbDiffMean(),
            "abs_logprob_diff_max": AbsLogProbDiffMax(),
        }
        for mask in [*dict.fromkeys(config.mask_names), "total"]:
            metrics[f"{mask}_token_reject_rate"] = RejectionRate(mask, "token")
            metrics[f"{mask}_seq_reject_rate"] = RejectionRate(mask, "sequence")
        # compute_groups would merge metrics whose states happen to be equal after the first
        # update (e.g. two rejection rates that are both 0) and then stop updating one of them.
        super().__init__(metrics, prefix=prefix, compute_groups=False)

    def sums(self, stats: CorrectionStats) -> dict[str, tuple[torch.Tensor, ...]]:
        """Per metric (unprefixed name), the sums one ``update(stats)`` adds; no state changes."""
        return {name: metric.sums(stats) for name, metric in self.items(keep_base=True, copy_state=False)}

    def update_from_sums(self, sums: dict[str, tuple[torch.Tensor, ...]]) -> None:
        """Add one batch from :meth:`sums` computed elsewhere (e.g. inside a compiled step).

        Equal to ``update(stats)`` with the ``stats`` those sums came from.
        """
        missing = [name for name, _ in self.items(keep_base=True, copy_state=False) if name not in sums]
        if missing:
            raise ValueError(
                f"CorrectionMetrics.update_from_sums: no sums for {', '.join(missing)}; pass the sums of a "
                "CorrectionMetrics built for the same correction config."
            )
        for name, metric in self.items(keep_base=True, copy_state=False):
            metric.update(sums=sums[name])
