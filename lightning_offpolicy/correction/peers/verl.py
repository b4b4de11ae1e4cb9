"""verl's ``algorithm.rollout_correction.*`` keys (``rollout_is``, ``rollout_rs``, ...) as the kit's
correction settings."""

from __future__ import annotations

from typing import Any

from lightning_offpolicy.correction.peers.common import PeerNameError, Translation, positive

_KL_LEVELS = {"token": "token", "seq_sum": "seq_sum", "seq_mean": "seq_mean", "seq_max": "seq_max"}
_K1_MASKS = {"token": "token_mask", "seq_sum": "product_mask", "seq_mean": "geo_mask"}


def verl_correction(given: dict[str, Any], bypass_mode: bool) -> Translation:
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
        value = positive(threshold, f"verl's rollout_rs_threshold for {mode}")
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
        low, high = positive(low_text, what), positive(high_text, what)
    else:
        high = positive(threshold, what)
        low = 1.0 / high
    if low > high:
        raise PeerNameError(f"{what}: lower bound {low} above upper bound {high}.")
    return low, high


def _is_threshold(threshold: Any) -> tuple[float | None, float]:
    """verl's rollout_is_threshold: a cap (TIS) or ``"lower_upper"`` (IcePop)."""
    if isinstance(threshold, str) and "_" in threshold:
        return _ratio_bounds(threshold, "verl's rollout_is_threshold")
    return None, positive(threshold, "verl's rollout_is_threshold")
