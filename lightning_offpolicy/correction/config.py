"""Typed configuration of the off-policy correction and of the policy loss.

Two plain dataclasses, both expressible in YAML / LightningCLI:

* :class:`OffPolicyCorrectionConfig` says how the gap between the engine that sampled the tokens
  (``pi_rollout``) and the trainer (``pi_prox``, ``pi_theta``) is corrected: importance weights,
  rejection masks, an outlier veto, and which objective anchors the update.
* :class:`PolicyLossConfig` says how the surrogate is built and aggregated: PPO clip range,
  dual clip, GSPO / SAPO, DPPO's divergence trust region, the aggregation mode, and the rollout /
  reference KL penalties.

Both validate in ``__post_init__`` and fail with a message that names the setting, the value and
what is allowed. Presets are classmethods on :class:`OffPolicyCorrectionConfig`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

import torch

from lightning_offpolicy.argcheck import is_number, is_real
from lightning_offpolicy.correction.peer_names import (
    LOSS_PEER_OF,
    PEER_DEFAULTS,
    PEER_OF,
    TRL_CLIP_MAX,
    PeerNameError,
    PeerNameWarning,
    translate,
    translate_loss,
)
from lightning_offpolicy.correction.prox import ProxMethod

TISLevel = Literal["token", "sequence"]
Objective = Literal["ppo", "pure_is", "cispo", "reinforce"]
Anchor = Literal["rollout", "prox"]
KLEstimator = Literal["k1", "abs", "k2", "k3", "low_var_kl"]
RejectEstimator = Literal["k1", "k2", "k3"]
RejectLevel = Literal["token", "seq_sum", "seq_mean", "seq_max"]
LossType = Literal["ppo", "gspo", "sapo", "dppo_tv", "dppo_kl"]
DPPO_LOSS_TYPES: tuple[str, ...] = ("dppo_tv", "dppo_kl")
"""The ``loss_type`` values of DPPO's divergence trust region (:mod:`~lightning_offpolicy.correction.dppo`)."""
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


VERL_GEO_LOW = 1.0 / 1.001
"""verl's default geometric bounds ``0.999_1.001`` bound ``pi_rollout / pi_old``; on the kit's
``pi_prox / pi_rollout`` (or ``pi_theta / pi_rollout`` in bypass mode) they are ``[1/1.001, 1/0.999]``."""
VERL_GEO_HIGH = 1.0 / 0.999


class CorrectionConfigError(ValueError):
    """Raised for an invalid correction or loss setting; the message names the setting."""


def _check_choice(owner: str, name: str, value: Any, literal: Any, *, optional: bool = False) -> None:
    allowed = get_args(literal)
    if value is None and optional:
        return
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed) + (", None" if optional else "")
        raise CorrectionConfigError(f"{owner}.{name}={value!r} is not a known choice; allowed: {shown}.")


def _check_positive(owner: str, name: str, value: float | None, *, optional: bool = False) -> None:
    if value is None:
        if optional:
            return
        raise CorrectionConfigError(f"{owner}.{name} is required here; set it to a positive number.")
    if not is_number(value) or value <= 0:
        raise CorrectionConfigError(f"{owner}.{name}={value!r} must be a positive finite number.")


def _check_bounds(owner: str, low_name: str, low: float | None, high_name: str, high: float | None) -> None:
    _check_positive(owner, low_name, low, optional=True)
    _check_positive(owner, high_name, high, optional=True)
    if low is not None and high is not None and low > high:
        raise CorrectionConfigError(
            f"{owner}.{low_name}={low!r} is greater than {owner}.{high_name}={high!r}; "
            f"the lower bound must not exceed the upper bound."
        )


