"""slime's ``--use-opsm`` / ``--opsm-delta`` and AReaL's ``actor.m2_threshold`` / ``actor.prox_logp_method``
as the kit's correction settings."""

from __future__ import annotations

from typing import Any

from lightning_offpolicy.correction.peers.common import PeerNameError, Translation, positive


def slime_correction(given: dict[str, Any], bypass_mode: bool) -> Translation:
    out = Translation()
    if not given.get("use_opsm", False):
        # slime reads --opsm-delta only under --use-opsm.
        delta = f" (its opsm_delta={given['opsm_delta']!r} is read only with use_opsm)" if "opsm_delta" in given else ""
        out.messages.append(f"slime's use_opsm off is the kit's default: no OPSM mask{delta}.")
        return out
    delta = positive(given.get("opsm_delta", 1e-4), "slime's opsm_delta")  # slime's default --opsm-delta
    # slime's compute_opsm_mask compares pi_theta with its old log-probs: the recomputed ones, or the
    # engine's under --use-rollout-logprobs (the kit's bypass mode, where pi_prox is pi_rollout).
    out.settings.update(opsm_mask=True, opsm_threshold=delta, opsm_reference="prox")
    out.messages.append(
        f"slime's use_opsm=True, opsm_delta={delta!r} is the kit's opsm_mask: true, opsm_threshold={delta!r}, "
        "opsm_reference='prox' (slime's old log-probs; with --use-rollout-logprobs they are pi_rollout: the kit's "
        "bypass_mode)."
    )
    return out


def areal_correction(given: dict[str, Any], bypass_mode: bool) -> Translation:
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
    threshold = positive(value, "AReaL's m2_threshold")
    out.settings.update(m2po_mask=True, m2po_threshold=threshold)
    out.messages.append(
        f"AReaL's m2_threshold={threshold!r} is the kit's m2po_mask: true, m2po_threshold={threshold!r} (AReaL ranks "
        "the tokens of each loss call, a micro-batch, and divides that call's loss by the tokens M2PO kept; the kit "
        "ranks the batch given to compute_correction and keeps rejected tokens in the denominator)."
    )
