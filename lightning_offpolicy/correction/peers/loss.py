"""The peers' names of the policy loss's settings as the kit's ``PolicyLossConfig`` fields.

The peers' names of the policy loss's settings (``PolicyLossConfig``): verl's
``actor_rollout_ref.actor.*`` (``policy_loss.loss_mode``, ``clip_ratio_*``), SkyRL's
``trainer.algorithm.policy_loss_type`` with its ``algorithm.dppo.*`` block (given flat here), and
prime-rl's ``[trainer.loss]`` table of ``type = "default"`` (its DPPO + KL loss). Defaults are
each peer's own: verl's ActorConfig, SkyRL's DPPOConfig, prime-rl's DefaultLossConfig.
"""

from __future__ import annotations

from typing import Any

from lightning_offpolicy.correction.peers.common import PeerNameError, Translation, non_negative, positive

_DPPO_MODES = ("dppo_tv", "dppo_kl")
_SKYRL_DPPO_TYPES = {"binary_tv": "dppo_tv", "binary_kl": "dppo_kl"}


def verl_loss(given: dict[str, Any]) -> Translation:
    if "clip_ratio" in given:
        raise PeerNameError(
            "verl reads clip_ratio only where clip_ratio_low / clip_ratio_high are null, and its config sets both "
            "to 0.2: give clip_ratio_low and clip_ratio_high instead."
        )
    mode = given.get("loss_mode", "vanilla")
    low = non_negative(given.get("clip_ratio_low", 0.2), "verl's clip_ratio_low")
    high = non_negative(given.get("clip_ratio_high", 0.2), "verl's clip_ratio_high")
    cap = positive(given.get("clip_ratio_c", 3.0), "verl's clip_ratio_c")
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


def skyrl_loss(given: dict[str, Any]) -> Translation:
    loss_type = given.get("policy_loss_type", "regular")  # SkyRL's default
    out = Translation()
    if loss_type == "dppo":
        dppo_type = given.get("dppo_type", "binary_tv")
        if dppo_type not in _SKYRL_DPPO_TYPES:
            raise PeerNameError(f"SkyRL's dppo_type={dppo_type!r} is not one of 'binary_tv', 'binary_kl'.")
        kit = _SKYRL_DPPO_TYPES[dppo_type]
        low = non_negative(given.get("delta_low", 0.2), "SkyRL's delta_low")
        high = non_negative(given.get("delta_high", 0.2), "SkyRL's delta_high")
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


def prime_rl_loss(given: dict[str, Any]) -> Translation:
    adv_tau = non_negative(given.get("adv_tau", 1.0), "prime-rl's adv_tau")
    if adv_tau != 1.0:
        raise PeerNameError(
            f"prime-rl's adv_tau={adv_tau!r} multiplies the advantages; the kit's loss takes them as given: scale "
            "the advantages where they are computed, and leave adv_tau at 1.0."
        )
    low = non_negative(given.get("dppo_mask_low", 0.2), "prime-rl's dppo_mask_low")
    high = non_negative(given.get("dppo_mask_high", 0.2), "prime-rl's dppo_mask_high")
    kl_tau = non_negative(given.get("kl_tau", 1e-3), "prime-rl's kl_tau")
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
