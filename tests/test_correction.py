"""compute_correction against the float64 reference (tests/reference.py), hand-computed cases, properties."""

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

from reference import GARBAGE, make_batch, ref_correction  # noqa: E402

from lightning_offpolicy.correction import (  # noqa: E402
    PRESETS,
    OffPolicyCorrectionConfig,
    compute_correction,
)

RTOL, ATOL = 1e-5, 1e-6
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def T(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float32))


def run(batch: dict, cfg: OffPolicyCorrectionConfig, prox_none: bool = False):
    prox = None if prox_none else T(batch["prox"])
    return compute_correction(prox, T(batch["rollout"]), T(batch["mask"]), cfg)


def assert_matches_reference(batch: dict, cfg: OffPolicyCorrectionConfig, prox_none: bool = False) -> None:
    out = run(batch, cfg, prox_none)
    ref = ref_correction(None if prox_none else batch["prox"], batch["rollout"], batch["mask"], cfg)
    valid = batch["mask"] != 0

    np.testing.assert_array_equal(out.mask.numpy(), ref.mask, err_msg="mask")
    assert out.mask.dtype == torch.float32
    np.testing.assert_array_equal(out.stats.kept.numpy(), ref.kept, err_msg="stats.kept")

    weights = out.weights.numpy()
    assert out.weights.dtype == torch.float32
    if cfg.normalize_weights:
        # Weights that matter: kept tokens (normalised) and padding (1.0). A rejected token's weight
        # never reaches a loss, so it is not pinned down here.
        where = ref.kept | ~valid
    else:
        where = np.ones_like(valid)
    np.testing.assert_allclose(weights[where], ref.weights[where], rtol=RTOL, atol=ATOL, err_msg="weights")
    np.testing.assert_array_equal(weights[~valid], 1.0, err_msg="weights outside the response must be 1.0")

    st_ = out.stats
    np.testing.assert_allclose(st_.log_rho.numpy(), ref.log_rho, rtol=RTOL, atol=ATOL, err_msg="log_rho")
    abs_sum = np.abs(ref.log_rho).sum(axis=1)
    np.testing.assert_allclose(
        st_.seq_log_rho.numpy(),
        ref.seq_log_rho,
        rtol=RTOL,
        atol=ATOL * (1 + abs_sum).max(),
        err_msg="seq_log_rho",
    )
    np.testing.assert_array_equal(st_.seq_tokens.numpy(), ref.seq_tokens, err_msg="seq_tokens")
    np.testing.assert_array_equal(st_.seq_valid.numpy(), ref.seq_valid, err_msg="seq_valid")
    np.testing.assert_array_equal(st_.response_mask.numpy(), valid, err_msg="response_mask")
    np.testing.assert_array_equal(st_.weight_clipped.numpy(), ref.weight_clipped, err_msg="weight_clipped")
    assert st_.weight_level == cfg.tis_level
    assert set(st_.token_rejected) == set(ref.token_rejected), "mask names"
    for name, rej in ref.token_rejected.items():
        np.testing.assert_array_equal(st_.token_rejected[name].numpy(), rej, err_msg=f"token_rejected[{name}]")
        np.testing.assert_array_equal(
            st_.seq_rejected[name].numpy(), ref.seq_rejected[name], err_msg=f"seq_rejected[{name}]"
        )


