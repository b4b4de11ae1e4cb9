"""Typed configuration of the off-policy correction: :class:`OffPolicyCorrectionConfig`.

It says how the gap between the engine that sampled the tokens (``pi_rollout``) and the trainer
(``pi_prox``, ``pi_theta``) is corrected: importance weights, rejection masks, an outlier veto, and
which objective anchors the update. It validates in ``__post_init__`` and fails with a message that
names the setting, the value and what is allowed. Its presets are classmethods
(:mod:`~lightning_offpolicy.correction.presets`); a peer's setting names go through
:meth:`OffPolicyCorrectionConfig.from_peer_names`.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_real
from lightning_offpolicy.correction.loss_config import PolicyLossConfig, check_objective_compatible
from lightning_offpolicy.correction.peer_names import (
    PEER_OF,
    PeerNameError,
    apply_translation,
    split_peer_names,
    translate,
)
from lightning_offpolicy.correction.presets import PRESET_METHODS, VERL_GEO_HIGH, VERL_GEO_LOW, CorrectionPresets
from lightning_offpolicy.correction.prox import ProxMethod
from lightning_offpolicy.correction.validation import (
    DPPO_LOSS_TYPES,
    Aggregation,
    Anchor,
    CorrectionConfigError,
    KLEstimator,
    LossType,
    Objective,
    RejectEstimator,
    RejectLevel,
    TISLevel,
    check_bounds,
    check_choice,
    check_positive,
)

__all__ = [
    "DPPO_LOSS_TYPES",
    "PRESETS",
    "VERL_GEO_HIGH",
    "VERL_GEO_LOW",
    "Aggregation",
    "Anchor",
    "CorrectionConfigError",
    "KLEstimator",
    "LossType",
    "Objective",
    "OffPolicyCorrectionConfig",
    "PolicyLossConfig",
    "RejectEstimator",
    "RejectLevel",
    "TISLevel",
    "check_compatible",
    "check_objective_compatible",
    "preset",
    "unknown_preset_message",
]

REMOVED_SPELLINGS = {"use_tis": "tis_level='token'", "tis_imp_ratio_cap": "tis_clip_high"}
"""Spellings of an unreleased version that were removed, and the setting that replaced each."""


@dataclass
class OffPolicyCorrectionConfig(CorrectionPresets):
    """How to correct for the gap between the rollout engine and the trainer.

    ``log_rho_t = prox_logprobs_t - rollout_logprobs_t``; ``rho_t = exp(log_rho_t)`` computed from
    log space clamped to [-20, 20]. Start from a preset (``OffPolicyCorrectionConfig.token_tis()``,
    ``geo_mis()``, ...) rather than from the fields: docs/off_policy_correction.md, "1. TL;DR: start
    from these presets"; the fields, their defaults and why: "3. The knobs".

    Args:
        bypass_mode: Use ``pi_rollout`` as the proximal policy (``prox := rollout``): no proximal
            forward pass, PPO clips against the engine's logprobs. Rejection masks then act on the
            current policy's ratio ``pi_theta / pi_rollout`` (detached, per micro-batch; verl's bypass
            mode), and the mismatch metrics report that ratio; without a mask they read zero.
        prox_method: How ``pi_prox`` is obtained (decoupled mode only): ``"recompute"``, one forward
            pass without gradient over the batch at the start of the step (free when the batch is
            one optimizer step in one micro-batch: then it is that step's own forward, detached), or
            ``"loglinear"`` (AReaL's ``prox_logp_method``): no forward pass; per micro-batch, after
            the forward, ``log pi_prox = log pi_rollout + alpha (log pi_theta - log pi_rollout)``
            with ``alpha`` from each token's version against the step's
            (:mod:`~lightning_offpolicy.correction.prox`). The correction (weights, masks, metrics)
            then runs per micro-batch on that interpolated ``pi_prox``, so the settings that need
            the whole batch (:attr:`whole_batch_settings`: ``normalize_weights``, ``m2po_mask``) are
            refused with it.
        tis_level: Truncated importance sampling weight ``w = min(rho, tis_clip_high)`` per
            ``"token"`` or per ``"sequence"`` (``rho_i = prod_t rho_t``); ``None`` for no weight.
        tis_clip_high: Upper cap ``C`` of the TIS weight (required with ``tis_level``); ``inf`` for no
            cap (the weight is the ratio itself).
        tis_clip_low: Optional lower clamp of the TIS weight.
        normalize_weights: Rescale the TIS weights to mean 1 over the kept tokens (token level) or
            kept sequences (sequence level) of the whole batch, exact across ranks.
        token_mask: Reject single tokens whose ``rho_t`` is outside
            ``[token_mask_low, token_mask_high]`` (IcePop, two-sided).
        token_mask_low: Lower bound of the token mask (``None``: no lower bound).
        token_mask_high: Upper bound of the token mask (``None``: no upper bound).
        geo_mask: Reject a sequence whose geometric-mean ratio
            ``exp(mean_t log_rho_t)`` is outside ``[geo_mask_low, geo_mask_high]``.
        geo_mask_low: Lower bound of the geometric mask.
        geo_mask_high: Upper bound of the geometric mask.
        product_mask: Reject a sequence whose product ratio ``exp(sum_t log_rho_t)`` is outside
            ``[product_mask_low, product_mask_high]``.
        product_mask_low: Lower bound of the product mask (``None``: no lower bound).
        product_mask_high: Upper bound of the product mask (``None``: no upper bound).
        outlier_token_veto: Reject a whole sequence if any kept token has ``rho_t < outlier_low`` or
            ``rho_t > outlier_high``.
        outlier_low: Lower token threshold of the veto (``None``: none).
        outlier_high: Upper token threshold of the veto (``None``: none).
        kl_reject: Reject by a KL statistic of ``pi_rollout`` vs ``pi_prox``: ``"k1"``
            (``-log_rho``, compared in absolute value), ``"k2"`` (``log_rho^2 / 2``) or ``"k3"``
            (``rho - 1 - log_rho``); ``None`` disables it.
        kl_reject_level: Where the statistic is taken: per ``"token"``, or per sequence as
            ``"seq_sum"``, ``"seq_mean"`` or ``"seq_max"`` over its kept tokens.
        kl_reject_threshold: Reject where the statistic exceeds this value (required with
            ``kl_reject``).
        m2po_mask: M2PO's second-moment token mask (AReaL's ``m2_threshold``): over the response
            tokens of the batch passed to :func:`compute_correction`, reject the fewest tokens,
            largest ``log_rho_t^2`` first, that bring the mean ``log_rho^2`` of the others below
            ``m2po_threshold`` (one token at least stays). A token mask: it tests every response token.
        m2po_threshold: That bound on the second moment (0.04: AReaL's example and the M2PO paper's).
        objective: ``"ppo"`` (decoupled PPO clip on ``pi_theta / pi_prox``), ``"pure_is"``
            (off-policy REINFORCE with a truncated ``pi_theta / pi_rollout`` weight, no PPO clip),
            ``"cispo"`` (detached clipped current-policy weight, gradient only through
            ``log pi_theta``) or ``"reinforce"`` (``-A log pi_theta`` with no weight: verl's bypass
            ``loss_type="reinforce"`` without ``rollout_is``).
        objective_level: For ``pure_is``: weight per ``"token"`` or per ``"sequence"``.
        anchor: For ``cispo``: the denominator of the current-policy ratio, ``"rollout"`` (corrects
            mismatch and staleness in one weight) or ``"prox"`` (combine with a TIS weight).
        is_clip_low: Lower clip of the ``pure_is`` / ``cispo`` current-policy weight (``None``:
            no lower clip).
        is_clip_high: Upper clip of the ``pure_is`` / ``cispo`` current-policy weight.
        opsm_mask: Off-policy sequence masking (OPSM, DeepSeek-V3.2), applied by the loss: drop the
            tokens with a negative advantage of every sequence whose mean log ratio
            ``mean_t(log pi_reference - log pi_theta)`` over its response tokens exceeds
            ``opsm_threshold`` (``pi_theta`` detached, at each call of the loss, so it tracks the update).
        opsm_threshold: The threshold ``delta`` of ``opsm_mask`` (TRL's ``off_policy_mask_threshold``,
            whose suggested start 0.5 this is; slime's ``--opsm-delta``, default 1e-4 there).
        opsm_reference: The policy ``opsm_mask`` compares ``pi_theta`` with: ``"rollout"`` (the engine,
            as DeepSeek-V3.2 defines it and TRL computes it: mismatch and staleness) or ``"prox"``
            (slime: the policy at the start of the step; ``pi_rollout`` in bypass mode).

    Peers' names for these settings (verl, SkyRL, TRL, slime, AReaL) are read by :meth:`from_peer_names`.
    """

    bypass_mode: bool = False
    prox_method: ProxMethod = "recompute"
    # Group 1: truncated importance sampling weights.
    tis_level: TISLevel | None = None
    tis_clip_high: float | None = 2.0
    tis_clip_low: float | None = None
    normalize_weights: bool = False
    # Group 2: rejection masks.
    token_mask: bool = False
    token_mask_low: float | None = 0.5
    token_mask_high: float | None = 2.0
    geo_mask: bool = False
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    product_mask: bool = False
    product_mask_low: float | None = 0.5
    product_mask_high: float | None = 2.0
    kl_reject: RejectEstimator | None = None
    kl_reject_level: RejectLevel = "seq_mean"
    kl_reject_threshold: float | None = None
    m2po_mask: bool = False
    m2po_threshold: float = 0.04
    # Group 3: outlier veto.
    outlier_token_veto: bool = False
    outlier_low: float | None = 1e-4
    outlier_high: float | None = 100.0
    # Objective anchored on the current policy.
    objective: Objective = "ppo"
    objective_level: TISLevel = "token"
    anchor: Anchor = "rollout"
    is_clip_low: float | None = None
    is_clip_high: float | None = 2.0
    # Off-policy sequence masking: a mask of the loss, which has pi_theta and the advantages.
    opsm_mask: bool = False
    opsm_threshold: float = 0.5
    opsm_reference: Anchor = "rollout"

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_peer_names(cls, **settings: Any) -> OffPolicyCorrectionConfig:
        """The kit's config for one peer's setting names, e.g. ``from_peer_names(rollout_is="token")``.

        The peers' names: verl's ``algorithm.rollout_correction.*``, SkyRL's
        ``trainer.algorithm.off_policy_correction.*``, TRL's ``GRPOConfig.vllm_importance_sampling_*``
        and ``off_policy_mask_threshold``, slime's ``use_opsm`` / ``opsm_delta``, AReaL's
        ``m2_threshold`` and ``prox_logp_method``
        (:data:`~lightning_offpolicy.correction.peer_names.PEER_OF`). The mapping, and the settings
        refused because their meaning differs: docs/off_policy_correction.md, section 6.

        Args:
            **settings: One peer's keys (``None`` is "not given", except TRL's
                ``vllm_importance_sampling_clip_max=None``: no upper bound), and optionally kit
                fields: ``bypass_mode`` decides what verl's ``loss_type`` and ``rollout_is`` mean;
                a kit field set away from its default must not contradict a peer key.

        Returns:
            The validated config; one :class:`~lightning_offpolicy.correction.peer_names.PeerNameWarning`
            per peer key names the kit's settings.

        Raises:
            CorrectionConfigError: a key that is neither a peer's nor a field (the message names it,
                and the setting that replaced a removed spelling), keys of two peers mixed, a value
                the peer does not know, a setting whose meaning differs from the kit's (the message
                gives the kit's equivalent), or a kit field that contradicts a peer key.
        """
        kit, peer = split_peer_names(cls, settings, PEER_OF, removed=REMOVED_SPELLINGS)
        try:
            translation = translate(peer, bypass_mode=bool(kit.get("bypass_mode", False)))
        except PeerNameError as err:
            raise CorrectionConfigError(str(err)) from None
        return cls(**apply_translation(cls, kit, translation))

    def validate(self) -> None:
        """Check every setting and their combinations; raise :class:`CorrectionConfigError`."""
        own = "OffPolicyCorrectionConfig"
        check_choice(own, "prox_method", self.prox_method, ProxMethod)
        check_choice(own, "tis_level", self.tis_level, TISLevel, optional=True)
        check_choice(own, "objective", self.objective, Objective)
        check_choice(own, "objective_level", self.objective_level, TISLevel)
        check_choice(own, "anchor", self.anchor, Anchor)
        check_choice(own, "kl_reject", self.kl_reject, RejectEstimator, optional=True)
        check_choice(own, "kl_reject_level", self.kl_reject_level, RejectLevel)
        if self.tis_level is not None:
            if self.tis_clip_high is None:
                raise CorrectionConfigError(
                    f"{own}.tis_level={self.tis_level!r} needs tis_clip_high (the TIS cap, e.g. 2.0)."
                )
            # inf is "no cap" (TRL's vllm_importance_sampling_clip_max=None); any other value is checked.
            uncapped = is_real(self.tis_clip_high) and self.tis_clip_high == math.inf
            high = None if uncapped else self.tis_clip_high
            check_bounds(own, "tis_clip_low", self.tis_clip_low, "tis_clip_high", high)
        elif self.tis_clip_low is not None or self.normalize_weights:
            setting = "tis_clip_low" if self.tis_clip_low is not None else "normalize_weights"
            raise CorrectionConfigError(
                f"{own}.{setting} has no effect without tis_level; set tis_level='token' or 'sequence'."
            )
        if self.prox_method == "loglinear":
            self._validate_loglinear(own)
        if self.token_mask:
            check_bounds(own, "token_mask_low", self.token_mask_low, "token_mask_high", self.token_mask_high)
        if self.geo_mask:
            check_bounds(own, "geo_mask_low", self.geo_mask_low, "geo_mask_high", self.geo_mask_high)
        if self.product_mask:
            check_bounds(own, "product_mask_low", self.product_mask_low, "product_mask_high", self.product_mask_high)
        if self.outlier_token_veto:
            check_bounds(own, "outlier_low", self.outlier_low, "outlier_high", self.outlier_high)
        if self.kl_reject is not None and self.kl_reject_threshold is None:
            raise CorrectionConfigError(
                f"{own}.kl_reject={self.kl_reject!r} needs kl_reject_threshold (reject where the "
                f"{self.kl_reject} statistic exceeds it, e.g. 0.01)."
            )
        check_positive(own, "kl_reject_threshold", self.kl_reject_threshold, optional=True)
        if self.m2po_mask:
            check_positive(own, "m2po_threshold", self.m2po_threshold)
            if self.bypass_mode:
                # Bypass mode has no pi_prox: its masks read pi_theta / pi_rollout per micro-batch.
                raise CorrectionConfigError(
                    f"{own}.m2po_mask=True bounds the second moment of log(pi_prox / pi_rollout) over the batch, "
                    "and bypass_mode=True has no pi_prox (AReaL's M2PO needs its recomputed proximal log-probs): "
                    "set bypass_mode=False, or drop m2po_mask."
                )
        check_choice(own, "opsm_reference", self.opsm_reference, Anchor)
        if self.opsm_mask:
            check_positive(own, "opsm_threshold", self.opsm_threshold)
        if self.objective in ("pure_is", "cispo"):
            if self.is_clip_high is None:
                raise CorrectionConfigError(
                    f"{own}.objective={self.objective!r} needs is_clip_high (the weight's upper clip)."
                )
            check_bounds(own, "is_clip_low", self.is_clip_low, "is_clip_high", self.is_clip_high)
        # A TIS weight pi_prox/pi_rollout times a weight pi_theta/pi_rollout counts the mismatch twice.
        anchored_on_rollout = self.objective == "pure_is" or (self.objective == "cispo" and self.anchor == "rollout")
        if self.tis_level is not None and anchored_on_rollout:
            raise CorrectionConfigError(
                f"{own}: tis_level={self.tis_level!r} with objective={self.objective!r} anchored on "
                "pi_rollout is double correction (both weights divide by pi_rollout). Drop tis_level, "
                "or use objective='cispo' with anchor='prox'."
            )
        if self.bypass_mode:
            # The masks act on pi_theta / pi_rollout; a TIS weight would be that same ratio again.
            if self.tis_level is not None:
                fix = {
                    "ppo": "the PPO ratio pi_theta / pi_rollout already is the importance weight (verl refuses it "
                    "too); drop tis_level",
                    "reinforce": f"use objective='pure_is' with objective_level={self.tis_level!r} (the same "
                    "truncated weight pi_theta / pi_rollout)",
                }.get(self.objective, "the objective's own weight already divides by pi_rollout; drop tis_level")
                raise CorrectionConfigError(
                    f"{own}.bypass_mode=True with tis_level={self.tis_level!r} counts pi_theta / pi_rollout "
                    f"twice: {fix}. Rejection masks are allowed in bypass mode."
                )
            if self.objective == "cispo" and self.anchor == "prox":
                raise CorrectionConfigError(
                    f"{own}: bypass_mode=True has no pi_prox for objective='cispo' with anchor='prox'; "
                    "use anchor='rollout'."
                )

    def _validate_loglinear(self, own: str) -> None:
        if self.bypass_mode:
            raise CorrectionConfigError(
                f"{own}.prox_method='loglinear' interpolates pi_prox between pi_rollout and pi_theta, but "
                "bypass_mode=True has no pi_prox (pi_prox := pi_rollout, and no proximal forward runs either): "
                "drop one of them."
            )
        whole_batch = self.whole_batch_settings
        if whole_batch:
            raise CorrectionConfigError(
                f"{own}.prox_method='loglinear' computes the correction per micro-batch, after each forward (its "
                "pi_prox reads pi_theta), but "
                + "; ".join(f"{name} {need}" for name, need in whole_batch.items())
                + ": turn one of them off."
            )

    # ----------------------------------------------------------------------------------- queries
    @property
    def needs_prox(self) -> bool:
        """Whether the trainer runs the no-grad proximal forward (decoupled mode, ``prox_method="recompute"``)."""
        return not self.bypass_mode and self.prox_method == "recompute"

    @property
    def correction_reads_current_policy(self) -> bool:
        """Whether :func:`~lightning_offpolicy.correction.compute_correction` reads ``pi_theta``.

        Then it runs per micro-batch, after the forward pass: in bypass mode with a mask
        (:attr:`masks_read_current_policy`), and with ``prox_method="loglinear"``, whose ``pi_prox``
        is interpolated towards the current policy's detached logprobs.
        """
        return self.masks_read_current_policy or self.prox_method == "loglinear"

    @property
    def masks_read_current_policy(self) -> bool:
        """Whether the rejection masks compare ``pi_theta`` (not ``pi_prox``) with ``pi_rollout``.

        True in bypass mode with a mask: the correction is then computed per micro-batch, after the
        forward pass, from the current policy's detached logprobs (verl's bypass semantics).
        """
        return self.bypass_mode and bool(self.mask_names)

    def ratio_numerator(self, prox_logprobs: torch.Tensor | None, logprobs: torch.Tensor | None) -> torch.Tensor | None:
        """The logprobs :func:`~lightning_offpolicy.correction.compute_correction` compares with ``pi_rollout``.

        ``logprobs`` (``pi_theta``, detached) when :attr:`masks_read_current_policy`, ``None`` in
        bypass mode without a mask, else ``prox_logprobs``.
        """
        if self.masks_read_current_policy:
            return None if logprobs is None else logprobs.detach()
        return None if self.bypass_mode else prox_logprobs

    @property
    def whole_batch_settings(self) -> dict[str, str]:
        """The enabled settings whose result depends on the whole batch given to ``compute_correction``.

        Returns:
            Setting name -> what it needs of the batch; a trainer that computes the correction per
            micro-batch (``OffPolicyRLModule(fused_loss=True)``, ``prox_method="loglinear"``) would
            change their result.
        """
        needs = {}
        if self.normalize_weights:
            needs["normalize_weights"] = "needs the mean weight of the whole batch"
        if self.m2po_mask:
            needs["m2po_mask"] = "ranks the response tokens of the whole batch"
        return needs

    @property
    def mask_names(self) -> list[str]:
        """Names of the enabled rejection masks, in order of application."""
        names = []
        if self.token_mask:
            names.append("token_mask")
        if self.kl_reject is not None and self.kl_reject_level == "token":
            names.append("kl_reject")
        if self.m2po_mask:
            names.append("m2po_mask")
        if self.geo_mask:
            names.append("geo_mask")
        if self.product_mask:
            names.append("product_mask")
        if self.outlier_token_veto:
            names.append("outlier_veto")
        if self.kl_reject is not None and self.kl_reject_level != "token":
            names.append("kl_reject")
        return names

    def policy_loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~lightning_offpolicy.correction.policy_loss` this config fixes.

        Its objective, bypass mode and OPSM mask; with a :class:`CorrectionOutput`'s ``weights`` and ``mask``
        they are what ``policy_loss(..., correction=out)`` reads from ``out.config``.
        """
        return {name: getattr(self, name) for name in _LOSS_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for hyperparameter logging and YAML)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> OffPolicyCorrectionConfig:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)


