"""TRL's ``GRPOConfig`` keys (``vllm_importance_sampling_*``, ``off_policy_mask_threshold``) as the kit's
correction settings."""

from __future__ import annotations

import math
from typing import Any

from lightning_offpolicy.correction.peers.common import PeerNameError, Translation, positive

TRL_CLIP_MAX = 3.0
"""TRL's default ``vllm_importance_sampling_clip_max``, whose ``None`` means "no upper bound"."""


def trl_correction(given: dict[str, Any], bypass_mode: bool) -> Translation:
    given = dict(given)
    threshold = given.pop("off_policy_mask_threshold", None)
    # TRL turns its vLLM importance sampling on by default; here a vllm_importance_sampling_* key does.
    out = _trl_importance_sampling(given) if given else Translation()
    if threshold is not None:
        delta = positive(threshold, "TRL's off_policy_mask_threshold")
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
    high = None if high is None else positive(high, "TRL's vllm_importance_sampling_clip_max")
    low = None if low is None else positive(low, "TRL's vllm_importance_sampling_clip_min")
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