# ------------------------------------------------------------------------------ presets vs reference
VARIANTS = {
    "tiny-spread": dict(seed=1, spread=0.004),
    "small-spread": dict(seed=2, spread=0.06),
    "medium-spread-holes": dict(seed=6, spread=0.15, holes=True),
    "wide-spread-holes": dict(seed=3, spread=0.5, holes=True),
    "huge-log-ratios": dict(seed=4, spread=0.05, huge=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_matches_reference(name, variant):
    cfg = PRESETS[name]()
    batch = make_batch(**VARIANTS[variant])
    assert_matches_reference(batch, cfg)


def test_every_preset_really_acts_on_the_batches():
    """Guard against vacuous preset tests: each masking preset rejects something somewhere."""
    for name in sorted(PRESETS):
        cfg = PRESETS[name]()
        rejected = 0
        for variant in VARIANTS.values():
            batch = make_batch(**variant)
            ref = ref_correction(batch["prox"], batch["rollout"], batch["mask"], cfg)
            rejected += int(((batch["mask"] != 0) & ~ref.kept).sum())
        if cfg.mask_names:
            assert rejected > 0, name


def test_bypass_accepts_prox_none():
    batch = make_batch(seed=5)
    cfg = OffPolicyCorrectionConfig.bypass()
    assert_matches_reference(batch, cfg, prox_none=True)
    out = run(batch, cfg, prox_none=True)
    assert torch.equal(out.weights, torch.ones_like(out.weights))
    assert torch.equal(out.mask, T(batch["mask"]))
    assert torch.equal(out.stats.log_rho, torch.zeros_like(out.stats.log_rho))


# ------------------------------------------------------------------------ hand-picked configs
C = OffPolicyCorrectionConfig
HAND_PICKED = {
    "token_tis_low_high": C(tis_level="token", tis_clip_low=0.95, tis_clip_high=1.05),
    "seq_tis_low_high": C(tis_level="sequence", tis_clip_low=0.8, tis_clip_high=1.3),
    "token_tis_normalized": C(tis_level="token", tis_clip_high=1.1, normalize_weights=True),
    "seq_tis_normalized_geo": C(
        tis_level="sequence",
        tis_clip_high=1.5,
        normalize_weights=True,
        geo_mask=True,
        geo_mask_low=0.97,
        geo_mask_high=1.03,
    ),
    "token_tis_normalized_token_mask": C(
        tis_level="token",
        tis_clip_high=3.0,
        normalize_weights=True,
        token_mask=True,
        token_mask_low=0.9,
        token_mask_high=1.1,
    ),
    "token_mask_then_seq_tis": C(
        token_mask=True, token_mask_low=0.9, token_mask_high=1.1, tis_level="sequence", tis_clip_high=5.0
    ),
    "token_mask_then_geo": C(
        token_mask=True,
        token_mask_low=0.95,
        token_mask_high=1.05,
        geo_mask=True,
        geo_mask_low=0.99,
        geo_mask_high=1.01,
    ),
    "token_mask_then_outlier": C(
        token_mask=True,
        token_mask_low=0.5,
        token_mask_high=2.0,
        outlier_token_veto=True,
        outlier_low=0.8,
        outlier_high=1.25,
    ),
    "product_narrow": C(product_mask=True, product_mask_low=0.9, product_mask_high=1.1),
    "outlier_narrow": C(outlier_token_veto=True, outlier_low=0.7, outlier_high=1.4),
    "everything": C(
        tis_level="token",
        tis_clip_low=0.5,
        tis_clip_high=1.2,
        normalize_weights=True,
        token_mask=True,
        token_mask_low=0.6,
        token_mask_high=1.6,
        geo_mask=True,
        geo_mask_low=0.9,
        geo_mask_high=1.1,
        product_mask=True,
        product_mask_low=0.5,
        product_mask_high=2.0,
        outlier_token_veto=True,
        outlier_low=0.4,
        outlier_high=2.5,
        kl_reject="k2",
        kl_reject_level="seq_max",
        kl_reject_threshold=0.08,
    ),
    "cispo_prox_token_tis": C(objective="cispo", anchor="prox", tis_level="token", tis_clip_high=1.1),
    "cispo_prox_seq_tis_geo": C(
        objective="cispo",
        anchor="prox",
        tis_level="sequence",
        tis_clip_high=1.5,
        geo_mask=True,
        geo_mask_low=0.95,
        geo_mask_high=1.05,
    ),
}
for _est in ("k1", "k2", "k3"):
    for _level, _thr in (("token", 0.005), ("seq_sum", 0.02), ("seq_mean", 0.004), ("seq_max", 0.01)):
        HAND_PICKED[f"kl_reject_{_est}_{_level}"] = C(
            kl_reject=_est, kl_reject_level=_level, kl_reject_threshold=_thr * (20 if _est == "k1" else 1)
        )
HAND_PICKED["kl_reject_token_then_seq_tis_normalized"] = C(
    kl_reject="k3",
    kl_reject_level="token",
    kl_reject_threshold=0.003,
    tis_level="sequence",
    tis_clip_high=2.0,
    normalize_weights=True,
)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(HAND_PICKED))
def test_hand_picked_config_matches_reference(name, variant):
    assert_matches_reference(make_batch(**VARIANTS[variant]), HAND_PICKED[name])


# ------------------------------------------------------------------------ tiny hand-computed cases
def test_hand_token_tis_docstring_example():
    # log_rho = [0.5, 0, pad]; rho_0 = e^0.5 = 1.6487 > 1.5 -> 1.5; rho_1 = 1; padding -> 1.0.
    out = compute_correction(
        torch.tensor([[-1.0, -2.0, float("nan")]]),
        torch.tensor([[-1.5, -2.0, float("inf")]]),
        torch.tensor([[1.0, 1.0, 0.0]]),
        OffPolicyCorrectionConfig.token_tis(clip_high=1.5),
    )
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.0, 1.0]]))
    torch.testing.assert_close(out.mask, torch.tensor([[1.0, 1.0, 0.0]]))
    assert out.stats.weight_clipped.tolist() == [[True, False, False]]


