"""The peers' names for the correction settings, mapped to the kit's.

Users arrive with verl's ``algorithm.rollout_correction.*`` keys, SkyRL's
``trainer.algorithm.off_policy_correction.*`` keys, TRL's ``GRPOConfig.vllm_importance_sampling_*``
and ``off_policy_mask_threshold`` arguments, slime's ``--use-opsm`` or AReaL's ``m2_threshold``.
``OffPolicyCorrectionConfig.from_peer_names(...)``
and ``PolicyLossConfig.from_peer_names(...)``
take them; :func:`translate` and :func:`translate_loss` turn them into the kit's fields (one module
per peer in :mod:`~lightning_offpolicy.correction.peers`), with one line per key that says the
kit's name (a :class:`PeerNameWarning`).

Where a peer's setting means something else than the nearest kit setting, it is refused with a
message that says the difference and the kit's equivalent:

* verl's ``*_k1`` rejection modes bound ``pi_rollout / pi_old`` in ratio space; the kit's token,
  geometric and product masks bound ``pi_prox / pi_rollout``. The message gives the kit's bounds
  (the reciprocals, swapped).
* verl's ``rollout_is_batch_normalize`` together with a rejection mode normalises over the batch
  before rejection; the kit over the kept tokens / sequences.
* SkyRL's outlier veto reads every response token, the kit's the tokens the token mask kept.

Where a peer gives a value a meaning of its own, the mapping follows the peer's code:

* SkyRL applies its token mask only when both ``token_mask_is_threshold_low`` and ``_high`` are
  set (``off_policy_correction_enabled``); one of them alone turns no mask on, here either.
* TRL's ``vllm_importance_sampling_clip_max=None`` means "no upper bound": a mask open above and an
  uncapped weight (``tis_clip_high=inf``); left out, it is TRL's default 3.0 (:data:`PEER_DEFAULTS`).

Two peer names outside this mapping compute something else than the kit's namesake: verl's and
SkyRL's KL estimator ``k3`` clamps (``d`` to [-20, 20], the value to [-10, 10]): it is the kit's
``low_var_kl``, not its ``k3``; and verl's PPO loss always applies the dual clip at
``clip_ratio_c`` (3.0): ``PolicyLossConfig(dual_clip=3.0)`` computes verl's loss.

Differences that do not change which setting to use are documented next to the mapping table in
docs/off_policy_correction.md (e.g. the loss denominator keeps rejected tokens in the kit).
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

from lightning_offpolicy.correction.peers.common import PeerNameError, PeerNameWarning, Translation
from lightning_offpolicy.correction.peers.loss import prime_rl_loss, skyrl_loss, verl_loss
from lightning_offpolicy.correction.peers.skyrl import skyrl_correction
from lightning_offpolicy.correction.peers.slime_areal import areal_correction, slime_correction
from lightning_offpolicy.correction.peers.trl import TRL_CLIP_MAX, trl_correction
from lightning_offpolicy.correction.peers.verl import verl_correction
from lightning_offpolicy.correction.validation import CorrectionConfigError

__all__ = [
    "LOSS_PEER_OF",
    "PEER_DEFAULTS",
    "PEER_OF",
    "TRL_CLIP_MAX",
    "PeerNameError",
    "PeerNameWarning",
    "Translation",
    "apply_translation",
    "is_given",
    "split_peer_names",
    "translate",
    "translate_loss",
]

VERL_FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "loss_type",
)
SKYRL_FIELDS = (
    "tis_ratio_type",
    "token_tis_ratio_clip_high",
    "sequence_tis_ratio_clip_high",
    "sequence_mask_metric",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)
TRL_FIELDS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
    "off_policy_mask_threshold",
)
SLIME_FIELDS = ("use_opsm", "opsm_delta")
AREAL_FIELDS = ("prox_logp_method", "m2_threshold")
PEER_OF = {
    **dict.fromkeys(VERL_FIELDS, "verl"),
    **dict.fromkeys(SKYRL_FIELDS, "SkyRL"),
    **dict.fromkeys(TRL_FIELDS, "TRL"),
    **dict.fromkeys(SLIME_FIELDS, "slime"),
    **dict.fromkeys(AREAL_FIELDS, "AReaL"),
}
"""Every accepted peer field and the peer it comes from."""

PEER_DEFAULTS: dict[str, Any] = {**dict.fromkeys(PEER_OF), "vllm_importance_sampling_clip_max": TRL_CLIP_MAX}
"""The value that means "not given" for each peer field: ``None``, except where the peer gives
``None`` a meaning of its own; there the peer's own default."""


def is_given(name: str, value: Any) -> bool:
    """Whether the peer field ``name`` holds a value other than its "not given" default."""
    default = PEER_DEFAULTS[name]
    return value is not None if default is None else (value is None or value != default)


