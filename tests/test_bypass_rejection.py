"""Rejection in bypass mode against a float64 re-derivation of verl's bypass semantics.

In bypass mode (``pi_prox := pi_rollout``) the masks and weights act on the current policy's ratio
``rho_t = pi_theta / pi_rollout`` (detached), as verl's ``compute_policy_loss_bypass_mode`` does.
The reference below is written from the definitions alone (no kit function), in float64: masks,
weights, loss and gradient of each of the six verl presets the kit expresses this way, plus the
mask rates the metrics report.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_offpolicy.correction import PRESETS, PolicyLossConfig, compute_correction, policy_loss
from lightning_offpolicy.metrics.correction import CorrectionMetrics

BYPASS_PRESETS = [name for name in PRESETS if name.startswith("bypass_")]


def _inputs(seed: int = 0):
    """Rows with tiny, small and large mismatch (each mask keeps some and rejects some)."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len = 8, 12
    rollout = -torch.rand(batch, seq_len, generator=gen, dtype=torch.float64) * 3.0
    scale = torch.tensor([1e-5, 2e-4, 0.02, 0.05, 0.1, 0.2, 0.4, 1e-4], dtype=torch.float64)[:, None]
    theta = rollout + scale * torch.randn(batch, seq_len, generator=gen, dtype=torch.float64)
    theta[2, 1] += 2.0  # IcePop outliers: rho = e^2 = 7.4 > 5 ...
    theta[3, 4] -= 1.0  # ... and e^-1 = 0.37 < 0.5
    lengths = torch.tensor([12, 9, 12, 7, 12, 5, 10, 3])
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).double()
    advantages = torch.randn(batch, generator=gen, dtype=torch.float64)
    return theta, rollout, mask, advantages


def _reference(name: str, theta: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor):
    """(loss, token kept mask, per-sequence rejected) from the definitions, float64."""
    cfg = PRESETS[name]()
    valid = mask > 0
    log_rho = torch.where(valid, theta.detach() - rollout, torch.zeros_like(theta))
    keep_token = valid.clone()
    if cfg.token_mask:  # IcePop: low <= rho_t <= high
        keep_token &= (log_rho >= math.log(cfg.token_mask_low)) & (log_rho <= math.log(cfg.token_mask_high))
    keep_seq = torch.ones(theta.shape[0], dtype=torch.bool)
    if cfg.geo_mask:  # geometric mean of rho over the sequence within [low, high]
        geo = (log_rho * keep_token).sum(-1) / (keep_token.sum(-1).clamp(min=1))
        keep_seq &= (geo >= math.log(cfg.geo_mask_low)) & (geo <= math.log(cfg.geo_mask_high))
    if cfg.kl_reject == "k3":  # mean over the sequence of rho - 1 - log rho
        k3 = torch.where(keep_token, log_rho.exp() - 1.0 - log_rho, torch.zeros_like(log_rho))
        keep_seq &= k3.sum(-1) / keep_token.sum(-1).clamp(min=1) <= cfg.kl_reject_threshold
    kept = keep_token & keep_seq[:, None]
    a = adv[:, None].expand_as(theta)
    if cfg.objective == "ppo":
        ratio = torch.exp(theta - rollout)
        per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    elif cfg.objective == "reinforce":
        per_token = -a * theta
    else:  # pure_is: detached truncated pi_theta / pi_rollout, per token or per sequence
        if cfg.objective_level == "token":
            weight = log_rho.exp().clamp(max=cfg.is_clip_high)
        else:
            weight = (log_rho * kept).sum(-1, keepdim=True).exp().clamp(max=cfg.is_clip_high).expand_as(theta)
        per_token = -weight * a * theta
    loss = torch.where(kept, per_token, torch.zeros_like(per_token)).sum() / valid.sum()
    rejected_seq = valid.any(-1) & (valid & ~kept).any(-1)  # a sequence counts once it lost a token
    return loss, kept, rejected_seq


@pytest.mark.parametrize("name", BYPASS_PRESETS)
def test_bypass_rejection_equals_the_float64_reference(name):
    theta64, rollout64, mask, adv = _inputs()
    ref_theta = theta64.clone().requires_grad_(True)
    ref_loss, ref_kept, ref_rejected = _reference(name, ref_theta, rollout64, mask, adv)
    ref_loss.backward()

    cfg = PRESETS[name]()
    assert cfg.bypass_mode and cfg.masks_read_current_policy and not cfg.needs_prox
    theta = theta64.float().requires_grad_(True)
    rollout = rollout64.float()
    out = compute_correction(cfg.ratio_numerator(None, theta), rollout, mask.float(), cfg)
    loss, _ = policy_loss(theta, None, rollout, adv.float(), mask.float(), PolicyLossConfig(), correction=out)
    loss.backward()

    assert torch.equal(out.mask.bool(), ref_kept), "the masks differ from the reference"
    assert 0 < int(ref_kept.sum()) < int(mask.sum()), "the inputs must keep some tokens and reject some"
    if cfg.objective == "ppo":  # PPO clips on the ratio itself; no separate weight applies
        assert torch.equal(out.weights, torch.ones_like(out.weights))
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(theta.grad.double(), ref_theta.grad, rtol=1e-4, atol=1e-7)

    # The mask rates are logged against pi_rollout: rejected tokens / response tokens, and sequences.
    metrics = CorrectionMetrics(cfg)
    metrics.update(stats=out.stats)
    values = metrics.compute()
    valid = mask > 0
    token_rate = float((valid & ~ref_kept).sum() / valid.sum())
    seq_rate = float(ref_rejected.sum() / valid.any(-1).sum())
    assert float(values["rollout_corr/total_token_reject_rate"]) == pytest.approx(token_rate)
    assert float(values["rollout_corr/total_seq_reject_rate"]) == pytest.approx(seq_rate)
    # The mismatch metrics report pi_theta / pi_rollout in bypass mode with a mask.
    expected_kl = float(-(torch.where(valid, theta64 - rollout64, torch.zeros_like(theta64))).sum() / valid.sum())
    assert float(values["rollout_corr/kl"]) == pytest.approx(expected_kl, rel=1e-4, abs=1e-7)


def test_bypass_masks_need_the_current_policy():
    cfg = PRESETS["bypass_ppo_clip_k3_rs"]()
    theta, rollout, mask, _ = _inputs()
    with pytest.raises(ValueError, match=r"bypass mode the rejection masks \(kl_reject\).*current policy"):
        compute_correction(None, rollout.float(), mask.float(), cfg)
    # Without a mask, bypass mode reads no logprob and reports no mismatch.
    out = compute_correction(theta.float(), rollout.float(), mask.float(), PRESETS["bypass"]())
    assert torch.equal(out.stats.log_rho, torch.zeros_like(out.stats.log_rho))
