"""Typed configuration of the policy loss: PPO clip range, dual clip, GSPO / SAPO, DPPO's
divergence trust region, the aggregation mode, the rollout / reference KL penalties and the entropy bonus.

Validated in ``__post_init__``; the message names the setting, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_number
from lightning_offpolicy.correction.peer_names import (
    LOSS_PEER_OF,
    PeerNameError,
    apply_translation,
    split_peer_names,
    translate_loss,
)
from lightning_offpolicy.correction.validation import (
    DPPO_LOSS_TYPES,
    Aggregation,
    CorrectionConfigError,
    KLEstimator,
    LossType,
    check_choice,
    check_positive,
)


@dataclass
class PolicyLossConfig:
    """How the policy-gradient surrogate is built and aggregated.

    Args:
        loss_type: ``"ppo"`` (token ratio), ``"gspo"`` (sequence ratio, length-normalised),
            ``"sapo"`` (soft sigmoid gate instead of the hard clip), or DPPO's divergence trust
            region in place of the clip (:mod:`~lightning_offpolicy.correction.dppo`):
            ``"dppo_tv"`` (binary total variation) or ``"dppo_kl"`` (binary KL). The ``pure_is``
            / ``cispo`` / ``reinforce`` objectives replace the surrogate and need ``"ppo"``.
        eps_clip_low: PPO lower clip: ratio floor ``1 - eps_clip_low``.
        eps_clip_high: PPO upper clip: ratio ceiling ``1 + eps_clip_high`` (0.28 for DAPO's clip-higher).
        dual_clip: Dual-clip constant ``c > 1`` bounding the loss of negative-advantage tokens by
            ``c * |A|``; ``None`` disables it.
        tau_pos: SAPO gate temperature for tokens with positive advantage.
        tau_neg: SAPO gate temperature for tokens with non-positive advantage.
        aggregation: ``"token-mean"`` (sum over kept tokens / number of response tokens),
            ``"seq-mean-token-mean"`` (per-sequence token mean, then mean over sequences) or
            ``"seq-mean-token-sum-norm"`` (per-sequence token sum / ``loss_norm_constant``, then
            mean over sequences: Dr.GRPO).
        loss_norm_constant: Constant normaliser of ``seq-mean-token-sum-norm`` (e.g. the maximum
            response length); ``None`` uses the padded response length of the batch.
        rollout_kl_coef: Coefficient of the rollout KL loss ``kl(pi_theta, pi_rollout)`` (0 disables).
        rollout_kl_estimator: Estimator of the rollout KL loss (``k2`` is prime-rl's squared log ratio / 2).
        ref_kl_coef: Coefficient of the reference KL loss ``kl(pi_theta, pi_ref)`` (0 disables).
        ref_kl_estimator: Estimator of the reference KL loss.
        entropy_coef: Coefficient of the entropy bonus: ``- entropy_coef * H`` is added to the loss,
            ``H`` the per-token entropy of ``pi_theta`` aggregated like the loss over the response
            tokens (verl's ``entropy_coeff``, SkyRL's ``entropy_loss_coef``; 0 disables).
        dppo_delta_low: DPPO bound for tokens with ``A < 0``: masked when their probability fell
            by more than this (``dppo_tv``), or fell with a binary KL above this (``dppo_kl``).
            0.2 is every peer's default; SkyRL and verl suggest about 0.05 for ``dppo_kl``.
        dppo_delta_high: DPPO bound for tokens with ``A > 0`` whose probability rose.
        dppo_ratio_cap: DPPO only: truncate the ratio that multiplies the advantage at this value
            (verl's ``clip_ratio_c``, 3.0 in its default config); ``None``: no cap (prime-rl, SkyRL).

    Peers' names for these settings (verl, SkyRL, prime-rl) are read by :meth:`from_peer_names`.
    """

    loss_type: LossType = "ppo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    aggregation: Aggregation = "token-mean"
    loss_norm_constant: float | None = None
    rollout_kl_coef: float = 0.0
    rollout_kl_estimator: KLEstimator = "k2"
    ref_kl_coef: float = 0.0
    ref_kl_estimator: KLEstimator = "low_var_kl"
    entropy_coef: float = 0.0
    # DPPO's trust region (loss_type "dppo_tv" / "dppo_kl").
    dppo_delta_low: float = 0.2
    dppo_delta_high: float = 0.2
    dppo_ratio_cap: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_peer_names(cls, **settings: Any) -> PolicyLossConfig:
        """The kit's loss config for one peer's setting names, e.g. ``from_peer_names(loss_mode="dppo_tv")``.

        The peers' names: verl's ``actor_rollout_ref.actor.*`` (``loss_mode``, ``clip_ratio_*``),
        SkyRL's ``policy_loss_type`` with its ``algorithm.dppo.*`` keys given flat, prime-rl's
        ``[trainer.loss]`` keys (:data:`~lightning_offpolicy.correction.peer_names.LOSS_PEER_OF`).
        The mapping and what differs: docs/off_policy_correction.md, section 6.

        Args:
            **settings: One peer's keys (a ``None`` value is "not given"), and optionally kit fields,
                which a peer key must not contradict.

        Returns:
            The validated config; one :class:`~lightning_offpolicy.correction.peer_names.PeerNameWarning`
            per peer names the kit's settings.

        Raises:
            CorrectionConfigError: a key that is neither a peer's nor a field (the message names it),
                keys of two peers mixed, a value the peer does not know, a setting whose meaning
                differs from the kit's (the message gives the kit's equivalent), or a kit field that
                contradicts a peer key.
        """
        kit, peer = split_peer_names(cls, settings, LOSS_PEER_OF)
        try:
            translation = translate_loss(peer)
        except PeerNameError as err:
            raise CorrectionConfigError(str(err)) from None
        return cls(**apply_translation(cls, kit, translation))

    def validate(self) -> None:
        """Check every setting; raise :class:`CorrectionConfigError`."""
        own = "PolicyLossConfig"
        check_choice(own, "loss_type", self.loss_type, LossType)
        check_choice(own, "aggregation", self.aggregation, Aggregation)
        check_choice(own, "rollout_kl_estimator", self.rollout_kl_estimator, KLEstimator)
        check_choice(own, "ref_kl_estimator", self.ref_kl_estimator, KLEstimator)
        check_positive(own, "eps_clip_low", self.eps_clip_low)
        check_positive(own, "eps_clip_high", self.eps_clip_high)
        if self.eps_clip_low >= 1:
            raise CorrectionConfigError(
                f"{own}.eps_clip_low={self.eps_clip_low!r} must be below 1 (the ratio floor is 1 - eps_clip_low)."
            )
        if self.dual_clip is not None and (not math.isfinite(self.dual_clip) or self.dual_clip <= 1):
            raise CorrectionConfigError(f"{own}.dual_clip={self.dual_clip!r} must be greater than 1, or None.")
        check_positive(own, "tau_pos", self.tau_pos)
        check_positive(own, "tau_neg", self.tau_neg)
        check_positive(own, "loss_norm_constant", self.loss_norm_constant, optional=True)
        for name in ("rollout_kl_coef", "ref_kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise CorrectionConfigError(f"{own}.{name}={value!r} must be a finite number >= 0.")
        self._validate_dppo(own)

    def _validate_dppo(self, own: str) -> None:
        for name in ("dppo_delta_low", "dppo_delta_high"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise CorrectionConfigError(
                    f"{own}.{name}={value!r} must be a finite number >= 0 (a bound on the change of a "
                    "token's probability, binary TV, or on its binary KL)."
                )
        check_positive(own, "dppo_ratio_cap", self.dppo_ratio_cap, optional=True)
        if self.loss_type in DPPO_LOSS_TYPES:
            if self.dual_clip is not None:
                raise CorrectionConfigError(
                    f"{own}.dual_clip={self.dual_clip!r} bounds PPO's clipped loss; loss_type={self.loss_type!r} has "
                    "no clip to bound: bound its ratio with dppo_ratio_cap (verl's clip_ratio_c), or drop dual_clip."
                )
        elif self.dppo_ratio_cap is not None:
            raise CorrectionConfigError(
                f"{own}.dppo_ratio_cap={self.dppo_ratio_cap!r} has no effect with loss_type={self.loss_type!r}; "
                f"it caps DPPO's ratio: set loss_type to one of {', '.join(map(repr, DPPO_LOSS_TYPES))}, or drop it."
            )


def check_objective_compatible(objective: str, loss: PolicyLossConfig) -> None:
    """Refuse a ``loss.loss_type`` other than ``"ppo"`` with an ``objective`` that replaces the surrogate."""
    if objective != "ppo" and loss.loss_type != "ppo":
        raise CorrectionConfigError(
            f"OffPolicyCorrectionConfig.objective={objective!r} replaces the surrogate, so "
            f"PolicyLossConfig.loss_type={loss.loss_type!r} cannot apply; set loss_type='ppo'."
        )


# Checkpoints keep the config in their hyperparameters: every `torch.load(weights_only=True)` that can
# name it rebuilds it, Lightning's resume and `load_from_checkpoint` included.
torch.serialization.add_safe_globals([PolicyLossConfig])
