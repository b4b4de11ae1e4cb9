"""policy_loss's one correction argument: a compute_correction output, or a slice of its rows without stats."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_offpolicy.correction import (
    CorrectionConfigError,
    CorrectionOutput,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)

C = OffPolicyCorrectionConfig

CONFIGS = {
    "disabled": C.disabled(),
    "token_tis": C.token_tis(clip_high=1.5),
    "seq_tis_geo": C.geo_mis_seq_tis(low=0.5, high=2.0, clip_high=1.5),
    "token_mis": C.token_mis(low=0.8, high=1.25),
    "bypass": C.bypass(),
    "pure_is_seq": C.pure_is(clip_high=1.5, clip_low=0.5, level="sequence"),
    "cispo_rollout": C.cispo(clip_high=1.2, clip_low=0.8),
    "cispo_prox_tis": C(objective="cispo", anchor="prox", tis_level="token", tis_clip_high=2.0, is_clip_high=1.2),
}


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    rollout = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    prox = rollout + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    theta = prox + 0.2 * torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    advantages = torch.randn(shape[0], generator=gen, dtype=torch.float64)
    ref = prox - 0.1
    return theta, prox, rollout, advantages, mask, ref


def _loss_and_grad(theta: torch.Tensor, *args, **kwargs):
    theta = theta.clone().requires_grad_(True)
    loss, info = policy_loss(theta, *args, **kwargs)
    loss.backward()
    return loss.detach(), info, theta.grad


# GSPO only with the PPO objective: the others replace the surrogate (check_compatible refuses it).
CASES = [(name, "ppo") for name in sorted(CONFIGS)] + [
    (name, "gspo") for name in sorted(CONFIGS) if CONFIGS[name].objective == "ppo"
]


@pytest.mark.parametrize(("name", "loss_type"), CASES)
def test_a_slice_without_stats_equals_the_correction_output_in_float64(name, loss_type):
    cfg = CONFIGS[name]
    theta, prox, rollout, advantages, mask, ref = _batch()
    loss_cfg = PolicyLossConfig(loss_type=loss_type, dual_clip=3.0, rollout_kl_coef=0.1, ref_kl_coef=0.05)
    out = compute_correction(None if cfg.bypass_mode else prox, rollout, mask, cfg)
    common = (prox, rollout, advantages, mask, loss_cfg)
    by_output = _loss_and_grad(theta, *common, correction=out, ref_logprobs=ref)
    # What a trainer passes per micro-batch: the weights and mask, and a config of the loss's fields only.
    sliced = CorrectionOutput(out.weights, out.mask, None, C(**cfg.policy_loss_kwargs()))
    plain = _loss_and_grad(theta, *common, correction=sliced, ref_logprobs=ref)
    assert by_output[0].dtype == torch.float64
    assert torch.equal(by_output[0], plain[0])
    assert torch.equal(by_output[2], plain[2])
    assert by_output[1] == plain[1]


def test_hand_computed_token_tis_ppo_in_float64():
    # Two response tokens of one sequence, A = 1, eps 0.2: r = exp(theta - prox) = [1.5, 0.5],
    # clip(r) = [1.2, 0.8], min(rA, clip(r)A) = [1.2, 0.5]; w = [1.5, 0.25]; L = -(1.8 + 0.125) / 2.
    prox = torch.log(torch.tensor([[0.2, 0.4]], dtype=torch.float64))
    theta = prox + torch.log(torch.tensor([[1.5, 0.5]], dtype=torch.float64))
    weights = torch.tensor([[1.5, 0.25]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, info, grad = _loss_and_grad(
        theta,
        prox,
        prox,
        torch.ones(1, dtype=torch.float64),
        mask,
        correction=CorrectionOutput(weights, mask, None, C()),
    )
    assert loss.item() == pytest.approx(-(1.5 * 1.2 + 0.25 * 0.5) / 2, rel=1e-12)
    # Only the unclipped token carries a gradient: d/dtheta (-w r A / 2) = -w r / 2 = -0.25 * 0.5 / 2.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.0625]], dtype=torch.float64), rtol=1e-12, atol=0.0)
    assert info.clipped_tokens.item() == 1


def test_rejected_tokens_leave_the_numerator_but_not_the_denominator():
    theta = torch.zeros(1, 2, dtype=torch.float64)
    ones = torch.ones(1, 2, dtype=torch.float64)
    kept_one = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    correction = CorrectionOutput(ones, kept_one, None, C())
    loss, info, _ = _loss_and_grad(theta, theta, theta, torch.ones(1, dtype=torch.float64), ones, correction=correction)
    assert loss.item() == pytest.approx(-0.5)
    assert info.kept_tokens.item() == 1 and info.response_tokens.item() == 2


def test_no_correction_is_plain_ppo():
    theta, prox, rollout, advantages, mask, _ = _batch(1)
    out = compute_correction(prox, rollout, mask, C.disabled())
    plain = _loss_and_grad(theta, prox, rollout, advantages, mask)
    by_output = _loss_and_grad(theta, prox, rollout, advantages, mask, correction=out)
    assert torch.equal(plain[0], by_output[0]) and torch.equal(plain[2], by_output[2])


@pytest.mark.parametrize("name", ["weights", "mask", "objective", "bypass_mode", "is_clip_high"])
def test_the_correction_enters_only_as_one_output(name):
    # The former plain arguments are gone: the CorrectionOutput (its config included) carries them.
    theta, prox, rollout, advantages, mask, _ = _batch()
    with pytest.raises(TypeError, match=name):
        policy_loss(theta, prox, rollout, advantages, mask, **{name: None})


def _slice(mask, config, weights=None, kept=None):
    """A CorrectionOutput without stats, as a trainer builds one per micro-batch."""
    return CorrectionOutput(
        torch.ones_like(mask) if weights is None else weights, mask if kept is None else kept, None, config
    )


def test_the_objective_is_validated_by_its_config():
    theta, prox, rollout, advantages, mask, _ = _batch()
    with pytest.raises(
        CorrectionConfigError, match=r"OffPolicyCorrectionConfig.objective='vanilla' is not a known choice"
    ):
        C(objective="vanilla")
    # reinforce: -A log pi_theta over the response tokens, no weight, no clip (a hand computation).
    leaf = theta.detach().clone().requires_grad_(True)
    reinforce = C(objective="reinforce", bypass_mode=True)
    loss, info = policy_loss(leaf, None, rollout, advantages, mask, correction=_slice(mask, reinforce))
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    expected = -(adv * torch.where(mask.bool(), theta, 0.0)).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    loss.backward()
    torch.testing.assert_close(leaf.grad, torch.where(mask.bool(), -adv / mask.sum(), 0.0))
    assert info.clipped_tokens == 0
    with pytest.raises(CorrectionConfigError, match=r"objective='cispo' needs is_clip_high"):
        C(objective="cispo", is_clip_high=None)
    with pytest.raises(CorrectionConfigError, match=r"is_clip_low=3.0 is greater than"):
        C(objective="pure_is", bypass_mode=True, is_clip_low=3.0, is_clip_high=2.0)
    with pytest.raises(CorrectionConfigError, match=r"loss_type='gspo' cannot apply"):
        gspo = PolicyLossConfig(loss_type="gspo")
        policy_loss(theta, prox, rollout, advantages, mask, gspo, correction=_slice(mask, C.cispo(clip_high=2.0)))
    with pytest.raises(CorrectionConfigError, match=r"bypass_mode=True has no pi_prox"):
        C(bypass_mode=True, objective="cispo", anchor="prox", is_clip_high=2.0)
    with pytest.raises(ValueError, match=r"policy_loss: correction was computed for a batch of shape \(1, 6\)"):
        policy_loss(theta, prox, rollout, advantages, mask, correction=_slice(mask, C(), weights=torch.ones(1, 6)))
    with pytest.raises(ValueError, match=r"policy_loss: correction was computed for a batch of shape \(4, 5\)"):
        policy_loss(theta, prox, rollout, advantages, mask, correction=_slice(mask, C(), kept=torch.ones(4, 5)))
    # Bypass reads rollout_logprobs, never prox_logprobs.
    loss, _ = policy_loss(theta, None, rollout, advantages, mask, correction=_slice(mask, C.bypass()))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="needs prox_logprobs"):
        policy_loss(theta, None, rollout, advantages, mask)


def test_configs_load_with_weights_only():
    # Lightning resumes with torch.load(weights_only=True); the configs live in the hyperparameters.
    buffer = io.BytesIO()
    saved = {"correction": C.geo_mis_token_tis(), "loss": PolicyLossConfig(dual_clip=3.0)}
    torch.save(saved, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == saved


def test_entropy_bonus_by_hand_and_required():
    theta, prox, rollout, advantages, mask, _ = _batch()
    gen = torch.Generator().manual_seed(5)
    entropy = (torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2.0).requires_grad_(True)
    plain, _ = policy_loss(theta, prox, rollout, advantages, mask)
    cfg = PolicyLossConfig(entropy_coef=0.1)
    loss, info = policy_loss(theta, prox, rollout, advantages, mask, cfg, entropy=entropy)
    expected_term = torch.where(mask.bool(), entropy, 0.0).sum() / mask.sum()  # token-mean
    torch.testing.assert_close(info.entropy, expected_term.detach())
    torch.testing.assert_close(loss, plain - 0.1 * expected_term)
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.where(mask.bool(), -0.1 / mask.sum(), 0.0))
    with pytest.raises(ValueError, match="policy_loss needs entropy for this configuration; entropy_coef > 0"):
        policy_loss(theta, prox, rollout, advantages, mask, cfg)
    with pytest.raises(CorrectionConfigError, match="entropy_coef"):
        PolicyLossConfig(entropy_coef=-1.0)