def test_hand_seq_tis():
    # log_rho = [0.2, -0.1, pad] -> S = 0.1 -> w = e^0.1 = 1.1051709 on both response tokens.
    out = compute_correction(
        torch.tensor([[-1.0, -1.0, float("nan")]]),
        torch.tensor([[-1.2, -0.9, -3.0]]),
        torch.tensor([[1.0, 1.0, 0.0]]),
        OffPolicyCorrectionConfig.seq_tis(clip_high=2.0),
    )
    torch.testing.assert_close(out.weights, torch.tensor([[1.1051709, 1.1051709, 1.0]]))
    torch.testing.assert_close(out.stats.seq_log_rho, torch.tensor([0.1]))


def test_hand_geo_mask():
    # log_rho = [0.2, -0.1, 0.1]: g = exp(0.2 / 3) = 1.0689 > 1.01 -> whole sequence rejected.
    prox, rollout = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.2, -0.9, -1.1]])
    mask = torch.ones(1, 3)
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.geo_mis())
    assert out.mask.tolist() == [[0.0, 0.0, 0.0]]
    assert out.stats.seq_rejected["geo_mask"].tolist() == [True]
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.geo_mis(low=0.9, high=1.1))
    assert out.mask.tolist() == [[1.0, 1.0, 1.0]]


def test_hand_token_mask_then_sequence_weight():
    # log_rho = [1.0, 0.1, -0.05]: rho_0 = e = 2.718 > 2 -> token 0 rejected (IcePop).
    # Sequence weight from the token-kept set: exp(0.1 - 0.05) = 1.0512711.
    cfg = OffPolicyCorrectionConfig(token_mask=True, tis_level="sequence", tis_clip_high=2.0)
    out = compute_correction(
        torch.tensor([[0.0, -0.9, -1.05]]), torch.tensor([[-1.0, -1.0, -1.0]]), torch.ones(1, 3), cfg
    )
    assert out.mask.tolist() == [[0.0, 1.0, 1.0]]
    torch.testing.assert_close(out.weights[0, 1:], torch.tensor([1.0512711, 1.0512711]))
    assert out.stats.token_rejected["token_mask"].tolist() == [[True, False, False]]