def translate(values: dict[str, Any], bypass_mode: bool = False) -> Translation:
    """The kit's settings for the peer fields in ``values`` (entries at their :data:`PEER_DEFAULTS` are ignored).

    Args:
        values: peer field name -> value (the names of :data:`PEER_OF`); ``None`` means "not given",
            except for ``vllm_importance_sampling_clip_max``, where it is TRL's "no upper bound" and
            :data:`TRL_CLIP_MAX` means "not given".
        bypass_mode: the kit's (and verl's) ``bypass_mode``, which decides what verl's
            ``loss_type`` and ``rollout_is`` mean.

    Raises:
        PeerNameError: fields of two peers mixed, a value the peer does not know, or a setting whose
            meaning differs from the kit's (the message gives the kit's equivalent).
    """
    given = {name: value for name, value in values.items() if is_given(name, value)}
    peers = sorted({PEER_OF[name] for name in given})
    if len(peers) > 1:
        raise PeerNameError(
            f"OffPolicyCorrectionConfig: settings of {' and '.join(peers)} are mixed "
            f"({', '.join(sorted(given))}); use one peer's names, or the kit's."
        )
    if not peers:
        return Translation()
    translators = {
        "verl": verl_correction,
        "SkyRL": skyrl_correction,
        "TRL": trl_correction,
        "slime": slime_correction,
        "AReaL": areal_correction,
    }
    return translators[peers[0]](given, bypass_mode)


VERL_LOSS_FIELDS = ("loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
SKYRL_LOSS_FIELDS = ("policy_loss_type", "dppo_type", "delta_low", "delta_high")
PRIME_RL_LOSS_FIELDS = ("dppo_mask_low", "dppo_mask_high", "kl_tau", "adv_tau")
LOSS_PEER_OF = {
    **dict.fromkeys(VERL_LOSS_FIELDS, "verl"),
    **dict.fromkeys(SKYRL_LOSS_FIELDS, "SkyRL"),
    **dict.fromkeys(PRIME_RL_LOSS_FIELDS, "prime-rl"),
}
"""Every accepted peer field of ``PolicyLossConfig`` and the peer it comes from."""


def translate_loss(values: dict[str, Any]) -> Translation:
    """The kit's ``PolicyLossConfig`` settings for the peer fields in ``values`` (``None`` entries are ignored).

    Args:
        values: peer field name -> value (the names of :data:`LOSS_PEER_OF`).

    Returns:
        The kit's settings and one message per peer (the kit's names, and what differs).

    Raises:
        PeerNameError: fields of two peers mixed, a value the peer does not know, a key the peer
            would ignore, or a setting the kit has no knob for (the message says what to do).
    """
    given = {key: value for key, value in values.items() if value is not None}
    peers = sorted({LOSS_PEER_OF[name] for name in given})
    if len(peers) > 1:
        raise PeerNameError(
            f"PolicyLossConfig: settings of {' and '.join(peers)} are mixed ({', '.join(sorted(given))}); "
            "use one peer's names, or the kit's."
        )
    if not peers:
        return Translation()
    return {"verl": verl_loss, "SkyRL": skyrl_loss, "prime-rl": prime_rl_loss}[peers[0]](given)


def split_peer_names(
    config_class: type, settings: dict[str, Any], peer_of: dict[str, str], removed: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``settings`` split into the fields of ``config_class`` and the peers' keys of ``peer_of``.

    Raises:
        CorrectionConfigError: a key that is neither; the message names it (and, for a key of
            ``removed``, the setting that replaced it).
    """
    owner = config_class.__name__
    own = {f.name for f in fields(config_class)}
    for key in settings:
        if key in own or key in peer_of:
            continue
        if removed and key in removed:
            raise CorrectionConfigError(f"{owner}: {key!r} was removed; use {removed[key]}.")
        raise CorrectionConfigError(
            f"{owner}.from_peer_names: {key!r} is neither a peer's setting nor a field of {owner}; the peers' "
            f"settings: {', '.join(sorted(peer_of))}."
        )
    kit = {key: value for key, value in settings.items() if key in own}
    return kit, {key: value for key, value in settings.items() if key in peer_of}


def apply_translation(config_class: type, kit: dict[str, Any], translation: Translation) -> dict[str, Any]:
    """The constructor arguments of ``config_class``: ``kit`` with the fields ``translation`` maps to, its
    messages warned (one :class:`PeerNameWarning` each).

    Raises:
        CorrectionConfigError: a field of ``kit`` set away from its default differs from the value a peer
            setting maps to.
    """
    owner = config_class.__name__
    defaults = {f.name: f.default for f in fields(config_class)}
    merged = dict(kit)
    for name, value in translation.settings.items():
        current = merged.get(name, defaults[name])
        if current != defaults[name] and current != value:
            raise CorrectionConfigError(
                f"{owner}.{name}={current!r} conflicts with the peer setting that maps to {name}={value!r}; "
                "give one of them."
            )
        merged[name] = value
    for message in translation.messages:
        warnings.warn(message, PeerNameWarning, stacklevel=3)
    return merged
