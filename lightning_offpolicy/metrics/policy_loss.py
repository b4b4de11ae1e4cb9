"""The ``ppo/`` metrics of :func:`~lightning_offpolicy.correction.policy_loss`, from its
:class:`~lightning_offpolicy.correction.PolicyLossInfo` sums, exact across devices (docs/metrics.md)."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric, MetricCollection

from lightning_offpolicy.correction.config import OffPolicyCorrectionConfig
from lightning_offpolicy.correction.losses import PolicyLossInfo
from lightning_offpolicy.metrics.base import RatioOfSums
from lightning_offpolicy.metrics.sums import Level, check_level


class _LossInfoRatio(RatioOfSums):
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
        check_level("OPSMRejectionRate", level)
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