def test_hand_outlier_veto_reads_token_kept_set():
    # log_rho = [5, 0.1, 0]: rho_0 = 148 > 100.
    prox, rollout = torch.tensor([[4.0, -0.9, -1.0]]), torch.tensor([[-1.0, -1.0, -1.0]])
    out = compute_correction(prox, rollout, torch.ones(1, 3), OffPolicyCorrectionConfig.outlier_veto())
    assert out.mask.tolist() == [[0.0, 0.0, 0.0]]
    # With IcePop first, token 0 is already gone and does not condemn its sequence again.
    cfg = OffPolicyCorrectionConfig(token_mask=True, outlier_token_veto=True)
    out = compute_correction(prox, rollout, torch.ones(1, 3), cfg)
    assert out.mask.tolist() == [[0.0, 1.0, 1.0]]
    assert out.stats.token_rejected["outlier_veto"].tolist() == [[False, False, False]]


@pytest.mark.parametrize(
    "level, threshold, expected",
    [
        # k3(0.2) = 0.0214028, k3(-0.2) = 0.0187308, k3(0) = 0
        ("seq_mean", 0.01, [0, 0, 0]),  # mean 0.0133778 > 0.01
        ("seq_mean", 0.02, [1, 1, 1]),
        ("seq_max", 0.02, [0, 0, 0]),  # max 0.0214 > 0.02
        ("seq_sum", 0.04, [0, 0, 0]),  # sum 0.0401335 > 0.04
        ("seq_sum", 0.041, [1, 1, 1]),
        ("token", 0.02, [0, 1, 1]),
    ],
)
def test_hand_k3_rejection(level, threshold, expected):
    prox, rollout = torch.tensor([[-0.8, -1.2, -1.0]]), torch.tensor([[-1.0, -1.0, -1.0]])
    cfg = OffPolicyCorrectionConfig(kl_reject="k3", kl_reject_level=level, kl_reject_threshold=threshold)
    out = compute_correction(prox, rollout, torch.ones(1, 3), cfg)
    assert out.mask[0].tolist() == [float(e) for e in expected]


def test_hand_seq_mean_counts_kept_tokens_not_padding():
    # log_rho = [0.2, -0.2, pad, pad]: mean k3 over the 2 response tokens = 0.0401335 / 2 = 0.0200668 > 0.015
    # (dividing by the padded length 4 would give 0.0100334 and keep it).
    prox = torch.tensor([[-0.8, -1.2, float("nan"), 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, 0.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    cfg = OffPolicyCorrectionConfig(kl_reject="k3", kl_reject_level="seq_mean", kl_reject_threshold=0.015)
    assert compute_correction(prox, rollout, mask, cfg).mask.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    cfg = cfg.replace(kl_reject_threshold=0.021)
    assert compute_correction(prox, rollout, mask, cfg).mask.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_hand_normalized_token_weights():
    # rho = [0.5, 1, 3] capped at 2 -> [0.5, 1, 2], mean 7/6 -> [3/7, 6/7, 12/7]; padding stays 1.
    prox = torch.tensor([[math.log(0.5), 0.0, math.log(3.0), float("nan")]])
    cfg = OffPolicyCorrectionConfig(tis_level="token", tis_clip_high=2.0, normalize_weights=True)
    out = compute_correction(prox, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 1.0, 0.0]]), cfg)
    torch.testing.assert_close(out.weights, torch.tensor([[3 / 7, 6 / 7, 12 / 7, 1.0]]))


def test_hand_huge_log_ratios():
    # log_rho = [+1000, -1000]: safe exp clamps at exp(+-20); the token weight is capped at 2,
    # the IcePop mask drops both (decided in log space), the sequence sum is 0 -> weight 1.
    prox, rollout = torch.tensor([[0.0, -1000.0]]), torch.tensor([[-1000.0, 0.0]])
    mask = torch.ones(1, 2)
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.token_tis(clip_low=0.5))
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 0.5]]))
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.token_mis())
    assert out.mask.tolist() == [[0.0, 0.0]]
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.seq_tis())
    torch.testing.assert_close(out.weights, torch.ones(1, 2))
    out = compute_correction(prox[:, :1], rollout[:, :1], mask[:, :1], OffPolicyCorrectionConfig.seq_tis(clip_high=1e9))
    torch.testing.assert_close(out.weights, torch.tensor([[math.exp(20.0)]]))


