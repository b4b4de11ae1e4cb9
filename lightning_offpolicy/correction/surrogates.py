"""The per-token surrogates of :func:`~lightning_offpolicy.correction.policy_loss`: PPO's clip (with its
GSPO and SAPO variants, and the dual clip), and the detached current-policy weight of pure IS and CISPO.

DPPO's divergence trust region lives in :mod:`~lightning_offpolicy.correction.dppo`.
"""

from __future__ import annotations

import torch

from lightning_offpolicy.correction.loss_config import PolicyLossConfig
from lightning_offpolicy.correction.ratios import log_ratio, masked, safe_exp, sequence_sum


def ppo_surrogate(
    logprobs: torch.Tensor,
    anchor: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    kept: torch.Tensor,
    loss_cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_r = log_ratio(logprobs, anchor, valid)
    if loss_cfg.loss_type == "gspo":
        # Sequence ratio exp(mean_t log r_t), with each token's own gradient (straight-through).
        n = kept.float().sum(dim=-1, keepdim=True).clamp(min=1.0)
        seq_log_r = (sequence_sum(log_r, kept).unsqueeze(-1) / n).detach()
        log_r = masked(logprobs - logprobs.detach(), valid) + seq_log_r
    ratio = safe_exp(log_r)
    if loss_cfg.loss_type == "sapo":
        tau = torch.where(adv > 0, loss_cfg.tau_pos, loss_cfg.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        return -gate * adv, torch.zeros_like(valid), torch.zeros_like(valid)
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - loss_cfg.eps_clip_low, 1.0 + loss_cfg.eps_clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clip_active = valid & (clipped_loss > unclipped)
    dual_active = torch.zeros_like(valid)
    if loss_cfg.dual_clip is not None:
        bound = -adv * loss_cfg.dual_clip
        dual_active = valid & (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, clip_active, dual_active


def current_policy_weighted(
    logprobs: torch.Tensor,
    base: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    kept: torch.Tensor,
    level: str,
    clip_low: float | None,
    clip_high: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        log_w = log_ratio(logprobs.detach(), base, valid)
        if level == "sequence":
            log_w = sequence_sum(log_w, kept).unsqueeze(-1).expand_as(log_w)
        raw = safe_exp(log_w)
        weight = raw.clamp(min=clip_low, max=clip_high)
        clipped = valid & (weight != raw)
    # Gradient flows only through log pi_theta: d/dtheta L = -w * A * grad log pi_theta.
    return -weight * adv * masked(logprobs, valid), clipped
