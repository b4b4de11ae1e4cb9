"""policy_loss / aggregate / KL losses against the float64 reference and analytic gradients."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from reference import (  # noqa: E402
    GARBAGE,
    make_batch,
    ref_aggregate,
    ref_correction,
    ref_kl_loss,
    ref_policy_loss,
)

from lightning_offpolicy.correction import (  # noqa: E402
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    aggregate,
    compute_correction,
    policy_loss,
)

RTOL, ATOL = 1e-5, 1e-6
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
C = OffPolicyCorrectionConfig
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def T(x, grad: bool = False) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x, dtype=np.float32)).clone()
    return t.requires_grad_(grad)


def run_impl(batch, loss_cfg, corr_cfg=None, *, adv=None, token_count=None, sequence_count=None, prox_none=False):
    """Implementation loss, info and d loss / d logprobs."""
    lp = T(batch["logprobs"], grad=True)
    prox = None if prox_none else T(batch["prox"])
    rollout, mask, ref = T(batch["rollout"]), T(batch["mask"]), T(batch["ref"])
    advantages = T(batch["adv"] if adv is None else adv)
    corr = compute_correction(prox, rollout, mask, corr_cfg) if corr_cfg is not None else None
    total, info = policy_loss(
        lp,
        prox,
        rollout,
        advantages,
        mask,
        loss_cfg,
        correction=corr,
        ref_logprobs=ref,
        token_count=token_count,
        sequence_count=sequence_count,
    )
    total.backward()
    return total, info, lp.grad


def run_ref(batch, loss_cfg, corr_cfg=None, *, adv=None, token_count=None, sequence_count=None):
    return ref_policy_loss(
        batch["logprobs"],
        batch["prox"],
        batch["rollout"],
        batch["adv"] if adv is None else adv,
        batch["mask"],
        loss_cfg,
        corr_cfg,
        ref_logprobs=batch["ref"],
        token_count=token_count,
        sequence_count=sequence_count,
    )


def assert_loss_matches(total, info, grad, ref, check_counts: bool = True) -> None:
    tol = ATOL * (1.0 + ref.scale)
    assert math.isfinite(total.item())
    np.testing.assert_allclose(total.item(), ref.total, rtol=RTOL, atol=tol, err_msg="total loss")
    np.testing.assert_allclose(info.policy_loss.item(), ref.policy_loss, rtol=RTOL, atol=tol, err_msg="policy_loss")
    np.testing.assert_allclose(info.rollout_kl.item(), ref.rollout_kl, rtol=RTOL, atol=tol, err_msg="rollout_kl")
    np.testing.assert_allclose(info.ref_kl.item(), ref.ref_kl, rtol=RTOL, atol=tol, err_msg="ref_kl")
    np.testing.assert_allclose(grad.numpy(), ref.grad, rtol=RTOL, atol=ATOL, err_msg="d loss / d logprobs")
    if check_counts:
        assert info.kept_tokens.item() == ref.kept_tokens
        assert info.clipped_tokens.item() == ref.clipped_tokens
        assert info.dual_clipped_tokens.item() == ref.dual_clipped_tokens
        np.testing.assert_allclose(
            info.approx_kl_sum.item(), ref.approx_kl_sum, rtol=RTOL, atol=ATOL, err_msg="approx_kl_sum"
        )
        if hasattr(info, "rollout_kl_sum"):  # newer PolicyLossInfo fields
            np.testing.assert_allclose(
                info.rollout_kl_sum.item(), ref.rollout_kl_sum, rtol=RTOL, atol=ATOL, err_msg="rollout_kl_sum"
            )
        if hasattr(info, "response_tokens"):
            assert info.response_tokens.item() == ref.response_tokens


# ------------------------------------------------------------------------------ grid vs reference
CORRECTIONS = {
    "none": None,
    "disabled": C.disabled(),
    "token_tis": C.token_tis(clip_high=1.1, clip_low=0.9),
    "seq_tis_geo": C(tis_level="sequence", tis_clip_high=1.3, geo_mask=True, geo_mask_low=0.8, geo_mask_high=1.25),
    "token_mis_seq_tis_norm": C(
        token_mask=True,
        token_mask_low=0.9,
        token_mask_high=1.1,
        tis_level="sequence",
        tis_clip_high=2.0,
        normalize_weights=True,
    ),
    "k3_reject_token_tis_norm": C(
        kl_reject="k3",
        kl_reject_level="seq_max",
        kl_reject_threshold=0.01,
        tis_level="token",
        tis_clip_high=1.05,
        normalize_weights=True,
    ),
    "bypass": C.bypass(),
}
OBJECTIVES = {
    "pure_is_token": C.pure_is(clip_high=1.1, clip_low=0.9),
    "pure_is_sequence": C.pure_is(clip_high=1.5, level="sequence"),
    "pure_is_masked": C(
        objective="pure_is",
        is_clip_high=1.2,
        token_mask=True,
        token_mask_low=0.9,
        token_mask_high=1.1,
        objective_level="sequence",
    ),
    "cispo_rollout": C.cispo(clip_high=1.1),
    "cispo_rollout_low": C.cispo(clip_high=1.2, clip_low=0.9),
    "cispo_prox_token_tis": C(
        objective="cispo", anchor="prox", is_clip_high=1.1, tis_level="token", tis_clip_high=1.05
    ),
    "cispo_prox_seq_tis_geo": C(
        objective="cispo",
        anchor="prox",
        is_clip_high=1.1,
        is_clip_low=0.95,
        tis_level="sequence",
        tis_clip_high=1.2,
        geo_mask=True,
        geo_mask_low=0.8,
        geo_mask_high=1.25,
    ),
    "cispo_bypass": C(bypass_mode=True, objective="cispo", is_clip_high=1.1),
}
LOSS_TYPES = {
    "ppo": dict(),
    "ppo_asym_dual": dict(eps_clip_low=0.2, eps_clip_high=0.28, dual_clip=3.0),
    "ppo_tight_dual": dict(eps_clip_low=0.05, eps_clip_high=0.08, dual_clip=1.5),
    "gspo": dict(loss_type="gspo", eps_clip_low=0.02, eps_clip_high=0.03),
    "gspo_dual": dict(loss_type="gspo", eps_clip_low=0.02, eps_clip_high=0.03, dual_clip=2.0),
    "sapo": dict(loss_type="sapo", tau_pos=1.0, tau_neg=1.05),
    "sapo_hot": dict(loss_type="sapo", tau_pos=5.0, tau_neg=8.0),
    "dppo_tv": dict(loss_type="dppo_tv", dppo_delta_low=0.05, dppo_delta_high=0.03),
    "dppo_kl_cap": dict(loss_type="dppo_kl", dppo_delta_low=0.005, dppo_delta_high=0.01, dppo_ratio_cap=1.1),
}
AGG_VARIANTS = {
    "token-mean": dict(aggregation="token-mean"),
    "seq-mean-token-mean": dict(aggregation="seq-mean-token-mean"),
    "seq-mean-token-sum-norm": dict(aggregation="seq-mean-token-sum-norm"),
    "seq-mean-token-sum-norm-const": dict(aggregation="seq-mean-token-sum-norm", loss_norm_constant=20.0),
}
KL_VARIANTS = [
    dict(),
    dict(rollout_kl_coef=0.1, rollout_kl_estimator="k2", ref_kl_coef=0.05, ref_kl_estimator="low_var_kl"),
    dict(rollout_kl_coef=0.3, rollout_kl_estimator="abs", ref_kl_coef=0.2, ref_kl_estimator="k1"),
    dict(rollout_kl_coef=0.2, rollout_kl_estimator="k3", ref_kl_coef=0.1, ref_kl_estimator="k3"),
]

GRID = []
for _c in CORRECTIONS:
    for _l in LOSS_TYPES:
        GRID.append((_c, _l))
for _o in OBJECTIVES:
    GRID.append((_o, "ppo"))


def _grid_case(corr_name, loss_name, agg_name, huge):
    corr_cfg = CORRECTIONS.get(corr_name, OBJECTIVES.get(corr_name))
    kl = KL_VARIANTS[(len(corr_name) + len(loss_name) + len(agg_name)) % len(KL_VARIANTS)]
    if huge and "k3" in (kl.get("rollout_kl_estimator"), kl.get("ref_kl_estimator")):
        kl = KL_VARIANTS[1]  # k3 with |d| > 20: see test_k3_kl_loss_beyond_the_clamp
    loss_cfg = PolicyLossConfig(**LOSS_TYPES[loss_name], **AGG_VARIANTS[agg_name], **kl)
    return corr_cfg, loss_cfg


@pytest.mark.parametrize("huge", [False, True], ids=["normal", "huge"])
@pytest.mark.parametrize("agg_name", list(AGG_VARIANTS))
@pytest.mark.parametrize("corr_name, loss_name", GRID)
def test_policy_loss_matches_reference(corr_name, loss_name, agg_name, huge):
    corr_cfg, loss_cfg = _grid_case(corr_name, loss_name, agg_name, huge)
    seed = sum(map(ord, corr_name + loss_name + agg_name)) + huge
    batch = make_batch(seed, batch=6, length=8, spread=0.08, policy_spread=0.2, huge=huge, holes=huge)
    total, info, grad = run_impl(batch, loss_cfg, corr_cfg)
    ref = run_ref(batch, loss_cfg, corr_cfg)
    assert_loss_matches(total, info, grad, ref)


def test_grid_is_not_vacuous():
    """Across the grid, the clip, the dual clip and the masks each act somewhere."""
    clipped = dual = rejected = 0
    for corr_name, loss_name in GRID:
        corr_cfg, loss_cfg = _grid_case(corr_name, loss_name, "token-mean", False)
        seed = sum(map(ord, corr_name + loss_name + "token-mean"))
        batch = make_batch(seed, batch=6, length=8, spread=0.08, policy_spread=0.2)
        ref = run_ref(batch, loss_cfg, corr_cfg)
        clipped += ref.clipped_tokens
        dual += ref.dual_clipped_tokens
        rejected += int((batch["mask"] != 0).sum()) - ref.kept_tokens
    assert clipped > 0 and dual > 0 and rejected > 0


def test_dppo_grid_rows_mask_and_cap():
    """The DPPO rows of the grid mask tokens and hit the ratio cap, under every correction."""
    for corr_name in CORRECTIONS:
        masked = capped = 0
        for loss_name in ("dppo_tv", "dppo_kl_cap"):
            corr_cfg, loss_cfg = _grid_case(corr_name, loss_name, "token-mean", False)
            seed = sum(map(ord, corr_name + loss_name + "token-mean"))
            ref = run_ref(make_batch(seed, batch=6, length=8, spread=0.08, policy_spread=0.2), loss_cfg, corr_cfg)
            masked += ref.clipped_tokens
            capped += ref.dual_clipped_tokens
        assert masked > 0 and capped > 0, corr_name


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_sequence_advantages_are_broadcast(agg):
    batch = make_batch(11, batch=5, length=6)
    adv = np.random.default_rng(0).normal(size=5).astype(np.float32)
    loss_cfg = PolicyLossConfig(aggregation=agg, dual_clip=2.0)
    corr = C.token_tis(clip_high=1.05)
    total, info, grad = run_impl(batch, loss_cfg, corr, adv=adv)
    assert_loss_matches(total, info, grad, run_ref(batch, loss_cfg, corr, adv=adv))


# ------------------------------------------------------------------------------ hand-computed cases
def test_hand_ppo_token_mean():
    # r = exp(logprobs - prox) = [e^0.5 = 1.6487, 1, e^-0.5 = 0.6065], A = [1, -1, 1], eps 0.2:
    # t0: max(-1.6487, -1.2) = -1.2 (clipped, no gradient); t1: 1.0; t2: max(-0.6065, -0.8) = -0.6065.
    # token-mean: (-1.2 + 1 - 0.6065) / 3 = -0.2688436; grad = [0, -A r, -A r] / 3 = [0, 1/3, -0.2021769].
    # approx_kl_sum = (e^0.5 - 1.5) + 0 + (e^-0.5 - 0.5) = 0.2552519.
    lp = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
    prox = torch.tensor([[-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, info = policy_loss(lp, prox, None, adv, torch.ones(1, 3))
    loss.backward()
    assert loss.item() == pytest.approx(-0.26884355, abs=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.33333333, -0.20217689]]))
    assert info.clipped_tokens.item() == 1
    assert info.kept_tokens.item() == 3
    assert info.approx_kl_sum.item() == pytest.approx(0.25525193, abs=1e-6)


def test_hand_ppo_with_token_tis_weight():
    # Same tokens; TIS weights [1.5, 1, 1] (rho_0 = e^0.5 capped at 1.5):
    # (-1.8 + 1 - 0.6065) / 3 = -0.4688436.
    lp = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
    prox = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -1.0, -1.0]])
    corr = compute_correction(prox, rollout, torch.ones(1, 3), C.token_tis(clip_high=1.5))
    loss, _ = policy_loss(lp, prox, rollout, torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3), correction=corr)
    assert loss.item() == pytest.approx(-0.46884355, abs=1e-6)


def test_hand_dual_clip():
    # r = e^2 = 7.389, A = -1: max(7.389, 1.2) = 7.389 -> dual clip c = 3: min(7.389, 3) = 3, no gradient.
    lp = torch.tensor([[0.0]], requires_grad=True)
    loss, info = policy_loss(
        lp,
        torch.tensor([[-2.0]]),
        None,
        torch.tensor([[-1.0]]),
        torch.ones(1, 1),
        PolicyLossConfig(dual_clip=3.0),
    )
    loss.backward()
    assert loss.item() == pytest.approx(3.0)
    assert lp.grad.item() == 0.0
    assert info.dual_clipped_tokens.item() == 1
    loss, info = policy_loss(lp.detach(), torch.tensor([[-2.0]]), None, torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(7.3890561)
    assert info.dual_clipped_tokens.item() == 0


@pytest.mark.parametrize(
    "agg, expected, expected_rejected",
    [
        # ratios 1 -> L = -A; A = [[1, 2, pad], [3, pad, pad]]; rejecting the A=2 token (IcePop, rho = e):
        ("token-mean", -2.0, -4 / 3),  # -(1+2+3)/3 ; -(1+3)/3 (denominator keeps 3 tokens)
        ("seq-mean-token-mean", -2.25, -1.75),  # (-3/2 - 3/1)/2 ; (-1/2 - 3)/2
        ("seq-mean-token-sum-norm", -1.0, -2 / 3),  # (-3/3 - 3/3)/2 ; (-1/3 - 3/3)/2   (T = 3)
    ],
)
def test_hand_aggregation(agg, expected, expected_rejected):
    nan = float("nan")
    lp = torch.tensor([[-1.0, -1.0, nan], [-1.0, nan, nan], [nan, nan, nan]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2: no response token
    adv = torch.tensor([[1.0, 2.0, nan], [3.0, nan, nan], [nan, nan, nan]])
    cfg = PolicyLossConfig(aggregation=agg)
    loss, _ = policy_loss(lp, lp, lp, adv, mask, cfg)
    assert loss.item() == pytest.approx(expected)
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    corr = compute_correction(lp, rollout, mask, C.token_mis())
    assert corr.mask.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    loss, info = policy_loss(lp, lp, rollout, adv, mask, cfg, correction=corr)
    assert loss.item() == pytest.approx(expected_rejected)
    assert info.kept_tokens.item() == 2


def test_hand_pure_is_and_cispo():
    # pure IS: w = min(exp(lp - rollout), 2) = min([e^1, e^-1]) = [2, 0.3679]; A = [1, 1]; L = -w A lp.
    # lp = [0, -2] -> L = [-2*1*0, -0.3679*1*(-2)] = [0, 0.7358]; token-mean 0.3679;
    # grad = -w A / 2 = [-1, -0.1839].
    lp = torch.tensor([[0.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    corr = compute_correction(None, rollout, mask, C.pure_is(clip_high=2.0))
    loss, info = policy_loss(lp, None, rollout, torch.ones(1, 2), mask, correction=corr)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(-1.0), abs=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.18393972]]))
    assert info.clipped_tokens.item() == 1
    # CISPO on the rollout with the same numbers and a lower clip 0.5: w = [2, 0.5].
    lp.grad = None
    corr = compute_correction(rollout, rollout, mask, C.cispo(clip_high=2.0, clip_low=0.5))
    loss, info = policy_loss(lp, rollout, rollout, torch.ones(1, 2), mask, correction=corr)
    loss.backward()
    assert loss.item() == pytest.approx(0.5)  # (0 + 0.5 * 2) / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.25]]))
    assert info.clipped_tokens.item() == 2


# ------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_pure_is_gradient_is_weighted_score_function(agg, level):
    batch = make_batch(21, batch=5, length=7, policy_spread=0.3)
    cfg = C.pure_is(clip_high=1.3, clip_low=0.8, level=level)
    total, _, grad = run_impl(batch, PolicyLossConfig(aggregation=agg), cfg, prox_none=True)
    # Written out: grad_t = -w_t A_t / denominator_t with w = clip(pi_theta / pi_rollout) (sequence: product).
    lp, ro, A = (batch[k].astype(np.float64) for k in ("logprobs", "rollout", "adv"))
    valid = batch["mask"] != 0
    B, Tn = valid.shape
    n_seq = valid.any(1).sum()
    expected = np.zeros((B, Tn))
    for i in range(B):
        seq = sum(lp[i, t] - ro[i, t] for t in range(Tn) if valid[i, t])
        for t in range(Tn):
            if not valid[i, t]:
                continue
            x = seq if level == "sequence" else lp[i, t] - ro[i, t]
            w = min(max(math.exp(max(min(x, 20), -20)), 0.8), 1.3)
            den = {
                "token-mean": valid.sum(),
                "seq-mean-token-mean": valid[i].sum() * n_seq,
                "seq-mean-token-sum-norm": Tn * n_seq,
            }[agg]
            expected[i, t] = -w * A[i, t] / den
    np.testing.assert_allclose(grad.numpy(), expected, rtol=RTOL, atol=ATOL)
    assert np.abs(expected).max() > 0


@pytest.mark.parametrize("anchor", ["rollout", "prox"])
def test_cispo_gradient_only_through_log_pi_theta(anchor):
    batch = make_batch(22, batch=5, length=7, policy_spread=0.3)
    kw = dict(tis_level="token", tis_clip_high=1.05) if anchor == "prox" else {}
    cfg = C(objective="cispo", anchor=anchor, is_clip_high=1.2, is_clip_low=0.9, **kw)
    lp = T(batch["logprobs"], grad=True)
    prox, rollout = T(batch["prox"], grad=True), T(batch["rollout"], grad=True)
    mask, adv = T(batch["mask"]), T(batch["adv"], grad=True)
    corr = compute_correction(prox, rollout, mask, cfg)
    loss, _ = policy_loss(lp, prox, rollout, adv, mask, PolicyLossConfig(), correction=corr)
    loss.backward()
    for name, x in (("prox", prox), ("rollout", rollout), ("advantages", adv)):
        assert x.grad is None or not bool(x.grad.any()), f"{name} received a gradient"
    ref = run_ref(batch, PolicyLossConfig(), cfg)
    np.testing.assert_allclose(lp.grad.numpy(), ref.grad, rtol=RTOL, atol=ATOL)
    # Explicitly: d/dlp of -sg(w) A lp is -w A (times the TIS weight), never involving dw/dlp.
    valid = batch["mask"] != 0
    lp64 = np.where(valid, batch["logprobs"], 0.0).astype(np.float64)
    base = np.where(valid, batch[anchor], 0.0).astype(np.float64)
    w = np.clip(np.exp(np.clip(lp64 - base, -20, 20)), 0.9, 1.2)
    if anchor == "prox":
        log_rho = np.where(valid, batch["prox"].astype(np.float64) - batch["rollout"], 0.0)
        w = w * np.minimum(np.exp(log_rho), 1.05)
    expected = np.where(valid, -w * np.where(valid, batch["adv"], 0.0) / valid.sum(), 0.0)
    np.testing.assert_allclose(lp.grad.numpy(), expected, rtol=RTOL, atol=ATOL)


def test_ppo_weights_carry_no_gradient_to_prox_or_rollout():
    batch = make_batch(23, batch=4, length=6)
    prox, rollout = T(batch["prox"], grad=True), T(batch["rollout"], grad=True)
    lp, mask = T(batch["logprobs"], grad=True), T(batch["mask"])
    corr = compute_correction(prox, rollout, mask, C.seq_tis(clip_high=1.5))
    loss, _ = policy_loss(lp, prox.detach(), rollout.detach(), T(batch["adv"]), mask, correction=corr)
    loss.backward()
    assert prox.grad is None and rollout.grad is None
    assert bool(lp.grad.abs().sum() > 0)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    loss_type=st.sampled_from(["ppo", "gspo", "sapo"]),
    dual=st.sampled_from([None, 1.5, 3.0]),
    agg=st.sampled_from(AGGREGATIONS),
    kl=st.sampled_from(KL_VARIANTS),
    huge=st.booleans(),
)
def test_property_bypass_is_plain_ppo_against_rollout(seed, loss_type, dual, agg, kl, huge):
    batch = make_batch(seed, batch=4, length=6, huge=huge)
    loss_cfg = PolicyLossConfig(loss_type=loss_type, dual_clip=dual, aggregation=agg, **kl)
    # bypass: prox is whatever (here: garbage everywhere), the correction never reads it
    lp1 = T(batch["logprobs"], grad=True)
    rollout, mask, adv, ref = T(batch["rollout"]), T(batch["mask"]), T(batch["adv"]), T(batch["ref"])
    corr = compute_correction(None, rollout, mask, C.bypass())
    garbage_prox = torch.full_like(rollout, float("nan"))
    l1, i1 = policy_loss(lp1, garbage_prox, rollout, adv, mask, loss_cfg, correction=corr, ref_logprobs=ref)
    l1.backward()
    lp2 = T(batch["logprobs"], grad=True)
    l2, i2 = policy_loss(lp2, rollout, rollout, adv, mask, loss_cfg, correction=None, ref_logprobs=ref)
    l2.backward()
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-6, atol=1e-7)
    for f in ("kept_tokens", "clipped_tokens", "dual_clipped_tokens", "approx_kl_sum"):
        torch.testing.assert_close(getattr(i1, f), getattr(i2, f))
    # and both equal the reference with prox := rollout
    b2 = dict(batch, prox=batch["rollout"])
    ref_out = run_ref(b2, loss_cfg, None)
    np.testing.assert_allclose(l1.item(), ref_out.total, rtol=RTOL, atol=ATOL * (1 + ref_out.scale))


ALL_OBJECTIVES = {
    "ppo": (C.token_tis(clip_high=1.5), {}),
    "gspo": (C.seq_tis(clip_high=1.5), dict(loss_type="gspo")),
    "sapo": (C.token_tis(clip_high=1.5), dict(loss_type="sapo")),
    "ppo_dual": (C.disabled(), dict(dual_clip=2.0)),
    "dppo_tv": (C.token_tis(clip_high=1.5), dict(loss_type="dppo_tv", dppo_delta_low=0.01, dppo_delta_high=0.01)),
    "dppo_kl_cap": (C.disabled(), dict(loss_type="dppo_kl", dppo_delta_low=0.01, dppo_ratio_cap=1.05)),
    "pure_is_token": (C(objective="pure_is", token_mask=True), {}),
    "pure_is_seq": (C(objective="pure_is", objective_level="sequence", token_mask=True), {}),
    "cispo_rollout": (C(objective="cispo", token_mask=True), {}),
    "cispo_prox": (C(objective="cispo", anchor="prox", tis_level="token", token_mask=True), {}),
}


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", list(ALL_OBJECTIVES))
def test_all_rejected_batch_gives_zero_loss_and_zero_grads(name, agg):
    corr_cfg, kw = ALL_OBJECTIVES[name]
    # Reject every token: IcePop bounds that exclude every ratio, and a geometric mask for the rest.
    corr_cfg = corr_cfg.replace(token_mask=True, token_mask_low=50.0, token_mask_high=60.0)
    batch = make_batch(31, batch=4, length=5)
    total, info, grad = run_impl(batch, PolicyLossConfig(aggregation=agg, **kw), corr_cfg)
    assert info.kept_tokens.item() == 0
    assert total.item() == 0.0
    assert bool(torch.isfinite(grad).all()) and not bool(grad.any())
    assert info.clipped_tokens.item() == 0 and info.approx_kl_sum.item() == 0.0


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_empty_batch_gives_zero_loss(agg):
    nan = float("nan")
    lp = torch.full((2, 3), nan, requires_grad=True)
    x = torch.full((2, 3), nan)
    loss, info = policy_loss(lp, x, x, x, torch.zeros(2, 3), PolicyLossConfig(aggregation=agg, rollout_kl_coef=1.0))
    loss.backward()
    assert loss.item() == 0.0
    assert bool(torch.isfinite(lp.grad).all()) and not bool(lp.grad.any())


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", list(ALL_OBJECTIVES))
def test_nan_in_padding_gives_finite_loss_and_grads(name, agg):
    corr_cfg, kw = ALL_OBJECTIVES[name]
    loss_cfg = PolicyLossConfig(aggregation=agg, rollout_kl_coef=0.1, rollout_kl_estimator="k3", ref_kl_coef=0.1, **kw)
    batch = make_batch(32, batch=5, length=6, holes=True)
    pad = batch["mask"] == 0
    for k in ("logprobs", "prox", "rollout", "ref", "adv"):
        batch[k] = np.where(pad, np.float32("nan"), batch[k]).astype(np.float32)
    total, info, grad = run_impl(batch, loss_cfg, corr_cfg)
    assert math.isfinite(total.item())
    assert bool(torch.isfinite(grad).all())
    assert not bool(grad[torch.as_tensor(pad)].any())
    # the same batch with clean padding gives exactly the same loss and gradient
    clean = {k: (np.where(pad, np.float32(-1.0), v).astype(np.float32) if k != "mask" else v) for k, v in batch.items()}
    total2, _, grad2 = run_impl(clean, loss_cfg, corr_cfg)
    assert total.item() == total2.item()
    assert torch.equal(grad, grad2)
    for f in ("kept_tokens", "clipped_tokens", "dual_clipped_tokens", "approx_kl_sum"):
        assert math.isfinite(getattr(info, f).item())


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    name=st.sampled_from(list(ALL_OBJECTIVES)),
    fill=st.sampled_from(GARBAGE),
    agg=st.sampled_from(AGGREGATIONS),
)
def test_property_padding_garbage_never_leaks(seed, name, fill, agg):
    corr_cfg, kw = ALL_OBJECTIVES[name]
    loss_cfg = PolicyLossConfig(aggregation=agg, rollout_kl_coef=0.1, ref_kl_coef=0.1, **kw)
    batch = make_batch(seed, batch=4, length=5, holes=True)
    pad = batch["mask"] == 0
    other = {k: (np.where(pad, np.float32(fill), v).astype(np.float32) if k != "mask" else v) for k, v in batch.items()}
    t1, i1, g1 = run_impl(batch, loss_cfg, corr_cfg)
    t2, i2, g2 = run_impl(other, loss_cfg, corr_cfg)
    assert math.isfinite(t1.item()) and t1.item() == t2.item()
    assert bool(torch.isfinite(g1).all()) and torch.equal(g1, g2)
    assert i1.approx_kl_sum.item() == i2.approx_kl_sum.item()


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    name=st.sampled_from(list(ALL_OBJECTIVES)),
    sign=st.sampled_from([-1.0, 1.0]),
    which=st.sampled_from(["logprobs", "prox", "rollout"]),
)
def test_property_huge_log_ratios_give_finite_loss_and_grads(seed, name, sign, which):
    corr_cfg, kw = ALL_OBJECTIVES[name]
    loss_cfg = PolicyLossConfig(rollout_kl_coef=0.1, rollout_kl_estimator="low_var_kl", **kw)
    batch = make_batch(seed, batch=4, length=5)
    valid = batch["mask"] != 0
    hit = valid & (np.random.default_rng(seed).random(valid.shape) < 0.4)
    batch[which] = np.where(hit, batch[which] + sign * 1000.0, batch[which]).astype(np.float32)
    total, info, grad = run_impl(batch, loss_cfg, corr_cfg)
    assert math.isfinite(total.item())
    assert bool(torch.isfinite(grad).all())
    assert math.isfinite(info.approx_kl_sum.item())


# ------------------------------------------------------------------------------ KL losses
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("which", ["rollout", "ref"])
def test_kl_loss_carries_the_analytic_gradient(which, estimator, agg):
    batch = make_batch(41, batch=5, length=6, policy_spread=0.8)
    zero_adv = np.zeros_like(batch["adv"])  # isolate the KL term
    coef = 0.7
    kw = {f"{which}_kl_coef": coef, f"{which}_kl_estimator": estimator}
    total, info, grad = run_impl(batch, PolicyLossConfig(aggregation=agg, **kw), None, adv=zero_adv)
    other = batch["rollout"] if which == "rollout" else batch["ref"]
    value, ref_grad = ref_kl_loss(batch["logprobs"], other, batch["mask"], estimator, agg)
    np.testing.assert_allclose(getattr(info, f"{which}_kl").item(), value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(total.item(), coef * value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad.numpy(), coef * ref_grad, rtol=RTOL, atol=ATOL)
    assert bool(grad.abs().sum() > 0), "the KL loss must carry gradient"


def test_low_var_kl_value_clamp_stops_gradient():
    # d = lp - ref = -15: k3 = e^15 - 1 - 15 > 10 -> clamped to 10, zero gradient.
    lp = torch.tensor([[-16.0]], requires_grad=True)
    loss, info = policy_loss(
        lp,
        lp.detach(),
        None,
        torch.zeros(1, 1),
        torch.ones(1, 1),
        PolicyLossConfig(ref_kl_coef=1.0, ref_kl_estimator="low_var_kl"),
        ref_logprobs=torch.tensor([[-1.0]]),
    )
    loss.backward()
    assert info.ref_kl.item() == pytest.approx(10.0)
    assert lp.grad.item() == 0.0


@pytest.mark.parametrize("d", [25.0, 1000.0])
def test_k3_kl_loss_beyond_the_clamp(d):
    """kl.py: ``k3 = exp(-d) - 1 + d`` (safe exp); only ``low_var_kl`` clamps ``d`` itself to [-20, 20].

    For d = 25: k3 = exp(-20) - 1 + 25 = 24.0000000021 and d k3 / d logprobs = 1 (the exp term is
    clamped, the linear term is not). A policy that drifts far above pi_rollout must keep being
    pulled back.
    """
    lp = torch.tensor([[-1.0]], requires_grad=True)  # pi_rollout gave the sampled token log prob -1 - d
    loss, info = policy_loss(
        lp,
        lp.detach(),
        torch.tensor([[-1.0 - d]]),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        PolicyLossConfig(rollout_kl_coef=1.0, rollout_kl_estimator="k3"),
    )
    loss.backward()
    assert info.rollout_kl.item() == pytest.approx(math.exp(-20.0) - 1.0 + d, rel=1e-6)
    assert lp.grad.item() == pytest.approx(1.0)


# ------------------------------------------------------------------------------ global counts
@pytest.mark.parametrize("agg", AGGREGATIONS + ["seq-mean-token-sum-norm-const"])
def test_split_batch_with_global_counts_equals_full_batch(agg):
    loss_cfg = PolicyLossConfig(**AGG_VARIANTS[agg], dual_clip=2.0, rollout_kl_coef=0.1, ref_kl_coef=0.05)
    corr_cfg = C(
        tis_level="token",
        tis_clip_high=1.1,
        token_mask=True,
        token_mask_low=0.9,
        token_mask_high=1.1,
        geo_mask=True,
        geo_mask_low=0.95,
        geo_mask_high=1.05,
    )
    batch = make_batch(51, batch=8, length=7, holes=True)
    full, _, full_grad = run_impl(batch, loss_cfg, corr_cfg)
    valid = batch["mask"] != 0
    n_tok, n_seq = float(valid.sum()), float(valid.any(1).sum())
    halves = [slice(0, 3), slice(3, 8)]  # unequal halves: a local mean would weigh them wrongly
    total, grads = 0.0, []
    for sl in halves:
        part = {k: v[sl] for k, v in batch.items()}
        loss, _, g = run_impl(part, loss_cfg, corr_cfg, token_count=n_tok, sequence_count=n_seq)
        total += loss.item()
        grads.append(g)
    np.testing.assert_allclose(total, full.item(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(torch.cat(grads).numpy(), full_grad.numpy(), rtol=RTOL, atol=ATOL)
    # and local counts would not add up (the override is doing something)
    local = sum(run_impl({k: v[sl] for k, v in batch.items()}, loss_cfg, corr_cfg)[0].item() for sl in halves)
    assert abs(local - full.item()) > 1e-4


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_counts_passed_in_override_the_denominators(agg):
    batch = make_batch(52, batch=5, length=6)
    loss_cfg = PolicyLossConfig(aggregation=agg, rollout_kl_coef=0.2)
    corr_cfg = C.token_tis(clip_high=1.1)
    total, info, grad = run_impl(batch, loss_cfg, corr_cfg, token_count=37.0, sequence_count=13.0)
    ref = run_ref(batch, loss_cfg, corr_cfg, token_count=37.0, sequence_count=13.0)
    assert_loss_matches(total, info, grad, ref)
    base = run_ref(batch, loss_cfg, corr_cfg)
    assert abs(ref.total - base.total) > 1e-4


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregate_matches_reference(agg):
    rng = np.random.default_rng(61)
    batch = make_batch(61, batch=6, length=5, holes=True)
    per_token = rng.normal(size=(6, 5)).astype(np.float32)
    kept = (batch["mask"] != 0) & (rng.random((6, 5)) < 0.7)
    per_token_garbage = np.where(kept, per_token, np.float32("nan")).astype(np.float32)
    got = aggregate(T(per_token_garbage), torch.as_tensor(kept), T(batch["mask"]), agg)
    expected = ref_aggregate(per_token, kept, batch["mask"], agg)
    np.testing.assert_allclose(got.item(), expected, rtol=RTOL, atol=ATOL)
    got = aggregate(
        T(per_token_garbage),
        torch.as_tensor(kept),
        T(batch["mask"]),
        agg,
        token_count=9.0,
        sequence_count=4.0,
        norm_constant=11.0,
    )
    expected = ref_aggregate(
        per_token, kept, batch["mask"], agg, token_count=9.0, sequence_count=4.0, norm_constant=11.0
    )
    np.testing.assert_allclose(got.item(), expected, rtol=RTOL, atol=ATOL)


def test_reference_correction_is_used_consistently():
    """Sanity of the harness itself: the loss reference and the correction reference agree on kept tokens."""
    batch = make_batch(71)
    cfg = C.geo_mis(low=0.95, high=1.05)
    ref = run_ref(batch, PolicyLossConfig(), cfg)
    assert ref.kept_tokens == int(ref_correction(batch["prox"], batch["rollout"], batch["mask"], cfg).kept.sum())


# ------------------------------------------------------------------------ bad values and shapes (issue 11 §5)
def _small():
    nan = float("nan")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lp = torch.tensor([[-1.0, -2.0, nan], [-1.0, -0.5, -0.3]])  # NaN in padding: allowed
    return mask, lp


@pytest.mark.parametrize(
    ("which", "value", "position"),
    [
        ("logprobs", float("nan"), (1, 1)),
        ("logprobs", float("-inf"), (0, 1)),
        ("prox_logprobs", float("nan"), (1, 2)),
        ("rollout_logprobs", float("nan"), (0, 0)),
        ("advantages", float("nan"), (1, 2)),
        ("advantages", float("inf"), (0, 1)),
    ],
)
def test_nan_at_a_response_token_is_refused_with_its_position(which, value, position):
    mask, lp = _small()
    args = dict(logprobs=lp, prox_logprobs=lp, rollout_logprobs=lp, advantages=torch.ones(2, 3))
    args[which] = args[which].clone()
    args[which][position] = value
    row, token = position
    with pytest.raises(
        ValueError, match=rf"policy_loss: {which} is {value} at a response token \(row {row}, token {token};"
    ):
        policy_loss(response_mask=mask, **args)


def test_nan_per_sequence_advantage_is_refused_with_its_row():
    mask, lp = _small()
    with pytest.raises(ValueError, match=r"policy_loss: advantages is nan at a response token \(row 1;"):
        policy_loss(lp, lp, lp, torch.tensor([1.0, float("nan")]), mask)
    # A row without any response token may carry a NaN advantage: it is padding.
    mask3 = torch.cat([mask, torch.zeros(1, 3)])
    lp3 = torch.cat([lp, torch.full((1, 3), float("nan"))])
    loss, _ = policy_loss(lp3, lp3, lp3, torch.tensor([1.0, 2.0, float("nan")]), mask3)
    assert loss.item() == pytest.approx(-(2 * 1.0 + 3 * 2.0) / 5)  # ratios 1: L = -A per token, token-mean


def test_bypass_does_not_read_prox_and_inf_in_rollout_keeps_the_clamped_loss():
    # Hand computation: bypass (anchor = rollout), A = 1, eps 0.2, token-mean over 2 tokens.
    # token 0: ratio 1 -> -1; token 1: rollout -inf -> ratio exp(20) -> clipped at 1.2 -> -1.2; loss -1.1.
    # Gradient into logprobs: token 0 -(1/2) * ratio = -0.5; token 1 clipped: 0.
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, float("-inf")]])
    mask = torch.ones(1, 2)
    corr = compute_correction(None, rollout, mask, C.bypass())
    garbage_prox = torch.full((1, 2), float("nan"))  # never read in bypass
    loss, info = policy_loss(lp, garbage_prox, rollout, torch.ones(1), mask, PolicyLossConfig(), correction=corr)
    loss.backward()
    assert loss.item() == pytest.approx(-1.1)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, 0.0]]))
    # k2 rollout KL: the -inf logprob counts as -1e6 (INFINITE_LOG_RATIO), d = -1 + 1e6: finite, loud; before: inf.
    assert info.rollout_kl_sum.item() == pytest.approx(0.5 * (1e6 - 1) ** 2)
    assert all(
        math.isfinite(float(getattr(info, f))) for f in info.__dataclass_fields__ if getattr(info, f) is not None
    )


def test_wrong_shapes_get_the_kits_own_error():
    mask, lp = _small()
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\): one per sequence needs 2 values"):
        policy_loss(lp, lp, lp, torch.ones(3), mask)  # before: torch's "The expanded size of the tensor ..."
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 2\)"):
        policy_loss(lp, lp, lp, torch.ones(2, 2), mask)
    # A correction of another batch (here [1, T] against [2, T]) was broadcast silently before.
    one_row = compute_correction(lp[:1], lp[:1], mask[:1], C.token_tis())
    with pytest.raises(
        ValueError, match=r"correction was computed for a batch of shape \(1, 3\), response_mask is \(2, 3\)"
    ):
        policy_loss(lp, lp, lp, torch.ones(2), mask, correction=one_row)


@pytest.mark.parametrize("fused", [False, True])
def test_prox_passed_as_pi_thetas_own_forward_trains_as_its_detached_copy(fused):
    """pi_prox given with pi_theta's graph (the same tensor, not detached): before, the loss value was
    the same but the gradient 0 (the ratio was exp(lp - lp)); now it is a constant, as detached."""
    from lightning_offpolicy.correction.fused import FusedCorrectionStep

    mask, _ = _small()
    loss_cfg = PolicyLossConfig(ref_kl_coef=0.1)
    grads = []
    for detach in (True, False):
        logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -0.5, -0.3]], requires_grad=True)
        args = dict(
            logprobs=logprobs,
            prox_logprobs=logprobs.detach() if detach else logprobs,
            rollout_logprobs=logprobs.detach() - 0.2,
            advantages=torch.tensor([1.0, -1.0]),
            response_mask=mask,
            ref_logprobs=logprobs * 1.0 - 0.3,  # a graph too: no gradient may flow through it either
        )
        if fused:
            loss = FusedCorrectionStep(OffPolicyCorrectionConfig(), loss_cfg, compiled=False)(**args).loss
        else:
            loss = policy_loss(loss_cfg=loss_cfg, **args)[0]
        loss.backward()
        grads.append(logprobs.grad)
    assert bool(grads[0].abs().sum() > 0)
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)