#: The fields the policy loss reads (the others shape the weights and masks of compute_correction).
_LOSS_FIELDS = (
    "objective",
    "bypass_mode",
    "anchor",
    "objective_level",
    "is_clip_low",
    "is_clip_high",
    "opsm_mask",
    "opsm_threshold",
    "opsm_reference",
)

PRESETS: dict[str, Any] = {name: getattr(OffPolicyCorrectionConfig, method) for name, method in PRESET_METHODS.items()}
"""Every preset by name (what :func:`preset` accepts)."""


def check_compatible(correction: OffPolicyCorrectionConfig, loss: PolicyLossConfig) -> None:
    """Refuse combinations of a correction and a loss that cannot both apply."""
    check_objective_compatible(correction.objective, loss)


def preset(name: str, **kwargs: Any) -> OffPolicyCorrectionConfig:
    """Build a preset by name, e.g. ``preset("geo_mis", low=0.98)``."""
    if name not in PRESETS:
        raise CorrectionConfigError(unknown_preset_message(name))
    return PRESETS[name](**kwargs)


def unknown_preset_message(name: Any, setting: str = "correction preset") -> str:
    """``Unknown correction preset 'x'. Did you mean 'y'? Known presets: ...`` (close matches by ``difflib``)."""
    text = str(name)
    close = difflib.get_close_matches(text.lower().replace("-", "_"), sorted(PRESETS), n=3, cutoff=0.6)
    hint = ""
    if close:
        also = f" (or {', '.join(repr(c) for c in close[1:])})" if close[1:] else ""
        hint = f" Did you mean {close[0]!r}{also}?"
    return f"Unknown {setting} {text!r}.{hint} Known presets: {', '.join(sorted(PRESETS))}."


# Checkpoints keep the config in their hyperparameters. Registered here, next to the class, so that every
# `torch.load(weights_only=True)` that can name it rebuilds it: Lightning's resume and
# `load_from_checkpoint` included, which load before any module hook runs.
torch.serialization.add_safe_globals([OffPolicyCorrectionConfig])
