"""The correction presets: each one's values live here, and only here (docs/off_policy_correction.md, section 1).

:class:`CorrectionPresets` is the base class of
:class:`~lightning_offpolicy.correction.OffPolicyCorrectionConfig`, so every preset is a classmethod
of the config (``OffPolicyCorrectionConfig.token_tis()``); :data:`PRESET_METHODS` names them for
``preset(name)``, the CLI's ``--model.correction=token_tis`` and the shipped YAML files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_offpolicy.correction.validation import Anchor, RejectLevel, TISLevel

if TYPE_CHECKING:  # typing.Self is Python >= 3.11; the annotations are never evaluated at run time
    from typing_extensions import Self

VERL_GEO_LOW = 1.0 / 1.001
"""verl's default geometric bounds ``0.999_1.001`` bound ``pi_rollout / pi_old``; on the kit's
``pi_prox / pi_rollout`` (or ``pi_theta / pi_rollout`` in bypass mode) they are ``[1/1.001, 1/0.999]``."""
VERL_GEO_HIGH = 1.0 / 0.999


@dataclass
class CorrectionPresets:
    """The presets, as classmethods that build the config class they are called on.

    A dataclass without fields: a config class built on it stays a pure dataclass, which
    LightningCLI (jsonargparse) exposes field by field.
    """

    @classmethod
    def disabled(cls) -> Self:
        """No weight and no mask: plain decoupled PPO; the mismatch metrics are still reported."""
        return cls()

    @classmethod
    def token_tis(cls, clip_high: float = 2.0, clip_low: float | None = None) -> Self:
        """Token-level truncated IS ``w_t = min(rho_t, clip_high)`` (the TIS blog's recipe)."""
        return cls(tis_level="token", tis_clip_high=clip_high, tis_clip_low=clip_low)

    @classmethod
    def seq_tis(cls, clip_high: float = 2.0, clip_low: float | None = None) -> Self:
        """Sequence-level truncated IS ``w_i = min(prod_t rho_t, clip_high)``."""
        return cls(tis_level="sequence", tis_clip_high=clip_high, tis_clip_low=clip_low)

    @classmethod
    def token_mis(cls, low: float = 0.5, high: float = 2.0) -> Self:
        """Token-level masked IS (IcePop): drop tokens with ``rho_t`` outside ``[low, high]``."""
        return cls(token_mask=True, token_mask_low=low, token_mask_high=high)

    @classmethod
    def seq_mis(cls, low: float = 0.5, high: float = 2.0) -> Self:
        """Sequence masked IS: drop sequences whose product ratio is outside ``[low, high]``."""
        return cls(product_mask=True, product_mask_low=low, product_mask_high=high)

    @classmethod
    def geo_mis(cls, low: float = 0.99, high: float = 1.01) -> Self:
        """Geometric masked IS: drop sequences whose geometric-mean ratio is outside ``[low, high]``."""
        return cls(geo_mask=True, geo_mask_low=low, geo_mask_high=high)

    geo_rs = geo_mis

    @classmethod
    def geo_mis_token_tis(cls, low: float = 0.99, high: float = 1.01, clip_high: float = 2.0) -> Self:
        """Geometric sequence mask plus token-level TIS on the kept sequences."""
        return cls(geo_mask=True, geo_mask_low=low, geo_mask_high=high, tis_level="token", tis_clip_high=clip_high)

    @classmethod
    def geo_mis_seq_tis(cls, low: float = 0.99, high: float = 1.01, clip_high: float = 2.0) -> Self:
        """Geometric sequence mask plus sequence-level TIS on the kept sequences."""
        return cls(geo_mask=True, geo_mask_low=low, geo_mask_high=high, tis_level="sequence", tis_clip_high=clip_high)

    seq_tis_geo_rs = geo_mis_seq_tis

    @classmethod
    def seq_mis_token_tis(cls, low: float = 0.5, high: float = 2.0, clip_high: float = 2.0) -> Self:
        """Product sequence mask plus token-level TIS on the kept sequences."""
        return cls(
            product_mask=True,
            product_mask_low=low,
            product_mask_high=high,
            tis_level="token",
            tis_clip_high=clip_high,
        )

    @classmethod
    def outlier_veto(cls, low: float = 1e-4, high: float = 100.0) -> Self:
        """Drop whole sequences containing a token with ``rho_t`` outside ``[low, high]``."""
        return cls(outlier_token_veto=True, outlier_low=low, outlier_high=high)

    @classmethod
    def decoupled_k3_rs(cls, threshold: float = 0.01, level: RejectLevel = "seq_mean") -> Self:
        """verl's k3 rejection: drop sequences whose mean k3 (``rho - 1 - log rho``) exceeds ``threshold``."""
        return cls(kl_reject="k3", kl_reject_level=level, kl_reject_threshold=threshold)

    @classmethod
    def bypass(cls) -> Self:
        """``pi_prox := pi_rollout``: PPO clips against the engine, no proximal forward pass."""
        return cls(bypass_mode=True)

    @classmethod
    def pure_is(cls, clip_high: float = 2.0, clip_low: float | None = None, level: TISLevel = "token") -> Self:
        """Off-policy REINFORCE: ``L = -sg(min(pi_theta / pi_rollout, C)) A log pi_theta``, no PPO clip."""
        return cls(
            bypass_mode=True,
            objective="pure_is",
            objective_level=level,
            is_clip_high=clip_high,
            is_clip_low=clip_low,
        )

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH) -> Self:
        """verl's ``bypass_ppo_clip_geo_rs``: PPO clipped on ``pi_theta / pi_rollout``, sequences
        whose geometric-mean ``pi_theta / pi_rollout`` leaves ``[low, high]`` rejected (the default:
        verl's ``0.999_1.001`` on ``pi_rollout / pi_theta``, as the kit's ratio)."""
        return cls(bypass_mode=True, geo_mask=True, geo_mask_low=low, geo_mask_high=high)

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, threshold: float = 0.01) -> Self:
        """verl's ``bypass_ppo_clip_k3_rs``: PPO clipped on ``pi_theta / pi_rollout``, sequences whose
        mean k3 of that ratio exceeds ``threshold`` rejected."""
        return cls(bypass_mode=True, kl_reject="k3", kl_reject_level="seq_mean", kl_reject_threshold=threshold)

    @classmethod
    def bypass_pg_token_icepop(cls, low: float = 0.5, high: float = 5.0) -> Self:
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
    def bypass_pg_geo_rs(cls, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH) -> Self:
        """verl's ``bypass_pg_geo_rs``: REINFORCE ``-A log pi_theta`` with no weight, geometric
        sequence rejection on ``pi_theta / pi_rollout``."""
        return cls(bypass_mode=True, objective="reinforce", geo_mask=True, geo_mask_low=low, geo_mask_high=high)

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, clip_high: float = 2.0, low: float = VERL_GEO_LOW, high: float = VERL_GEO_HIGH
    ) -> Self:
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
    ) -> Self:
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
    def cispo(cls, clip_high: float = 2.0, clip_low: float | None = None, anchor: Anchor = "rollout") -> Self:
        """CISPO: ``L = -sg(clip(pi_theta / pi_anchor, low, high)) A log pi_theta`` (seed slime-2084)."""
        return cls(objective="cispo", anchor=anchor, is_clip_high=clip_high, is_clip_low=clip_low)

    @classmethod
    def opsm(cls, threshold: float = 0.5, reference: Anchor = "rollout") -> Self:
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
    def m2po(cls, threshold: float = 0.04) -> Self:
        """M2PO (AReaL ``m2_threshold``): reject the tokens with the largest ``log_rho^2`` until the
        mean ``log_rho^2`` of the batch's other response tokens is below ``threshold``."""
        return cls(m2po_mask=True, m2po_threshold=threshold)


PRESET_METHODS: dict[str, str] = {
    "disabled": "disabled",
    "token_tis": "token_tis",
    "seq_tis": "seq_tis",
    "token_mis": "token_mis",
    "seq_mis": "seq_mis",
    "geo_mis": "geo_mis",
    "geo_rs": "geo_mis",
    "geo_mis_token_tis": "geo_mis_token_tis",
    "geo_mis_seq_tis": "geo_mis_seq_tis",
    "seq_tis_geo_rs": "geo_mis_seq_tis",
    "seq_mis_token_tis": "seq_mis_token_tis",
    "outlier_veto": "outlier_veto",
    "decoupled_k3_rs": "decoupled_k3_rs",
    "bypass": "bypass",
    "pure_is": "pure_is",
    "cispo": "cispo",
    "bypass_ppo_clip_geo_rs": "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs": "bypass_ppo_clip_k3_rs",
    "bypass_pg_token_icepop": "bypass_pg_token_icepop",
    "bypass_pg_geo_rs": "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis": "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis": "bypass_pg_geo_rs_token_tis",
    "opsm": "opsm",
    "m2po": "m2po",
}
"""Every preset name (aliases included) and the classmethod of :class:`CorrectionPresets` that builds it."""