@dataclass
class OffPolicyCorrectionConfig:
    """How to correct for the gap between the rollout engine and the trainer.

    ``log_rho_t = prox_logprobs_t - rollout_logprobs_t``; ``rho_t = exp(log_rho_t)`` computed from
    log space clamped to [-20, 20]. Start from a preset (``OffPolicyCorrectionConfig.token_tis()``,
    ``geo_mis()``, ...) rather than from the fields.

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
        use_tis: Deprecated spelling of ``tis_level="token"``.
        tis_imp_ratio_cap: Deprecated spelling of ``tis_clip_high``.
        rollout_is: verl's name (``algorithm.rollout_correction``): ``tis_level``.
        rollout_is_threshold: verl's name: ``tis_clip_high``, or ``"low_high"`` for IcePop.
        rollout_is_batch_normalize: verl's name: ``normalize_weights``.
        rollout_rs: verl's name: ``kl_reject`` / ``kl_reject_level`` (k2, k3 modes; k1 modes are
            refused with the kit's equivalent mask).
        rollout_rs_threshold: verl's name: ``kl_reject_threshold``.
        loss_type: verl's bypass-mode loss: ``"ppo_clip"`` or ``"reinforce"`` (``objective``).
        tis_ratio_type: SkyRL's name (``algorithm.off_policy_correction``): ``tis_level``.
        token_tis_ratio_clip_high: SkyRL's name: ``tis_clip_high`` at token level.
        sequence_tis_ratio_clip_high: SkyRL's name: ``tis_clip_high`` at sequence level.
        sequence_mask_metric: SkyRL's name: ``"geometric"`` (``geo_mask``) or ``"product"``.
        outlier_token_is_threshold_low: SkyRL's name: ``outlier_token_veto`` and ``outlier_low``.
        outlier_token_is_threshold_high: SkyRL's name: ``outlier_token_veto`` and ``outlier_high``.
        token_mask_is_threshold_low: SkyRL's name: ``token_mask`` and ``token_mask_low``.
        token_mask_is_threshold_high: SkyRL's name: ``token_mask`` and ``token_mask_high``.
        vllm_importance_sampling_correction: TRL's ``GRPOConfig`` name: turns its mode on.
        vllm_importance_sampling_mode: TRL's name: ``token_truncate`` / ``sequence_truncate`` (TIS),
            ``token_mask`` / ``sequence_mask`` (a mask plus TIS at the upper bound).
        vllm_importance_sampling_clip_max: TRL's name: the upper bound (TRL's default 3.0; ``None``: no
            upper bound, as in TRL: a mask open above, an uncapped weight ``tis_clip_high=inf``).
        vllm_importance_sampling_clip_min: TRL's name: the lower bound.
        vllm_importance_sampling_cap: TRL's former name of ``vllm_importance_sampling_clip_max``.
        m2_threshold: AReaL's name (``actor.m2_threshold``): ``m2po_mask`` with ``m2po_threshold``.
        off_policy_mask_threshold: TRL's name: ``opsm_mask`` with ``opsm_threshold`` and
            ``opsm_reference="rollout"``.
        use_opsm: slime's name (``--use-opsm``): ``opsm_mask`` with ``opsm_reference="prox"``.
        opsm_delta: slime's name (``--opsm-delta``, read with ``use_opsm``; 1e-4 when not given):
            ``opsm_threshold``.
        prox_logp_method: AReaL's name (``actor.prox_logp_method``): ``"loglinear"`` is
            ``prox_method="loglinear"``; ``"recompute"`` and ``"metrics"`` (which trains as
            ``"recompute"``) are ``prox_method="recompute"``.

    Peer names are mapped to the kit's fields when the config is built (one
    :class:`~lightning_offpolicy.correction.peer_names.PeerNameWarning` per key) and read their
    "not given" value afterwards (``None``; 3.0 for ``vllm_importance_sampling_clip_max``); settings
    whose meaning differs are refused with the kit's equivalent
    (:mod:`~lightning_offpolicy.correction.peer_names`).
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
    # Deprecated spellings (SkyRL's former flags), mapped in __post_init__.
    use_tis: bool | None = None
    tis_imp_ratio_cap: float | None = None
    # The peers' names (verl, SkyRL, TRL, slime, AReaL), mapped in __post_init__.
    rollout_is: str | None = None
    rollout_is_threshold: float | str | None = None
    rollout_is_batch_normalize: bool | None = None
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    loss_type: str | None = None
    tis_ratio_type: str | None = None
    token_tis_ratio_clip_high: float | None = None
    sequence_tis_ratio_clip_high: float | None = None
    sequence_mask_metric: str | None = None
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None
    vllm_importance_sampling_correction: bool | None = None
    vllm_importance_sampling_mode: str | None = None
    vllm_importance_sampling_clip_max: float | None = TRL_CLIP_MAX  # None is TRL's "no upper bound"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None
    m2_threshold: float | None = None
    off_policy_mask_threshold: float | None = None
    use_opsm: bool | None = None
    opsm_delta: float | None = None
    prox_logp_method: str | None = None

    def __post_init__(self) -> None:
        self._map_deprecated()
        self._map_peer_names()
        self.validate()

    def _map_peer_names(self) -> None:
        values = {name: getattr(self, name) for name in PEER_OF}
        if all(value == PEER_DEFAULTS[name] for name, value in values.items()):
            return
        try:
            translation = translate(values, bypass_mode=self.bypass_mode)
        except PeerNameError as err:
            raise CorrectionConfigError(str(err)) from None
        _apply_peer_translation(self, translation, "OffPolicyCorrectionConfig")
        # Back to "not given": a copy (replace) or a config built from this one maps nothing again.
        for name in PEER_OF:
            setattr(self, name, PEER_DEFAULTS[name])

    def _map_deprecated(self) -> None:
        if self.use_tis is None and self.tis_imp_ratio_cap is None:
            return
        warnings.warn(
            "OffPolicyCorrectionConfig.use_tis / tis_imp_ratio_cap are deprecated; use "
            "tis_level='token' and tis_clip_high=<cap> (or the token_tis() preset).",
            DeprecationWarning,
            stacklevel=4,
        )
        if self.use_tis:
            if self.tis_level not in (None, "token"):
                raise CorrectionConfigError(
                    f"OffPolicyCorrectionConfig.use_tis=True conflicts with tis_level={self.tis_level!r}; "
                    "drop the deprecated use_tis."
                )
            self.tis_level = "token"
        if self.tis_imp_ratio_cap is not None:
            self.tis_clip_high = self.tis_imp_ratio_cap
        self.use_tis = None
        self.tis_imp_ratio_cap = None

    def validate(self) -> None:
        """Check every setting and their combinations; raise :class:`CorrectionConfigError`."""
        own = "OffPolicyCorrectionConfig"
        _check_choice(own, "prox_method", self.prox_method, ProxMethod)
        _check_choice(own, "tis_level", self.tis_level, TISLevel, optional=True)
        _check_choice(own, "objective", self.objective, Objective)
        _check_choice(own, "objective_level", self.objective_level, TISLevel)
        _check_choice(own, "anchor", self.anchor, Anchor)
        _check_choice(own, "kl_reject", self.kl_reject, RejectEstimator, optional=True)
        _check_choice(own, "kl_reject_level", self.kl_reject_level, RejectLevel)
        if self.tis_level is not None:
            if self.tis_clip_high is None:
                raise CorrectionConfigError(
                    f"{own}.tis_level={self.tis_level!r} needs tis_clip_high (the TIS cap, e.g. 2.0)."
                )
            # inf is "no cap" (TRL's vllm_importance_sampling_clip_max=None); any other value is checked.
            uncapped = is_real(self.tis_clip_high) and self.tis_clip_high == math.inf
            high = None if uncapped else self.tis_clip_high
            _check_bounds(own, "tis_clip_low", self.tis_clip_low, "tis_clip_high", high)
        elif self.tis_clip_low is not None or self.normalize_weights:
            setting = "tis_clip_low" if self.tis_clip_low is not None else "normalize_weights"
            raise CorrectionConfigError(
                f"{own}.{setting} has no effect without tis_level; set tis_level='token' or 'sequence'."
            )
        if self.prox_method == "loglinear":
            self._validate_loglinear(own)
        if self.token_mask:
            _check_bounds(own, "token_mask_low", self.token_mask_low, "token_mask_high", self.token_mask_high)
        if self.geo_mask:
            _check_bounds(own, "geo_mask_low", self.geo_mask_low, "geo_mask_high", self.geo_mask_high)
        if self.product_mask:
            _check_bounds(own, "product_mask_low", self.product_mask_low, "product_mask_high", self.product_mask_high)
        if self.outlier_token_veto:
            _check_bounds(own, "outlier_low", self.outlier_low, "outlier_high", self.outlier_high)
        if self.kl_reject is not None and self.kl_reject_threshold is None:
            raise CorrectionConfigError(
                f"{own}.kl_reject={self.kl_reject!r} needs kl_reject_threshold (reject where the "
                f"{self.kl_reject} statistic exceeds it, e.g. 0.01)."
            )
        _check_positive(own, "kl_reject_threshold", self.kl_reject_threshold, optional=True)
        if self.m2po_mask:
            _check_positive(own, "m2po_threshold", self.m2po_threshold)
            if self.bypass_mode:
                # Bypass mode has no pi_prox: its masks read pi_theta / pi_rollout per micro-batch.
                raise CorrectionConfigError(
                    f"{own}.m2po_mask=True bounds the second moment of log(pi_prox / pi_rollout) over the batch, "
                    "and bypass_mode=True has no pi_prox (AReaL's M2PO needs its recomputed proximal log-probs): "
                    "set bypass_mode=False, or drop m2po_mask."
                )
        _check_choice(own, "opsm_reference", self.opsm_reference, Anchor)
        if self.opsm_mask:
            _check_positive(own, "opsm_threshold", self.opsm_threshold)
        if self.objective in ("pure_is", "cispo"):
            if self.is_clip_high is None:
                raise CorrectionConfigError(
                    f"{own}.objective={self.objective!r} needs is_clip_high (the weight's upper clip)."
                )
            _check_bounds(own, "is_clip_low", self.is_clip_low, "is_clip_high", self.is_clip_high)
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
        """Plain dict of the non-deprecated fields (for hyperparameter logging and YAML)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _DEPRECATED}

    def replace(self, **changes: Any) -> OffPolicyCorrectionConfig:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)

    # ----------------------------------------------------------------------------------- presets
    @classmethod
    def disabled(cls) -> OffPolicyCorrectionConfig:
        """No weight and no mask: plain decoupled PPO; the mismatch metrics are still reported."""
        return cls()

    @classmethod
    def token_tis(cls, clip_high: float = 2.0, clip_low: float | None = None) -> OffPolicyCorrectionConfig:
        """Token-level truncated IS ``w_t = min(rho_t, clip_high)`` (the TIS blog's recipe)."""
        return cls(tis_level="token", tis_clip_high=clip_high, tis_clip_low=clip_low)

    @classmethod
    def seq_tis(cls, clip_high: float = 2.0, clip_low: float | None = None) -> OffPolicyCorrectionConfig:
        """Sequence-level truncated IS ``w_i = min(prod_t rho_t, clip_high)``."""
        return cls(tis_level="sequence", tis_clip_high=clip_high, tis_clip_low=clip_low)

    @classmethod
    def token_mis(cls, low: float = 0.5, high: float = 2.0) -> OffPolicyCorrectionConfig:
        """Token-level masked IS (IcePop): drop tokens with ``rho_t`` outside ``[low, high]``."""
        return cls(token_mask=True, token_mask_low=low, token_mask_high=high)

    @classmethod
    def seq_mis(cls, low: float = 0.5, high: float = 2.0) -> OffPolicyCorrectionConfig:
        """Sequence masked IS: drop sequences whose product ratio is outside ``[low, high]``."""
        return cls(product_mask=True, product_mask_low=low, product_mask_high=high)

    @classmethod
    def geo_mis(cls, low: float = 0.99, high: float = 1.01) -> OffPolicyCorrectionConfig:
        """Geometric masked IS: drop sequences whose geometric-mean ratio is outside ``[low, high]``."""
        return cls(geo_mask=True, geo_mask_low=low, geo_mask_high=high)

    geo_rs = geo_mis

    @classmethod
    def geo_mis_token_tis(
        cls, low: float = 0.99, high: float = 1.01, clip_high: float = 2.0
    ) -> OffPolicyCorrectionConfig:
        """Geometric sequence mask plus token-level TIS on the kept sequences."""
        return cls(geo_mask=True, geo_mask_low=low, geo_mask_high=high, tis_level="token", tis_clip_high=clip_high)

    @classmethod
    def geo_mis_seq_tis(
        cls, low: float = 0.99, high: float = 1.01, clip_high: float = 2.0
    ) -> OffPolicyCorrectionConfig:
        """Geometric sequence mask plus sequence-level TIS on the kept sequences."""
        return cls(geo_mask=True, geo_mask_low=low, geo_mask_high=high, tis_level="sequence", tis_clip_high=clip_high)

    seq_tis_geo_rs = geo_mis_seq_tis

    @classmethod
    def seq_mis_token_tis(
        cls, low: float = 0.5, high: float = 2.0, clip_high: float = 2.0
    ) -> OffPolicyCorrectionConfig:
        """Product sequence mask plus token-level TIS on the kept sequences."""
        return cls(
            product_mask=True,
            product_mask_low=low,
            product_mask_high=high,
            tis_level="token",
            tis_clip_high=clip_high,
        )

    @classmethod
    def outlier_veto(cls, low: float = 1e-4, high: float = 100.0) -> OffPolicyCorrectionConfig:
        """Drop whole sequences containing a token with ``rho_t`` outside ``[low, high]``."""
        return cls(outlier_token_veto=True, outlier_low=low, outlier_high=high)

    @classmethod
    def decoupled_k3_rs(cls, threshold: float = 0.01, level: RejectLevel = "seq_mean") -> OffPolicyCorrectionConfig:
        """verl's k3 rejection: drop sequences whose mean k3 (``rho - 1 - log rho``) exceeds ``threshold``."""
        return cls(kl_reject="k3", kl_reject_level=level, kl_reject_threshold=threshold)

    @classmethod
    def bypass(cls) -> OffPolicyCorrectionConfig:
        """``pi_prox := pi_rollout``: PPO clips against the engine, no proximal forward pass."""
        return cls(bypass_mode=True)

    @classmethod
    def pure_is(
        cls, clip_high: float = 2.0, clip_low: float | None = None, level: TISLevel = "token"
    ) -> OffPolicyCorrectionConfig:
        """Off-policy REINFORCE: ``L = -sg(min(pi_theta / pi_rollout, C)) A log pi_theta``, no PPO clip."""
        return cls(
            bypass_mode=True,
            objective="pure_is",
            objective_level=level,
            is_clip_high=clip_high,
            is_clip_low=clip_low,
        )

    @classmethod
    def bypass_ppo_clip_geo_rs(
        cls, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH
    ) -> OffPolicyCorrectionConfig:
        """verl's ``bypass_ppo_clip_geo_rs``: PPO clipped on ``pi_theta / pi_rollout``, sequences
        whose geometric-mean ``pi_theta / pi_rollout`` leaves ``[low, high]`` rejected (the default:
        verl's ``0.999_1.001`` on ``pi_rollout / pi_theta``, as the kit's ratio)."""
        return cls(bypass_mode=True, geo_mask=True, geo_mask_low=low, geo_mask_high=high)

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, threshold: float = 0.01) -> OffPolicyCorrectionConfig:
        """verl's ``bypass_ppo_clip_k3_rs``: PPO clipped on ``pi_theta / pi_rollout``, sequences whose
        mean k3 of that ratio exceeds ``threshold`` rejected."""
        return cls(bypass_mode=True, kl_reject="k3", kl_reject_level="seq_mean", kl_reject_threshold=threshold)

    @classmethod
    def bypass_pg_token_icepop(cls, low: float = 0.5, high: float = 5.0) -> OffPolicyCorrectionConfig:
        """verl's ``bypass_pg_token_icepop``: REINFORCE weighted by ``pi_theta / pi_rollout`` per token,
        tokens whose ratio leaves ``[low, high]`` rejected (IcePop)."""
        return cls(
            bypass_mode=True,
            objective="pure_is",
            is_clip_high=high,
            token_mask=True,
            token_mask_low=low,
            token_mask_high=high,
        )

    @classmethod
    def bypass_pg_geo_rs(cls, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH) -> OffPolicyCorrectionConfig:
        """verl's ``bypass_pg_geo_rs``: REINFORCE ``-A log pi_theta`` with no weight, geometric
        sequence rejection on ``pi_theta / pi_rollout``."""
        return cls(bypass_mode=True, objective="reinforce", geo_mask=True, geo_mask_low=low, geo_mask_high=high)

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, clip_high: float = 2.0, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH
    ) -> OffPolicyCorrectionConfig:
        """verl's ``bypass_pg_geo_rs_seq_tis``: REINFORCE weighted by the truncated sequence ratio
        ``min(prod_t pi_theta / pi_rollout, clip_high)``, with geometric sequence rejection."""
        return cls(
            bypass_mode=True,
            objective="pure_is",
            objective_level="sequence",
            is_clip_high=clip_high,
            geo_mask=True,
            geo_mask_low=low,
            geo_mask_high=high,
        )

    @classmethod
    def bypass_pg_geo_rs_token_tis(
        cls, clip_high: float = 2.0, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH
    ) -> OffPolicyCorrectionConfig:
        """verl's ``bypass_pg_geo_rs_token_tis``: REINFORCE weighted by the truncated token ratio,
        with geometric sequence rejection."""
        return cls(
            bypass_mode=True,
            objective="pure_is",
            is_clip_high=clip_high,
            geo_mask=True,
            geo_mask_low=low,
            geo_mask_high=high,
        )

    @classmethod
    def cispo(
        cls, clip_high: float = 2.0, clip_low: float | None = None, anchor: Anchor = "rollout"
    ) -> OffPolicyCorrectionConfig:
        """CISPO: ``L = -sg(clip(pi_theta / pi_anchor, low, high)) A log pi_theta`` (seed slime-2084)."""
        return cls(objective="cispo", anchor=anchor, is_clip_high=clip_high, is_clip_low=clip_low)

    @classmethod
    def opsm(cls, threshold: float = 0.5, reference: Anchor = "rollout") -> OffPolicyCorrectionConfig:
        """Off-policy sequence masking (DeepSeek-V3.2; TRL ``off_policy_mask_threshold``, slime ``--use-opsm``).

        The loss drops the negative-advantage tokens of every sequence whose mean log ratio
        ``log pi_reference - log pi_theta`` over its response tokens exceeds ``threshold``.

        Args:
            threshold: The bound on that mean (TRL's suggested start; slime's default is 1e-4).
            reference: ``"rollout"`` (the engine: DeepSeek-V3.2, TRL) or ``"prox"`` (slime's
                recomputed old policy).

        Returns:
            The config; every other field keeps its default.
        """
        return cls(opsm_mask=True, opsm_threshold=threshold, opsm_reference=reference)

    @classmethod
    def m2po(cls, threshold: float = 0.04) -> OffPolicyCorrectionConfig:
        """M2PO (AReaL ``m2_threshold``): reject the tokens with the largest ``log_rho^2`` until the
        mean ``log_rho^2`` of the batch's other response tokens is below ``threshold``."""
        return cls(m2po_mask=True, m2po_threshold=threshold)


