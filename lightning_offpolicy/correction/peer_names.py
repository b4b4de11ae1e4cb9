"""The peers' names for the correction settings, mapped to the kit's.

Users arrive with verl's ``algorithm.rollout_correction.*`` keys, SkyRL's
``trainer.algorithm.off_policy_correction.*`` keys, TRL's ``GRPOConfig.vllm_importance_sampling_*``
and ``off_policy_mask_threshold`` arguments, slime's ``--use-opsm`` or AReaL's ``m2_threshold``.
:class:`~lightning_offpolicy.correction.OffPolicyCorrectionConfig` accepts them as fields (so a
YAML ``correction:`` block may use them) and :func:`translate` turns them into the kit's fields,
with one line per key that says the kit's name (a :class:`PeerNameWarning`).

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

import math
from dataclasses import dataclass, field
from typing import Any

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
PEER_OF = {
    **dict.fromkeys(VERL_FIELDS, "verl"),
    **dict.fromkeys(SKYRL_FIELDS, "SkyRL"),
    **dict.fromkeys(TRL_FIELDS, "TRL"),
    **dict.fromkeys(SLIME_FIELDS, "slime"),
}
"""Every accepted peer field and the peer it comes from."""

TRL_CLIP_MAX = 3.0
"""TRL's default ``vllm_importance_sampling_clip_max``, whose ``None`` means "no upper bound"."""

PEER_DEFAULTS: dict[str, Any] = {**dict.fromkeys(PEER_OF), "vllm_importance_sampling_clip_max": TRL_CLIP_MAX}
"""The value that means "not given" for each peer field: ``None``, except where the peer gives
``None`` a meaning of its own; there the peer's own default (a config dumped and loaded again keeps
reading "not given")."""


def is_given(name: str, value: Any) -> bool:
    """Whether the peer field ``name`` holds a value other than its "not given" default."""
    default = PEER_DEFAULTS[name]
    return value is not None if default is None else (value is None or value != default)


_KL_LEVELS = {"token": "token", "seq_sum": "seq_sum", "seq_mean": "seq_mean", "seq_max": "seq_max"}
_K1_MASKS = {"token": "token_mask", "seq_sum": "product_mask", "seq_mean": "geo_mask"}


class PeerNameWarning(UserWarning):
    """A peer's setting name was accepted and mapped to the kit's (the message names both)."""


class PeerNameError(ValueError):
    """A peer's setting whose meaning differs from the kit's; the message says how to express it."""


@dataclass
class Translation:
    """The kit's fields for a set of peer fields, and one message per peer key."""

    settings: dict[str, Any] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


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
    translators = {"verl": _verl, "SkyRL": _skyrl, "TRL": _trl, "slime": _slime, "AReaL": _areal}
    return translators[peers[0]](given, bypass_mode)