def test_row_without_response_tokens_is_harmless():
    cfg = OffPolicyCorrectionConfig(
        geo_mask=True,
        geo_mask_low=1.5,
        geo_mask_high=2.0,
        tis_level="sequence",
        tis_clip_high=2.0,
        normalize_weights=True,
    )
    nan = float("nan")
    out = compute_correction(torch.tensor([[nan, nan]]), torch.tensor([[nan, nan]]), torch.zeros(1, 2), cfg)
    assert torch.equal(out.weights, torch.ones(1, 2))
    assert torch.equal(out.mask, torch.zeros(1, 2))
    assert out.stats.seq_valid.tolist() == [False]
    assert out.stats.seq_tokens.tolist() == [0.0]
    assert all(not v.any() for v in out.stats.seq_rejected.values())


# ------------------------------------------------------------------------------ property tests
@st.composite
def correction_configs(draw) -> OffPolicyCorrectionConfig:
    if draw(st.integers(0, 4)) == 0:
        objective = draw(st.sampled_from(["ppo", "pure_is", "cispo"]))
        return C(
            bypass_mode=True,
            objective=objective,
            anchor="rollout",
            objective_level=draw(st.sampled_from(["token", "sequence"])),
        )
    kw: dict = {}
    tis = draw(st.sampled_from([None, "token", "sequence"]))
    if tis is not None:
        kw.update(
            tis_level=tis,
            tis_clip_high=draw(st.sampled_from([0.9, 1.05, 2.0, 1e3])),
            tis_clip_low=draw(st.sampled_from([None, 0.5, 0.9])),
            normalize_weights=draw(st.booleans()),
        )
    if draw(st.booleans()):
        kw.update(
            token_mask=True,
            token_mask_low=draw(st.sampled_from([0.5, 0.9])),
            token_mask_high=draw(st.sampled_from([1.1, 2.0])),
        )
    if draw(st.booleans()):
        kw.update(
            geo_mask=True,
            geo_mask_low=draw(st.sampled_from([0.9, 0.99])),
            geo_mask_high=draw(st.sampled_from([1.01, 1.1])),
        )
    if draw(st.booleans()):
        kw.update(product_mask=True, product_mask_low=0.5, product_mask_high=draw(st.sampled_from([1.5, 2.0])))
    if draw(st.booleans()):
        kw.update(
            outlier_token_veto=True,
            outlier_low=draw(st.sampled_from([1e-4, 0.3])),
            outlier_high=draw(st.sampled_from([3.0, 100.0])),
        )
    if draw(st.booleans()):
        kw.update(
            kl_reject=draw(st.sampled_from(["k1", "k2", "k3"])),
            kl_reject_level=draw(st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"])),
            kl_reject_threshold=draw(st.sampled_from([0.003, 0.03, 0.3])),
        )
    if tis is not None:
        if draw(st.booleans()):
            kw.update(objective="cispo", anchor="prox")
    else:
        kw.update(
            objective=draw(st.sampled_from(["ppo", "pure_is", "cispo"])),
            anchor=draw(st.sampled_from(["rollout", "prox"])),
        )
    return C(**kw)


batches = st.builds(
    lambda seed, b, t, spread, huge, holes: make_batch(seed, b, t, spread=spread, huge=huge, holes=holes),
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 5),
    t=st.integers(1, 7),
    spread=st.sampled_from([0.003, 0.05, 0.4, 2.0]),
    huge=st.booleans(),
    holes=st.booleans(),
)