_DEPRECATED = ("use_tis", "tis_imp_ratio_cap", *PEER_OF)
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

PRESETS: dict[str, Any] = {
    "disabled": OffPolicyCorrectionConfig.disabled,
    "token_tis": OffPolicyCorrectionConfig.token_tis,
    "seq_tis": OffPolicyCorrectionConfig.seq_tis,
    "token_mis": OffPolicyCorrectionConfig.token_mis,
    "seq_mis": OffPolicyCorrectionConfig.seq_mis,
    "geo_mis": OffPolicyCorrectionConfig.geo_mis,
    "geo_rs": OffPolicyCorrectionConfig.geo_mis,
    "geo_mis_token_tis": OffPolicyCorrectionConfig.geo_mis_token_tis,
    "geo_mis_seq_tis": OffPolicyCorrectionConfig.geo_mis_seq_tis,
    "seq_tis_geo_rs": OffPolicyCorrectionConfig.geo_mis_seq_tis,
    "seq_mis_token_tis": OffPolicyCorrectionConfig.seq_mis_token_tis,
    "outlier_veto": OffPolicyCorrectionConfig.outlier_veto,
    "decoupled_k3_rs": OffPolicyCorrectionConfig.decoupled_k3_rs,
    "bypass": OffPolicyCorrectionConfig.bypass,
    "pure_is": OffPolicyCorrectionConfig.pure_is,
    "cispo": OffPolicyCorrectionConfig.cispo,
    "bypass_ppo_clip_geo_rs": OffPolicyCorrectionConfig.bypass_ppo_clip_geo_rs,
    "bypass_ppo_clip_k3_rs": OffPolicyCorrectionConfig.bypass_ppo_clip_k3_rs,
    "bypass_pg_token_icepop": OffPolicyCorrectionConfig.bypass_pg_token_icepop,
    "bypass_pg_geo_rs": OffPolicyCorrectionConfig.bypass_pg_geo_rs,
    "bypass_pg_geo_rs_seq_tis": OffPolicyCorrectionConfig.bypass_pg_geo_rs_seq_tis,
    "bypass_pg_geo_rs_token_tis": OffPolicyCorrectionConfig.bypass_pg_geo_rs_token_tis,
    "opsm": OffPolicyCorrectionConfig.opsm,
    "m2po": OffPolicyCorrectionConfig.m2po,
}
"""Every preset by name (what :func:`preset` accepts)."""


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
        loss_mode: verl's name (``actor.policy_loss.loss_mode``): ``"vanilla"`` (PPO, dual clip
            at ``clip_ratio_c``), ``"dppo_tv"`` or ``"dppo_kl"``.
        clip_ratio: verl's fallback clip, refused: verl reads it only where ``clip_ratio_low`` /
            ``clip_ratio_high`` are null, and they default to 0.2.
        clip_ratio_low: verl's name: ``eps_clip_low`` (vanilla) or ``dppo_delta_low`` (DPPO).
        clip_ratio_high: verl's name: ``eps_clip_high`` (vanilla) or ``dppo_delta_high`` (DPPO).
        clip_ratio_c: verl's name: ``dual_clip`` (vanilla) or ``dppo_ratio_cap`` (DPPO); default 3.0.
        policy_loss_type: SkyRL's name (``trainer.algorithm.policy_loss_type``): ``"regular"``
            (``loss_type="ppo"``) or ``"dppo"``.
        dppo_type: SkyRL's name (``algorithm.dppo.dppo_type``): ``"binary_tv"`` or ``"binary_kl"``.
        delta_low: SkyRL's name (``algorithm.dppo.delta_low``): ``dppo_delta_low``.
        delta_high: SkyRL's name (``algorithm.dppo.delta_high``): ``dppo_delta_high``.
        dppo_mask_low: prime-rl's name (``[trainer.loss]``, ``type = "default"``): ``dppo_delta_low``
            of ``dppo_tv``.
        dppo_mask_high: prime-rl's name: ``dppo_delta_high`` of ``dppo_tv``.
        kl_tau: prime-rl's name: the coefficient of its squared log ratio to ``pi_rollout``,
            ``rollout_kl_coef = 2 * kl_tau`` with ``rollout_kl_estimator="k2"`` (default 1e-3).
        adv_tau: prime-rl's advantage scale; only 1.0 is accepted (scale the advantages instead).

    Peer names are mapped to the kit's fields when the config is built (one
    :class:`~lightning_offpolicy.correction.peer_names.PeerNameWarning` per peer, naming the kit's
    settings) and read ``None`` afterwards; one peer's names per config
    (:func:`~lightning_offpolicy.correction.peer_names.translate_loss`).
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
    # The peers' names (verl, SkyRL, prime-rl), mapped in __post_init__.
    loss_mode: str | None = None
    clip_ratio: float | None = None
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    policy_loss_type: str | None = None
    dppo_type: str | None = None
    delta_low: float | None = None
    delta_high: float | None = None
    dppo_mask_low: float | None = None
    dppo_mask_high: float | None = None
    kl_tau: float | None = None
    adv_tau: float | None = None

    def __post_init__(self) -> None:
        self._map_peer_names()
        self.validate()

    def _map_peer_names(self) -> None:
        values = {name: getattr(self, name) for name in LOSS_PEER_OF}
        if all(value is None for value in values.values()):
            return
        try:
            translation = translate_loss(values)
        except PeerNameError as err:
            raise CorrectionConfigError(str(err)) from None
        _apply_peer_translation(self, translation, "PolicyLossConfig")
        for name in LOSS_PEER_OF:
            setattr(self, name, None)

    def validate(self) -> None:
        """Check every setting; raise :class:`CorrectionConfigError`."""
        own = "PolicyLossConfig"
        _check_choice(own, "loss_type", self.loss_type, LossType)
        _check_choice(own, "aggregation", self.aggregation, Aggregation)
        _check_choice(own, "rollout_kl_estimator", self.rollout_kl_estimator, KLEstimator)
        _check_choice(own, "ref_kl_estimator", self.ref_kl_estimator, KLEstimator)
        _check_positive(own, "eps_clip_low", self.eps_clip_low)
        _check_positive(own, "eps_clip_high", self.eps_clip_high)
        if self.eps_clip_low >= 1:
            raise CorrectionConfigError(
                f"{own}.eps_clip_low={self.eps_clip_low!r} must be below 1 (the ratio floor is 1 - eps_clip_low)."
            )
        if self.dual_clip is not None and (not math.isfinite(self.dual_clip) or self.dual_clip <= 1):
            raise CorrectionConfigError(f"{own}.dual_clip={self.dual_clip!r} must be greater than 1, or None.")
        _check_positive(own, "tau_pos", self.tau_pos)
        _check_positive(own, "tau_neg", self.tau_neg)
        _check_positive(own, "loss_norm_constant", self.loss_norm_constant, optional=True)
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
        _check_positive(own, "dppo_ratio_cap", self.dppo_ratio_cap, optional=True)
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