# ------------------------------------------------------------------------------------------ verl
def _verl(given: dict[str, Any], bypass_mode: bool) -> Translation:
    out = Translation()
    level = given.get("rollout_is")
    if level not in (None, "token", "sequence"):
        raise PeerNameError(f"verl's rollout_is={level!r} is not one of None, 'token', 'sequence'.")
    loss_type = given.get("loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise PeerNameError(f"verl's loss_type={loss_type!r} is not one of 'ppo_clip', 'reinforce'.")
    if loss_type == "reinforce" and not bypass_mode:
        raise PeerNameError(
            "verl reads loss_type='reinforce' only in bypass mode (decoupled mode always uses PPO); "
            "set bypass_mode: true, or drop loss_type."
        )
    rs_modes = _rs_modes(given)
    if given.get("rollout_is_batch_normalize"):
        if rs_modes:
            raise PeerNameError(
                "verl's rollout_is_batch_normalize with rollout_rs normalises the IS weights over the whole batch "
                "before rejection; the kit's normalize_weights normalises over the kept tokens (token level) or "
                "kept sequences (sequence level). Set normalize_weights: true if that is what you want, with the "
                "kit's masks."
            )
        out.settings["normalize_weights"] = True
        out.messages.append("verl's rollout_is_batch_normalize is the kit's normalize_weights.")

    if level is not None:
        low, high = _is_threshold(given.get("rollout_is_threshold", 2.0))
        if bypass_mode and loss_type == "ppo_clip":
            # verl computes these weights in bypass PPO-clip mode for its metrics only.
            out.messages.append(
                f"verl's rollout_is={level!r} is not applied in bypass mode with loss_type='ppo_clip' (the PPO ratio "
                "pi_theta / pi_rollout is the weight; verl only logs it): dropped; the kit's rollout_corr/* metrics "
                "report that ratio."
            )
        elif bypass_mode:  # loss_type == "reinforce": the truncated current-policy weight
            out.settings.update(objective="pure_is", objective_level=level, is_clip_high=high)
            out.messages.append(
                f"verl's bypass loss_type='reinforce' with rollout_is={level!r} is the kit's objective='pure_is', "
                f"objective_level={level!r}, is_clip_high={high!r}."
            )
        else:
            out.settings.update(tis_level=level, tis_clip_high=high)
            out.messages.append(
                f"verl's rollout_is={level!r} is the kit's tis_level={level!r}, tis_clip_high={high!r}."
            )
        if low is not None:  # "lower_upper": IcePop, weights outside the bounds set to zero
            mask = "token_mask" if level == "token" else "product_mask"
            out.settings.update({mask: True, f"{mask}_low": low, f"{mask}_high": high})
            out.messages.append(
                f"verl's rollout_is_threshold='{low}_{high}' (IcePop) is the kit's {mask}: true, "
                f"{mask}_low={low!r}, {mask}_high={high!r}."
            )
    elif loss_type == "reinforce":
        out.settings["objective"] = "reinforce"
        out.messages.append(
            "verl's bypass loss_type='reinforce' without rollout_is is the kit's objective='reinforce'."
        )

    kl_modes = [(mode, threshold) for mode, threshold in rs_modes if not mode.endswith("_k1")]
    for mode, threshold in rs_modes:
        if mode.endswith("_k1"):
            raise PeerNameError(_k1_message(mode, threshold))
    if len(kl_modes) > 1:
        raise PeerNameError(
            f"verl's rollout_rs lists {len(kl_modes)} k2/k3 modes ({', '.join(m for m, _ in kl_modes)}); the kit "
            "has one kl_reject (estimator, level, threshold): keep one, or add a geo_mask / product_mask / token_mask."
        )
    for mode, threshold in kl_modes:
        where, estimator = mode.rsplit("_", 1)
        value = _positive(threshold, f"verl's rollout_rs_threshold for {mode}")
        out.settings.update(kl_reject=estimator, kl_reject_level=_KL_LEVELS[where], kl_reject_threshold=value)
        out.messages.append(
            f"verl's rollout_rs={mode!r} is the kit's kl_reject={estimator!r}, kl_reject_level={where!r}, "
            f"kl_reject_threshold={value!r}."
        )
    return out


def _rs_modes(given: dict[str, Any]) -> list[tuple[str, Any]]:
    """verl's comma-separated rollout_rs modes with their thresholds (one broadcast, or one each)."""
    modes = [m.strip() for m in str(given.get("rollout_rs") or "").split(",") if m.strip()]
    modes = list(dict.fromkeys(modes))
    known = {f"{where}_{est}" for where in _KL_LEVELS for est in ("k1", "k2", "k3")} - {"seq_max_k1"}
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise PeerNameError(
            f"verl's rollout_rs mode(s) {', '.join(unknown)} unknown; verl's: {', '.join(sorted(known))}."
        )
    if not modes:
        return []
    threshold = given.get("rollout_rs_threshold")
    if threshold is None:
        raise PeerNameError(f"verl's rollout_rs={given['rollout_rs']!r} needs rollout_rs_threshold.")
    parts = [p.strip() for p in str(threshold).split(",")] if isinstance(threshold, str) else [threshold]
    if len(parts) == 1:
        parts = parts * len(modes)
    if len(parts) != len(modes):
        raise PeerNameError(
            f"verl's rollout_rs_threshold={threshold!r} gives {len(parts)} values for {len(modes)} modes; give one, "
            "or one per mode."
        )
    return list(zip(modes, parts, strict=True))


def _k1_message(mode: str, threshold: Any) -> str:
    where = mode.rsplit("_", 1)[0]
    low, high = _ratio_bounds(threshold, f"verl's rollout_rs_threshold for {mode}")
    mask = _K1_MASKS[where]
    kit_low, kit_high = 1.0 / high, 1.0 / low
    return (
        f"verl's rollout_rs={mode!r} is a signed k1 test that bounds pi_rollout / pi_old in ratio space "
        f"({'per token' if where == 'token' else 'per sequence, ' + where.replace('seq_', '')}), while the kit's "
        f"{mask} bounds pi_prox / pi_rollout, its reciprocal: the same rejection is {mask}: true, "
        f"{mask}_low: {kit_low!r}, {mask}_high: {kit_high!r} (the reciprocals of verl's bounds, swapped)."
    )


def _ratio_bounds(threshold: Any, what: str) -> tuple[float, float]:
    """verl's ``"lower_upper"`` bounds, or one upper bound whose reciprocal is the lower."""
    if isinstance(threshold, str) and "_" in threshold:
        low_text, high_text = threshold.split("_", 1)
        low, high = _positive(low_text, what), _positive(high_text, what)
    else:
        high = _positive(threshold, what)
        low = 1.0 / high
    if low > high:
        raise PeerNameError(f"{what}: lower bound {low} above upper bound {high}.")
    return low, high


def _is_threshold(threshold: Any) -> tuple[float | None, float]:
    """verl's rollout_is_threshold: a cap (TIS) or ``"lower_upper"`` (IcePop)."""
    if isinstance(threshold, str) and "_" in threshold:
        return _ratio_bounds(threshold, "verl's rollout_is_threshold")
    return None, _positive(threshold, "verl's rollout_is_threshold")


def _positive(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PeerNameError(f"{what}={value!r} is not a number.") from None
    if not math.isfinite(number) or number <= 0:
        raise PeerNameError(f"{what}={value!r} must be a positive finite number.")
    return number


# ----------------------------------------------------------------------------------------- SkyRL
def _skyrl(given: dict[str, Any], bypass_mode: bool) -> Translation:
    out = Translation()
    ratio_type = given.get("tis_ratio_type")
    if ratio_type not in (None, "token", "sequence"):
        raise PeerNameError(f"SkyRL's tis_ratio_type={ratio_type!r} is not one of None, 'token', 'sequence'.")
    if ratio_type is not None:
        # SkyRL's own defaults: 2.0 for tokens, 5.0 for sequences.
        cap_key = f"{ratio_type}_tis_ratio_clip_high"
        cap = _positive(given.get(cap_key, 2.0 if ratio_type == "token" else 5.0), f"SkyRL's {cap_key}")
        out.settings.update(tis_level=ratio_type, tis_clip_high=cap)
        out.messages.append(
            f"SkyRL's tis_ratio_type={ratio_type!r}, {cap_key}={cap!r} is the kit's tis_level={ratio_type!r}, "
            f"tis_clip_high={cap!r}."
        )
    metric = given.get("sequence_mask_metric")
    if metric not in (None, "geometric", "product"):
        raise PeerNameError(f"SkyRL's sequence_mask_metric={metric!r} is not one of None, 'geometric', 'product'.")
    if metric is not None:
        mask = "geo_mask" if metric == "geometric" else "product_mask"
        out.settings[mask] = True
        out.messages.append(
            f"SkyRL's sequence_mask_metric={metric!r} is the kit's {mask}: true "
            f"({mask}_low / {mask}_high: the same names)."
        )
    for prefix, kit, switch in (
        ("outlier_token_is_threshold", "outlier", "outlier_token_veto"),
        ("token_mask_is_threshold", "token_mask", "token_mask"),
    ):
        low, high = given.get(f"{prefix}_low"), given.get(f"{prefix}_high")
        if low is None and high is None:
            continue
        if switch == "token_mask" and (low is None or high is None):
            # SkyRL turns its token mask on only when both bounds are set (off_policy_correction_enabled,
            # compute_off_policy_correction): one bound alone masks nothing there, so nothing here either.
            given_name, missing = (f"{prefix}_low", "high") if high is None else (f"{prefix}_high", "low")
            out.messages.append(
                f"SkyRL's {given_name}={given[given_name]!r} alone turns no mask on: SkyRL applies its token mask "
                f"only when both {prefix}_low and _high are set, so the kit's token_mask stays off. For a one-sided "
                f"mask use the kit's token_mask: true, token_mask_{missing}: null."
            )
            continue
        out.settings.update({switch: True, f"{kit}_low": low, f"{kit}_high": high})
        out.messages.append(
            f"SkyRL's {prefix}_low / _high = {low!r} / {high!r} is the kit's {switch}: true, {kit}_low={low!r}, "
            f"{kit}_high={high!r} (None: that side unbounded)."
        )
    if out.settings.get("outlier_token_veto") and out.settings.get("token_mask"):
        raise PeerNameError(
            "SkyRL's outlier veto reads every response token, before its token mask; the kit's reads the tokens "
            "the token mask kept (an outlier outside the token mask's bounds is removed alone, its sequence stays). "
            "Use one of the two, or the kit's outlier_token_veto / token_mask knowing that order."
        )
    return out


# ------------------------------------------------------------------------------------------- TRL
def _trl(given: dict[str, Any], bypass_mode: bool) -> Translation:
    given = dict(given)
    threshold = given.pop("off_policy_mask_threshold", None)
    # TRL turns its vLLM importance sampling on by default; here a vllm_importance_sampling_* key does.
    out = _trl_importance_sampling(given) if given else Translation()
    if threshold is not None:
        delta = _positive(threshold, "TRL's off_policy_mask_threshold")
        # GRPOTrainer.get_off_policy_mask: KL of the vLLM sampling logprobs to pi_theta (detached).
        out.settings.update(opsm_mask=True, opsm_threshold=delta, opsm_reference="rollout")
        out.messages.append(
            f"TRL's off_policy_mask_threshold={delta!r} is the kit's opsm_mask: true, opsm_threshold={delta!r}, "
            "opsm_reference='rollout' (TRL measures pi_theta against its vLLM sampling logprobs). TRL also applies "
            "vllm_importance_sampling_mode ('sequence_mask' by default) when it generates with vLLM; the kit only "
            "when a vllm_importance_sampling_* key is given."
        )
    return out


def _trl_importance_sampling(given: dict[str, Any]) -> Translation:
    out = Translation()
    if "vllm_importance_sampling_cap" in given:
        if "vllm_importance_sampling_clip_max" in given:
            raise PeerNameError(
                "TRL's vllm_importance_sampling_cap is the old name of vllm_importance_sampling_clip_max; give one."
            )
        given = {**given, "vllm_importance_sampling_clip_max": given.pop("vllm_importance_sampling_cap")}
    if not given.get("vllm_importance_sampling_correction", True):
        out.messages.append("TRL's vllm_importance_sampling_correction=False is the kit's default: no weight, no mask.")
        return out
    mode = given.get("vllm_importance_sampling_mode", "sequence_mask")  # TRL's defaults
    # Absent: TRL's default C_max. Given as None: TRL's "no upper bound" (a mask open above, an
    # uncapped weight), which the kit writes tis_clip_high=inf.
    high = given.get("vllm_importance_sampling_clip_max", TRL_CLIP_MAX)
    low = given.get("vllm_importance_sampling_clip_min")
    if mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        raise PeerNameError(
            f"TRL's vllm_importance_sampling_mode={mode!r} is not one of 'token_truncate', 'token_mask', "
            "'sequence_truncate', 'sequence_mask'."
        )
    level, how = mode.split("_")
    high = None if high is None else _positive(high, "TRL's vllm_importance_sampling_clip_max")
    low = None if low is None else _positive(low, "TRL's vllm_importance_sampling_clip_min")
    # GRPOConfig.__post_init__'s own refusals.
    if low is not None and high is not None and low >= high:
        raise PeerNameError(
            f"TRL's vllm_importance_sampling_clip_min={low!r} must be less than vllm_importance_sampling_clip_max="
            f"{high!r} (TRL refuses it too)."
        )
    if how == "truncate" and low is None and high is None:
        raise PeerNameError(
            f"TRL's vllm_importance_sampling_mode={mode!r} needs vllm_importance_sampling_clip_min or _clip_max "
            "(TRL refuses both None in its *_truncate modes)."
        )
    cap = math.inf if high is None else high
    if how == "truncate":
        out.settings.update(tis_level=level, tis_clip_high=cap, tis_clip_low=low)
        kit = f"tis_level={level!r}, tis_clip_high={cap!r}, tis_clip_low={low!r}"
    else:
        # Ratios outside [min, max] get weight 0, those inside keep the ratio itself as their weight.
        mask = "token_mask" if level == "token" else "product_mask"
        out.settings.update({mask: True, f"{mask}_low": low, f"{mask}_high": high, "tis_level": level})
        out.settings["tis_clip_high"] = cap
        kit = (
            f"{mask}: true, {mask}_low={low!r}, {mask}_high={high!r}, tis_level={level!r}, tis_clip_high={cap!r} "
            "(the kept ratios are the weights)"
        )
    shown = "None (no upper bound)" if high is None else repr(high)
    out.messages.append(
        f"TRL's vllm_importance_sampling_mode={mode!r} (C_min={low!r}, C_max={shown}) is the kit's {kit}."
    )
    return out


# ----------------------------------------------------------------------------------------- slime
def _slime(given: dict[str, Any], bypass_mode: bool) -> Translation:
    out = Translation()
    if not given.get("use_opsm", False):
        # slime reads --opsm-delta only under --use-opsm.
        delta = f" (its opsm_delta={given['opsm_delta']!r} is read only with use_opsm)" if "opsm_delta" in given else ""
        out.messages.append(f"slime's use_opsm off is the kit's default: no OPSM mask{delta}.")
        return out
    delta = _positive(given.get("opsm_delta", 1e-4), "slime's opsm_delta")  # slime's default --opsm-delta
    # slime's compute_opsm_mask compares pi_theta with its old log-probs: the recomputed ones, or the
    # engine's under --use-rollout-logprobs (the kit's bypass mode, where pi_prox is pi_rollout).
    out.settings.update(opsm_mask=True, opsm_threshold=delta, opsm_reference="prox")
    out.messages.append(
        f"slime's use_opsm=True, opsm_delta={delta!r} is the kit's opsm_mask: true, opsm_threshold={delta!r}, "
        "opsm_reference='prox' (slime's old log-probs; with --use-rollout-logprobs they are pi_rollout: the kit's "
        "bypass_mode)."
    )
    return out


# ----------------------------------------------------------------------------- the policy loss
# The peers' names of the policy loss's settings (``PolicyLossConfig``): verl's
# ``actor_rollout_ref.actor.*`` (``policy_loss.loss_mode``, ``clip_ratio_*``), SkyRL's
# ``trainer.algorithm.policy_loss_type`` with its ``algorithm.dppo.*`` block (given flat here), and
# prime-rl's ``[trainer.loss]`` table of ``type = "default"`` (its DPPO + KL loss). Defaults are
# each peer's own: verl's ActorConfig, SkyRL's DPPOConfig, prime-rl's DefaultLossConfig.
VERL_LOSS_FIELDS = ("loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
SKYRL_LOSS_FIELDS = ("policy_loss_type", "dppo_type", "delta_low", "delta_high")
PRIME_RL_LOSS_FIELDS = ("dppo_mask_low", "dppo_mask_high", "kl_tau", "adv_tau")
LOSS_PEER_OF = {
    **dict.fromkeys(VERL_LOSS_FIELDS, "verl"),
    **dict.fromkeys(SKYRL_LOSS_FIELDS, "SkyRL"),
    **dict.fromkeys(PRIME_RL_LOSS_FIELDS, "prime-rl"),
}
"""Every accepted peer field of ``PolicyLossConfig`` and the peer it comes from."""

_DPPO_MODES = ("dppo_tv", "dppo_kl")
_SKYRL_DPPO_TYPES = {"binary_tv": "dppo_tv", "binary_kl": "dppo_kl"}


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
    return {"verl": _verl_loss, "SkyRL": _skyrl_loss, "prime-rl": _prime_rl_loss}[peers[0]](given)


def _verl_loss(given: dict[str, Any]) -> Translation:
    if "clip_ratio" in given:
        raise PeerNameError(
            "verl reads clip_ratio only where clip_ratio_low / clip_ratio_high are null, and its config sets both "
            "to 0.2: give clip_ratio_low and clip_ratio_high instead."
        )
    mode = given.get("loss_mode", "vanilla")
    low = _non_negative(given.get("clip_ratio_low", 0.2), "verl's clip_ratio_low")
    high = _non_negative(given.get("clip_ratio_high", 0.2), "verl's clip_ratio_high")
    cap = _positive(given.get("clip_ratio_c", 3.0), "verl's clip_ratio_c")
    out = Translation()
    if mode == "vanilla":
        out.settings.update(loss_type="ppo", eps_clip_low=low, eps_clip_high=high, dual_clip=cap)
        out.messages.append(
            f"verl's loss_mode='vanilla' (clip_ratio_low={low!r}, clip_ratio_high={high!r}, clip_ratio_c={cap!r}) is "
            f"the kit's loss_type='ppo', eps_clip_low={low!r}, eps_clip_high={high!r}, dual_clip={cap!r} (verl's PPO "
            "always dual-clips the negative-advantage tokens at clip_ratio_c)."
        )
    elif mode in _DPPO_MODES:
        out.settings.update(loss_type=mode, dppo_delta_low=low, dppo_delta_high=high, dppo_ratio_cap=cap)
        out.messages.append(
            f"verl's loss_mode={mode!r} (clip_ratio_low={low!r}, clip_ratio_high={high!r}, clip_ratio_c={cap!r}) is "
            f"the kit's loss_type={mode!r}, dppo_delta_low={low!r}, dppo_delta_high={high!r}, dppo_ratio_cap={cap!r} "
            "(verl truncates DPPO's ratio at clip_ratio_c). verl's DPPO divides by pi_old: the kit's decoupled "
            "mode (bypass_mode: false); in verl's bypass mode its own PPO loss replaces loss_mode."
        )
    else:
        raise PeerNameError(
            f"verl's loss_mode={mode!r} is not mapped by name (mapped: 'vanilla', 'dppo_tv', 'dppo_kl'); the kit's "
            "loss_type ('gspo', 'sapo') and OffPolicyCorrectionConfig.objective ('cispo', 'pure_is') express the "
            "others (docs/off_policy_correction.md, sections 3.4 and 3.5)."
        )
    return out


def _skyrl_loss(given: dict[str, Any]) -> Translation:
    loss_type = given.get("policy_loss_type", "regular")  # SkyRL's default
    out = Translation()
    if loss_type == "dppo":
        dppo_type = given.get("dppo_type", "binary_tv")
        if dppo_type not in _SKYRL_DPPO_TYPES:
            raise PeerNameError(f"SkyRL's dppo_type={dppo_type!r} is not one of 'binary_tv', 'binary_kl'.")
        kit = _SKYRL_DPPO_TYPES[dppo_type]
        low = _non_negative(given.get("delta_low", 0.2), "SkyRL's delta_low")
        high = _non_negative(given.get("delta_high", 0.2), "SkyRL's delta_high")
        out.settings.update(loss_type=kit, dppo_delta_low=low, dppo_delta_high=high)
        out.messages.append(
            f"SkyRL's policy_loss_type='dppo' (dppo_type={dppo_type!r}, delta_low={low!r}, delta_high={high!r}) is "
            f"the kit's loss_type={kit!r}, dppo_delta_low={low!r}, dppo_delta_high={high!r}. SkyRL's DPPO divides "
            "by pi_rollout: set bypass_mode: true in the correction for the same ratio and mask (SkyRL's TIS "
            "weight pi_old / pi_rollout on top of it is double correction, which the kit refuses)."
        )
        return out
    stray = [name for name in ("dppo_type", "delta_low", "delta_high") if name in given]
    if stray:
        raise PeerNameError(
            f"SkyRL reads algorithm.dppo.* ({', '.join(stray)}) only with policy_loss_type: dppo, and "
            f"policy_loss_type is {loss_type!r}: add policy_loss_type: dppo, or drop them."
        )
    if loss_type != "regular":
        raise PeerNameError(
            f"SkyRL's policy_loss_type={loss_type!r} is not mapped by name (mapped: 'regular', 'dppo'); the kit's "
            "dual_clip, loss_type ('gspo', 'sapo') and OffPolicyCorrectionConfig.objective ('cispo') express the "
            "others (docs/off_policy_correction.md, sections 3.4 and 3.5)."
        )
    out.settings["loss_type"] = "ppo"
    out.messages.append(
        "SkyRL's policy_loss_type='regular' is the kit's loss_type='ppo' (eps_clip_low / eps_clip_high: the same "
        "names)."
    )
    return out


def _prime_rl_loss(given: dict[str, Any]) -> Translation:
    adv_tau = _non_negative(given.get("adv_tau", 1.0), "prime-rl's adv_tau")
    if adv_tau != 1.0:
        raise PeerNameError(
            f"prime-rl's adv_tau={adv_tau!r} multiplies the advantages; the kit's loss takes them as given: scale "
            "the advantages where they are computed, and leave adv_tau at 1.0."
        )
    low = _non_negative(given.get("dppo_mask_low", 0.2), "prime-rl's dppo_mask_low")
    high = _non_negative(given.get("dppo_mask_high", 0.2), "prime-rl's dppo_mask_high")
    kl_tau = _non_negative(given.get("kl_tau", 1e-3), "prime-rl's kl_tau")
    out = Translation()
    # prime-rl's KL term is kl_tau * d^2; the kit's k2 estimator is d^2 / 2.
    out.settings.update(
        loss_type="dppo_tv",
        dppo_delta_low=low,
        dppo_delta_high=high,
        rollout_kl_coef=2.0 * kl_tau,
        rollout_kl_estimator="k2",
    )
    out.messages.append(
        f"prime-rl's default loss (dppo_mask_low={low!r}, dppo_mask_high={high!r}, kl_tau={kl_tau!r}) is the kit's "
        f"loss_type='dppo_tv', dppo_delta_low={low!r}, dppo_delta_high={high!r}, rollout_kl_coef={2.0 * kl_tau!r}, "
        "rollout_kl_estimator='k2' (prime-rl's kl_tau * d^2 is 2 * kl_tau * k2). prime-rl has no pi_prox: its "
        "ratio, mask and KL divide by pi_rollout, so set bypass_mode: true in the correction "
        "(OffPolicyCorrectionConfig.bypass())."
    )
    return out


def _non_negative(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PeerNameError(f"{what}={value!r} is not a number.") from None
    if not math.isfinite(number) or number < 0:
        raise PeerNameError(f"{what}={value!r} must be a finite number >= 0.")
    return number


# ----------------------------------------------------------------------------------------- AReaL
# AReaL's actor settings (``actor.*`` of its PPOActorConfig, areal/api/cli_args.py), given flat.
AREAL_FIELDS = ("prox_logp_method", "m2_threshold")
PEER_OF.update(dict.fromkeys(AREAL_FIELDS, "AReaL"))
PEER_DEFAULTS.update(dict.fromkeys(AREAL_FIELDS))


def _areal(given: dict[str, Any], bypass_mode: bool) -> Translation:
    out = Translation()
    if "prox_logp_method" in given:
        _areal_prox_logp_method(given["prox_logp_method"], out)
    if "m2_threshold" in given:
        _areal_m2_threshold(given["m2_threshold"], out)
    return out


def _areal_prox_logp_method(method: Any, out: Translation) -> None:
    if method == "loglinear":
        # compute_prox_logp_approximations: v_prox = v_theta - 1, with AReaL's version counting
        # training steps (one rollout batch each, however many optimizer steps it takes).
        out.settings["prox_method"] = "loglinear"
        out.messages.append(
            "AReaL's prox_logp_method='loglinear' is the kit's prox_method='loglinear' (the same log-linear "
            "interpolation; AReaL's versions count training steps, the kit's optimizer steps, so the kit's proximal "
            "version is the step's version minus the optimizer steps of one batch)."
        )
    elif method in ("recompute", "metrics"):
        out.settings["prox_method"] = "recompute"
        extra = (
            " AReaL's 'metrics' trains as 'recompute' and also logs how its interpolations compare with the "
            "recomputed pi_prox; the kit does not log those."
            if method == "metrics"
            else ""
        )
        out.messages.append(f"AReaL's prox_logp_method={method!r} is the kit's prox_method='recompute'.{extra}")
    else:
        raise PeerNameError(f"AReaL's prox_logp_method={method!r} is not one of 'recompute', 'loglinear', 'metrics'.")


def _areal_m2_threshold(value: Any, out: Translation) -> None:
    threshold = _positive(value, "AReaL's m2_threshold")
    out.settings.update(m2po_mask=True, m2po_threshold=threshold)
    out.messages.append(
        f"AReaL's m2_threshold={threshold!r} is the kit's m2po_mask: true, m2po_threshold={threshold!r} (AReaL ranks "
        "the tokens of each loss call, a micro-batch, and divides that call's loss by the tokens M2PO kept; the kit "
        "ranks the batch given to compute_correction and keeps rejected tokens in the denominator)."
    )