@SETTINGS
@given(cfg=correction_configs(), batch=batches)
def test_property_random_config_matches_reference(cfg, batch):
    assert_matches_reference(batch, cfg)


@SETTINGS
@given(cfg=correction_configs(), batch=batches)
def test_property_outputs_are_detached(cfg, batch):
    prox = T(batch["prox"]).requires_grad_(True)
    rollout = T(batch["rollout"]).requires_grad_(True)
    out = compute_correction(prox * 1.0, rollout * 1.0, T(batch["mask"]), cfg)
    tensors = [
        out.weights,
        out.mask,
        out.stats.log_rho,
        out.stats.seq_log_rho,
        out.stats.weights,
        out.stats.seq_tokens,
        *out.stats.token_rejected.values(),
    ]
    for x in tensors:
        assert not x.requires_grad and x.grad_fn is None


@SETTINGS
@given(cfg=correction_configs(), batch=batches)
def test_property_masks_only_remove_tokens(cfg, batch):
    out = run(batch, cfg)
    response = T(batch["mask"])
    assert bool((out.mask <= response).all())
    assert set(out.mask.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(out.stats.kept, out.mask.bool())
    for name, rej in out.stats.token_rejected.items():
        assert not bool((rej & ~response.bool()).any()), name
        assert not bool((rej & out.stats.kept).any()), name


@SETTINGS
@given(cfg=correction_configs(), batch=batches, extra=st.sampled_from(["geo", "product", "outlier", "kl"]))
def test_property_adding_a_sequence_mask_only_removes(cfg, batch, extra):
    if cfg.bypass_mode:
        return
    more = {
        "geo": dict(geo_mask=True, geo_mask_low=0.98, geo_mask_high=1.02),
        "product": dict(product_mask=True, product_mask_low=0.7, product_mask_high=1.3),
        "outlier": dict(outlier_token_veto=True, outlier_low=0.6, outlier_high=1.6),
        "kl": dict(kl_reject="k2", kl_reject_level="seq_mean", kl_reject_threshold=0.01),
    }[extra]
    already = {
        "geo": cfg.geo_mask,
        "product": cfg.product_mask,
        "outlier": cfg.outlier_token_veto,
        "kl": cfg.kl_reject is not None,
    }[extra]
    if already:  # replacing its bounds could loosen it
        return
    base = run(batch, cfg)
    stricter = run(batch, cfg.replace(**more))
    assert bool((stricter.mask <= base.mask).all())


@SETTINGS
@given(cfg=correction_configs(), batch=batches, seed=st.integers(0, 10**6))
def test_property_padding_garbage_has_no_effect(cfg, batch, seed):
    rng = np.random.default_rng(seed)
    other = dict(batch)
    pad = batch["mask"] == 0
    for name in ("prox", "rollout"):
        fill = rng.choice(np.array(GARBAGE + (0.0, -3.0), dtype=np.float32), size=pad.shape)
        other[name] = np.where(pad, fill, batch[name]).astype(np.float32)
    a, b = run(batch, cfg), run(other, cfg)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(a.mask, b.mask)
    for field in ("log_rho", "seq_log_rho", "seq_tokens", "seq_valid", "kept", "weights", "weight_clipped"):
        assert torch.equal(getattr(a.stats, field), getattr(b.stats, field)), field
    assert a.stats.token_rejected.keys() == b.stats.token_rejected.keys()
    for name in a.stats.token_rejected:
        assert torch.equal(a.stats.token_rejected[name], b.stats.token_rejected[name])
        assert torch.equal(a.stats.seq_rejected[name], b.stats.seq_rejected[name])


@SETTINGS
@given(
    cfg=correction_configs(),
    seed=st.integers(0, 10**6),
    sign=st.sampled_from([-1.0, 1.0]),
    magnitude=st.sampled_from([50.0, 1000.0, 1e6]),
)
def test_property_huge_log_ratios_stay_finite(cfg, seed, sign, magnitude):
    batch = make_batch(seed, 4, 6, spread=0.1)
    valid = batch["mask"] != 0
    rng = np.random.default_rng(seed)
    hit = valid & (rng.random(valid.shape) < 0.5)
    batch["prox"] = np.where(hit, batch["rollout"] + sign * magnitude, batch["prox"]).astype(np.float32)
    out = run(batch, cfg)
    assert bool(torch.isfinite(out.weights).all())
    assert bool(torch.isfinite(out.mask).all())
    assert bool(torch.isfinite(out.stats.log_rho).all())
    assert bool(torch.isfinite(out.stats.seq_log_rho).all())
    assert bool((out.weights > 0).all())


@SETTINGS
@given(cfg=correction_configs(), batch=batches)
def test_property_stats_consistent(cfg, batch):
    out = run(batch, cfg)
    s = out.stats
    response = T(batch["mask"]).bool()
    assert torch.equal(s.response_mask, response)
    assert torch.equal(s.seq_tokens, response.float().sum(-1))
    assert torch.equal(s.seq_valid, s.seq_tokens > 0)
    assert torch.equal(s.weights, out.weights)
    assert not bool((s.kept & ~response).any())
    assert not bool((s.weight_clipped & ~response).any())
    assert not bool((s.log_rho[~response] != 0).any())
    for name, rej in s.seq_rejected.items():
        assert not bool((rej & ~s.seq_valid).any()), name
        assert torch.equal(rej, s.seq_valid & s.token_rejected[name].any(-1)), name
    assert set(s.token_rejected) == set(cfg.mask_names)
    if cfg.tis_level is None:
        assert torch.equal(out.weights, torch.ones_like(out.weights))


# ------------------------------------------------------------------------ NaN / inf at response tokens (issue 11 §5)
@pytest.mark.parametrize("which", ["prox_logprobs", "rollout_logprobs"])
def test_nan_at_a_response_token_is_refused_with_its_position(which):
    nan = float("nan")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    good = torch.tensor([[-1.0, -2.0, nan], [-1.0, -0.5, -0.3]])  # NaN in padding: allowed
    bad = good.clone()
    bad[1, 2] = nan
    args = {"prox_logprobs": good, "rollout_logprobs": good, which: bad}
    with pytest.raises(ValueError, match=rf"compute_correction: {which} is nan at a response token \(row 1, token 2;"):
        compute_correction(args["prox_logprobs"], args["rollout_logprobs"], mask, OffPolicyCorrectionConfig.token_tis())
    if which == "prox_logprobs":  # bypass never reads prox: nothing to refuse
        out = compute_correction(bad, good, mask, OffPolicyCorrectionConfig.bypass())
        assert torch.isfinite(out.weights).all()


def test_infinite_logprob_at_a_response_token_gives_clamped_finite_outputs():
    inf = float("inf")
    # Row 0: the engine calls token 1 impossible (rollout -inf, counted as -1e6): log_rho = -1 + 1e6.
    # Row 1: both call token 0 impossible: -inf - -inf -> 0 (equal), token 1 log_rho = 0.1.
    prox = torch.tensor([[-1.0, -1.0, -1.0], [-inf, -1.0, 0.0]])
    rollout = torch.tensor([[-1.0, -inf, -1.0], [-inf, -1.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.token_tis(clip_high=2.0))
    torch.testing.assert_close(out.stats.log_rho, torch.tensor([[0.0, 1e6 - 1, 0.0], [0.0, 0.1, 0.0]]))
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 2.0, 1.0], [1.0, math.exp(0.1), 1.0]]))
    # A sequence mask rejects the row with the infinite token (geometric mean exp(~1e6 / 3)), keeps the other.
    geo = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig(geo_mask=True, geo_mask_high=2.0))
    assert geo.mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert all(torch.isfinite(v).all() for v in (out.stats.seq_log_rho, geo.stats.seq_log_rho, geo.weights))
