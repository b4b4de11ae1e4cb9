"""SkyRL's ``trainer.algorithm.off_policy_correction.*`` keys as the kit's correction settings."""

from __future__ import annotations

from typing import Any

from lightning_offpolicy.correction.peers.common import PeerNameError, Translation, positive


def skyrl_correction(given: dict[str, Any], bypass_mode: bool) -> Translation:
    out = Translation()
    ratio_type = given.get("tis_ratio_type")
    if ratio_type not in (None, "token", "sequence"):
        raise PeerNameError(f"SkyRL's tis_ratio_type={ratio_type!r} is not one of None, 'token', 'sequence'.")
    if ratio_type is not None:
        # SkyRL's own defaults: 2.0 for tokens, 5.0 for sequences.
        cap_key = f"{ratio_type}_tis_ratio_clip_high"
        cap = positive(given.get(cap_key, 2.0 if ratio_type == "token" else 5.0), f"SkyRL's {cap_key}")
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
