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
from lightning_offpolicy.correction.losses import PolicyLossInfo
from lightning_offpolicy.correction.ratios import safe_exp

_F64 = torch.float64
Level = Literal["token", "sequence"]


def _check_level(name: str, level: str) -> None:
    if level not in ("token", "sequence"):
        raise ValueError(f"{name}: level={level!r} is not known; allowed: 'token', 'sequence'.")


def _cached(stats: CorrectionStats, key: str, make: Any) -> torch.Tensor:
    """Compute a derived tensor once per ``stats`` object, shared by every metric of a bundle."""
    cache = stats.__dict__.setdefault("_metric_cache", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _sum64(values: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 sum, optionally over ``where`` only (``torch.where``: no boolean gather, no sync)."""
    if where is not None:
        values = torch.where(where, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return values.sum(dtype=_F64)


def _token_count(stats: CorrectionStats) -> torch.Tensor:
    return _cached(stats, "token_count", lambda: stats.response_mask.sum(dtype=_F64))


def _token_rho(stats: CorrectionStats) -> torch.Tensor:
    """``rho_t`` on every position (``log_rho`` is 0 at padding, so ``rho`` is 1 there)."""
    return _cached(stats, "rho", lambda: safe_exp(stats.log_rho))


def _sequence_log_values(stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``S_i`` (0 for sequences without a response token) and the number of valid sequences."""
    return stats.seq_log_rho, _cached(stats, "seq_count", lambda: stats.seq_valid.sum(dtype=_F64))


# --------------------------------------------------------------------------------------------
# Functional twins: the sums one update adds.
# --------------------------------------------------------------------------------------------
def mismatch_kl_sums(stats: CorrectionStats, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` over response tokens of ``-log rho`` (k1) or ``rho - 1 - log rho`` (k3)."""
    # Both terms are exactly 0 at padding (log_rho = 0, rho = 1): no mask needed.
    if estimator == "k1":
        return -_sum64(stats.log_rho), _token_count(stats)
    return _sum64(_token_rho(stats) - 1.0 - stats.log_rho), _token_count(stats)


def log_ppl_sums(stats: CorrectionStats, exponentiate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i d_i, count)`` with ``d_i = -S_i / n_i`` (or ``exp(d_i)`` for the PPL ratio)."""
    seq_sum, count = _sequence_log_values(stats)
    diff = -seq_sum.to(_F64) / stats.seq_tokens.to(_F64).clamp(min=1.0)
    return _sum64(safe_exp(diff) if exponentiate else diff, stats.seq_valid), count


def chi2_sums(stats: CorrectionStats, level: Level = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum rho^2, count)`` over response tokens or over sequences (``rho = exp(S_i)``)."""
    if level == "token":
        return _sum64(_token_rho(stats).square(), stats.response_mask), _token_count(stats)
    seq_sum, count = _sequence_log_values(stats)
    return _sum64(safe_exp(seq_sum.to(_F64)).square(), stats.seq_valid), count


def ess_sums(stats: CorrectionStats, level: Level = "token") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum rho, sum rho^2, count)`` over response tokens or over sequences."""
    if level == "token":
        rho, where, count = _token_rho(stats), stats.response_mask, _token_count(stats)
    else:
        seq_sum, count = _sequence_log_values(stats)
        rho, where = safe_exp(seq_sum.to(_F64)), stats.seq_valid
    return _sum64(rho, where), _sum64(rho.square(), where), count


def rejection_sums(
    stats: CorrectionStats, mask: str = "total", level: Level = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rejected, count)`` of response tokens or valid sequences removed by ``mask``."""
    response = stats.response_mask
    if mask == "total":
        rejected_tokens = response & ~stats.kept
    else:
        rejected_tokens = stats.token_rejected.get(mask, torch.zeros_like(response))
    if level == "token":
        return rejected_tokens.sum(dtype=_F64), _token_count(stats)
    valid = stats.seq_valid
    return (valid & rejected_tokens.any(dim=-1)).sum(dtype=_F64), valid.sum(dtype=_F64)


def weight_sums(stats: CorrectionStats, clipped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the applied IS weights, kept tokens)``, or ``(truncated kept tokens, kept tokens)``."""
    kept_count = stats.kept.sum(dtype=_F64)
    if clipped:
        return (stats.weight_clipped & stats.kept).sum(dtype=_F64), kept_count
    return _sum64(stats.weights, stats.kept), kept_count


def abs_logprob_diff_sums(stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum |log rho_t|, count)`` over response tokens."""
    return _sum64(stats.log_rho.abs()), _token_count(stats)


def extreme_value(values: torch.Tensor, where: torch.Tensor, reduce: Literal["max", "min"]) -> torch.Tensor:
    """float64 ``max`` / ``min`` of ``values`` where ``where`` is set (-inf / +inf when none is)."""
    fill = torch.tensor(float("-inf") if reduce == "max" else float("inf"), dtype=values.dtype, device=values.device)
    if not values.numel():
        return fill.to(_F64)
    chosen = torch.where(where, values, fill)
    return (chosen.amax() if reduce == "max" else chosen.amin()).to(_F64)


# --------------------------------------------------------------------------------------------
# Metric classes
# --------------------------------------------------------------------------------------------
class _FromSums:
    """``update`` of a metric whose batch contribution is :meth:`sums` of its stats, added by ``_accumulate``."""

    def update(self, stats: Any = None, sums: tuple[torch.Tensor, ...] | None = None) -> None:
        """Add one batch: from its ``stats`` (or ``info``), or from ``sums``, this metric's
        :meth:`sums` of a batch computed elsewhere (the fused step of
        :mod:`~lightning_offpolicy.correction.fused` computes them inside its compiled graph)."""
        self._accumulate(*(sums if sums is not None else self.sums(stats)))

    def sums(self, stats: Any) -> tuple[torch.Tensor, ...]:
        """The sums one update with ``stats`` adds."""
        raise NotImplementedError

    def _accumulate(self, *sums: torch.Tensor) -> None:
        raise NotImplementedError


class _RatioOfSums(_FromSums, Metric):
    """``numerator / denominator`` of running float64 sums (0 when nothing was accumulated)."""

    full_state_update = False
    higher_is_better = None
    is_differentiable = False
    empty_value = 0.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("numerator", default=torch.tensor(0.0, dtype=_F64), dist_reduce_fx="sum")
        self.add_state("denominator", default=torch.tensor(0.0, dtype=_F64), dist_reduce_fx="sum")

    def _accumulate(self, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
        self.numerator += numerator.to(self.numerator.device, _F64)
        self.denominator += denominator.to(self.denominator.device, _F64)

    def compute(self) -> torch.Tensor:
        if self.denominator <= 0:
            return torch.tensor(self.empty_value, dtype=_F64, device=self.denominator.device)
        return self.numerator / self.denominator


class MismatchKL(_RatioOfSums):
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


class LogPerplexityDiff(_RatioOfSums):
    """Mean over sequences of ``log PPL(pi_prox) - log PPL(pi_rollout) = -mean_t log rho_t``."""

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return log_ppl_sums(stats)


class PerplexityRatio(_RatioOfSums):
    """Mean over sequences of ``PPL(pi_prox) / PPL(pi_rollout)``."""

    empty_value = 1.0

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return log_ppl_sums(stats, exponentiate=True)


class ChiSquared(_RatioOfSums):
    r"""Chi-squared divergence of pi_prox from pi_rollout: :math:`E[\rho^2] - 1`.

    Args:
        level: ``"token"`` (:math:`\rho_t`) or ``"sequence"`` (:math:`\prod_t \rho_t`).
    """

    def __init__(self, level: Level = "token", **kwargs: Any) -> None:
        _check_level("ChiSquared", level)
        super().__init__(**kwargs)
        self.level = level

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return chi2_sums(stats, self.level)

    def compute(self) -> torch.Tensor:
        if self.denominator <= 0:
            return torch.tensor(0.0, dtype=_F64, device=self.denominator.device)
        return self.numerator / self.denominator - 1.0


class EffectiveSampleSize(_FromSums, Metric):
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
        _check_level("EffectiveSampleSize", level)
        super().__init__(**kwargs)
        self.level = level
        for name in ("sum_w", "sum_w2", "count"):
            self.add_state(name, default=torch.tensor(0.0, dtype=_F64), dist_reduce_fx="sum")

    def _accumulate(self, sum_w: torch.Tensor, sum_w2: torch.Tensor, count: torch.Tensor) -> None:
        self.sum_w += sum_w.to(self.sum_w.device)
        self.sum_w2 += sum_w2.to(self.sum_w2.device)
        self.count += count.to(self.count.device)

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        """``(sum rho, sum rho^2, count)`` one update adds."""
        return ess_sums(stats, self.level)

    def compute(self) -> torch.Tensor:
        if self.count <= 0 or self.sum_w2 <= 0:
            return torch.tensor(1.0, dtype=_F64, device=self.count.device)
        return self.sum_w.square() / (self.count * self.sum_w2)


class ImportanceWeightMean(_RatioOfSums):
    """Mean applied IS weight over the tokens that reach the loss."""

    empty_value = 1.0

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return weight_sums(stats)


class ImportanceWeightClipFraction(_RatioOfSums):
    """Fraction of the tokens that reach the loss whose IS weight was truncated."""

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return weight_sums(stats, clipped=True)


class _Extreme(_FromSums, Metric):
    """Running max or min (``dist_reduce_fx`` max / min) with a neutral value when empty."""

    full_state_update = False
    higher_is_better = None
    is_differentiable = False
    reduce: Literal["max", "min"] = "max"
    empty_value = 0.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        start = float("-inf") if self.reduce == "max" else float("inf")
        self.add_state("value", default=torch.tensor(start, dtype=_F64), dist_reduce_fx=self.reduce)

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidate values and where they count."""
        raise NotImplementedError

    def _accumulate(self, extreme: torch.Tensor) -> None:
        combine = torch.maximum if self.reduce == "max" else torch.minimum
        self.value = combine(self.value, extreme.to(self.value.device, _F64))

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        """``(extreme,)`` of this batch."""
        return (extreme_value(*self._values(stats), self.reduce),)

    def compute(self) -> torch.Tensor:
        if torch.isinf(self.value):
            return torch.tensor(self.empty_value, dtype=_F64, device=self.value.device)
        return self.value


class ImportanceWeightMax(_Extreme):
    """Largest applied IS weight over the tokens that reach the loss."""

    reduce = "max"
    empty_value = 1.0

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.weights, stats.kept


class ImportanceWeightMin(_Extreme):
    """Smallest applied IS weight over the tokens that reach the loss."""

    reduce = "min"
    empty_value = 1.0

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.weights, stats.kept


class AbsLogProbDiffMean(_RatioOfSums):
    """Mean of ``|log pi_prox - log pi_rollout|`` over response tokens."""

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return abs_logprob_diff_sums(stats)


class AbsLogProbDiffMax(_Extreme):
    """Max of ``|log pi_prox - log pi_rollout|`` over response tokens."""

    reduce = "max"

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.log_rho.abs(), stats.response_mask


class RejectionRate(_RatioOfSums):
    """Fraction of response tokens (or sequences) that one rejection mask removed.

    Args:
        mask: a mask name of :attr:`OffPolicyCorrectionConfig.mask_names`, or ``"total"`` for the
            tokens / sequences removed by any mask.
        level: ``"token"`` or ``"sequence"`` (a sequence counts once any of its tokens is removed).
    """

    def __init__(self, mask: str = "total", level: Level = "token", **kwargs: Any) -> None:
        _check_level("RejectionRate", level)
        super().__init__(**kwargs)
        self.mask = mask
        self.level = level

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        return rejection_sums(stats, self.mask, self.level)


class _LossInfoRatio(_RatioOfSums):
    """A ratio of two sums of :class:`~lightning_offpolicy.correction.PolicyLossInfo`, updated with ``update(info)``."""

    def update(self, info: PolicyLossInfo) -> None:
        self._accumulate(*self.sums(info))


class PPOClipFraction(_LossInfoRatio):
    """Fraction of the tokens in the loss where the clip was active (PPO ratio or IS weight)."""

    def sums(self, info: PolicyLossInfo) -> tuple[torch.Tensor, ...]:
        return info.clipped_tokens, info.kept_tokens


class DualClipFraction(_LossInfoRatio):
    """Fraction of the tokens in the loss where the dual clip was active."""

    def sums(self, info: PolicyLossInfo) -> tuple[torch.Tensor, ...]:
        return info.dual_clipped_tokens, info.kept_tokens


class ApproxKL(_LossInfoRatio):
    """``mean_t((r - 1) - log r)``, ``r = pi_theta / pi_prox``, over the tokens in the loss."""

    def sums(self, info: PolicyLossInfo) -> tuple[torch.Tensor, ...]:
        return info.approx_kl_sum, info.kept_tokens


class OPSMRejectionRate(_LossInfoRatio):
    """Fraction of response tokens (or sequences) the loss's OPSM mask removed.

    A response token counts whether or not the correction's masks had removed it already (OPSM
    tests every response token, as the token masks do); a sequence counts once OPSM removed any of
    its tokens. Over every call of the loss (all epochs and minibatches), as ``ppo/clip_frac``.

    Args:
        level: ``"token"`` or ``"sequence"``.

    Raises:
        ValueError: at ``update``, a :class:`~lightning_offpolicy.correction.PolicyLossInfo` of a
            loss computed without ``opsm_mask``.
    """

    def __init__(self, level: Level = "token", **kwargs: Any) -> None:
        _check_level("OPSMRejectionRate", level)
        super().__init__(**kwargs)
        self.level = level

    def sums(self, info: PolicyLossInfo) -> tuple[torch.Tensor, ...]:
        if info.opsm_rejected_tokens is None:
            raise ValueError(
                "OPSMRejectionRate: this PolicyLossInfo has no OPSM counts; compute the loss with the "
                "correction whose opsm_mask is on (PolicyLossMetrics(config) adds this metric only then)."
            )
        if self.level == "token":
            return info.opsm_rejected_tokens, info.response_tokens
        return info.opsm_rejected_sequences, info.response_sequences


class RolloutKL(_LossInfoRatio):
    """The rollout KL estimator averaged over response tokens.

    Reported whenever rollout logprobs are given, even with ``rollout_kl_coef=0``.
    """

    def sums(self, info: PolicyLossInfo) -> tuple[torch.Tensor, ...]:
        return info.rollout_kl_sum, info.response_tokens


# --------------------------------------------------------------------------------------------
# Bundles
# --------------------------------------------------------------------------------------------
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


class PolicyLossMetrics(MetricCollection):
    """``ppo/clip_frac``, ``ppo/dual_clip_frac``, ``ppo/approx_kl`` and ``ppo/rollout_kl``, from ``update(info)``.

    Args:
        config: the correction; with its ``opsm_mask`` on, ``ppo/opsm_mask_token_reject_rate`` and
            ``ppo/opsm_mask_seq_reject_rate`` are tracked too (``None``: the four above only).
        prefix: key prefix of the logged values.
    """

    def __init__(self, config: OffPolicyCorrectionConfig | None = None, prefix: str = "ppo/") -> None:
        metrics: dict[str, Metric] = {
            "clip_frac": PPOClipFraction(),
            "dual_clip_frac": DualClipFraction(),
            "approx_kl": ApproxKL(),
            "rollout_kl": RolloutKL(),
        }
        if config is not None and config.opsm_mask:
            metrics["opsm_mask_token_reject_rate"] = OPSMRejectionRate("token")
            metrics["opsm_mask_seq_reject_rate"] = OPSMRejectionRate("sequence")
        super().__init__(metrics, prefix=prefix, compute_groups=False)