def check_compatible(correction: OffPolicyCorrectionConfig, loss: PolicyLossConfig) -> None:
    """Refuse combinations of a correction and a loss that cannot both apply."""
    check_objective_compatible(correction.objective, loss)


def check_objective_compatible(objective: Objective, loss: PolicyLossConfig) -> None:
    """Refuse a ``loss.loss_type`` other than ``"ppo"`` with an ``objective`` that replaces the surrogate."""
    if objective != "ppo" and loss.loss_type != "ppo":
        raise CorrectionConfigError(
            f"OffPolicyCorrectionConfig.objective={objective!r} replaces the surrogate, so "
            f"PolicyLossConfig.loss_type={loss.loss_type!r} cannot apply; set loss_type='ppo'."
        )


def preset(name: str, **kwargs: Any) -> OffPolicyCorrectionConfig:
    """Build a preset by name, e.g. ``preset("geo_mis", low=0.98)``."""
    if name not in PRESETS:
        raise CorrectionConfigError(unknown_preset_message(name))
    return PRESETS[name](**kwargs)


def unknown_preset_message(name: Any, setting: str = "correction preset") -> str:
    """``Unknown correction preset 'x'. Did you mean 'y'? Known presets: ...`` (close matches by ``difflib``)."""
    import difflib

    text = str(name)
    close = difflib.get_close_matches(text.lower().replace("-", "_"), sorted(PRESETS), n=3, cutoff=0.6)
    hint = ""
    if close:
        also = f" (or {', '.join(repr(c) for c in close[1:])})" if close[1:] else ""
        hint = f" Did you mean {close[0]!r}{also}?"
    return f"Unknown {setting} {text!r}.{hint} Known presets: {', '.join(sorted(PRESETS))}."


# Checkpoints keep both configs in their hyperparameters. Registered here, next to the classes, so
# that every `torch.load(weights_only=True)` that can name them rebuilds them: Lightning's resume and
# `load_from_checkpoint` included, which load before any module hook runs.
torch.serialization.add_safe_globals([OffPolicyCorrectionConfig, PolicyLossConfig])


def _apply_peer_translation(config: Any, translation: Any, who: str) -> None:
    """Set the fields a peer-name translation maps to on ``config`` and warn its messages.

    Raises:
        CorrectionConfigError: a field the caller set (not at its default) differs from the value a
            peer setting maps to.
    """
    defaults = {f.name: f.default for f in fields(config)}
    for name, value in translation.settings.items():
        current = getattr(config, name)
        if current != defaults[name] and current != value:
            raise CorrectionConfigError(
                f"{who}.{name}={current!r} conflicts with the peer setting that maps to {name}={value!r}; "
                "give one of them."
            )
        setattr(config, name, value)
    for message in translation.messages:
        warnings.warn(message, PeerNameWarning, stacklevel=5)
