"""M2PO (AReaL's second-moment mask) against AReaL's own code, in float64.

The reference is written from AReaL 4aef98d, not from the kit: ``areal/trainer/ppo/actor.py``
``grpo_loss_fn`` calls ``_apply_m2po_masking(old_logp, prox_logp, loss_mask, m2_threshold)`` before
the loss (``old_logp``: the behaviour log-probs of the inference engine, the kit's ``pi_rollout``;
``prox_logp``: the recomputed proximal ones, the kit's ``pi_prox``). It squares ``old - prox`` on the
loss-mask tokens, sorts them descending, and ``_get_m2po_loss_mask`` masks the first ``k``, ``k`` the
first index whose suffix mean is below the threshold, else ``n - 1``. ``ppo_actor_loss_fn``
(``areal/utils/functional/functional.py``) then takes the decoupled PPO loss over the M2PO-kept
tokens and divides by their count; the kit keeps the rejected tokens in its denominator, so the two
losses differ by the factor ``kept / response tokens``, asserted below.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from functools import partial

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from reference import ref_correction  # noqa: E402

from lightning_offpolicy.correction import (  # noqa: E402
    CorrectionConfigError,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.correction.peer_names import PeerNameWarning  # noqa: E402
from lightning_offpolicy.metrics.correction import CorrectionMetrics  # noqa: E402

C = OffPolicyCorrectionConfig
RTOL = 2e-5


def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float32))


def _batch(seed: int = 0, spread: float = 0.25) -> dict[str, np.ndarray]:
    """Seven rows, one with no response token, NaN padding; the float32 values, exactly, in float64."""
    rng = np.random.default_rng(seed)
    lengths = np.array([12, 9, 0, 5, 11, 3, 7])
    batch, length = len(lengths), 12
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    rollout = -rng.exponential(1.0, (batch, length)) - 0.1
    prox = rollout + rng.normal(0.0, spread, (batch, length))
    theta = prox + rng.normal(0.0, 0.1, (batch, length))
    adv = np.repeat(rng.normal(0.0, 1.0, (batch, 1)), length, axis=1)
    out = {"prox": prox, "rollout": rollout, "theta": theta, "adv": adv, "mask": mask}
    out = {k: v.astype(np.float32).astype(np.float64) for k, v in out.items()}
    for name in ("prox", "rollout", "theta", "adv"):
        out[name] = np.where(mask == 0, np.nan, out[name])
    return out


def _areal_suffix_means(old, prox, loss_mask) -> tuple[list[tuple[int, int]], list[int], list[float]]:
    """``_apply_m2po_masking``'s selected tokens (row-major, as ``view(-1)[mask]``), their descending
    order, and ``_get_m2po_loss_mask``'s ``avg_m2_suffix``."""
    cells = [(i, t) for i in range(old.shape[0]) for t in range(old.shape[1]) if loss_mask[i, t]]
    m2 = [(old[i, t] - prox[i, t]) * (old[i, t] - prox[i, t]) for i, t in cells]
    order = sorted(range(len(cells)), key=lambda c: -m2[c])  # torch.sort(descending=True); no ties here
    n = len(cells)
    suffix = [sum(m2[order[j]] for j in range(k, n)) / (n - k) for k in range(n)]
    return cells, order, suffix


def _areal_m2po_mask(old, prox, loss_mask, threshold) -> np.ndarray:
    """The loss mask after ``_apply_m2po_masking`` (bool)."""
    keep = loss_mask.astype(bool).copy()
    cells, order, suffix = _areal_suffix_means(old, prox, loss_mask)
    if not cells:
        return keep
    below = [k for k, value in enumerate(suffix) if value < threshold]
    num_to_mask = below[0] if below else len(cells) - 1
    for j in range(num_to_mask):
        keep[cells[order[j]]] = False
    return keep


def _areal_ppo_actor_loss(theta, prox, adv, loss_mask, eps_clip=0.2, c_clip=3.0) -> tuple[float, np.ndarray]:
    """``ppo_actor_loss_fn`` (token level, no rejection sampling): value and gradient w.r.t. ``theta``."""
    count = max(int(loss_mask.sum()), 1)  # loss_mask.count_nonzero() or 1: after M2PO
    total, grad = 0.0, np.zeros(theta.shape)
    for i in range(theta.shape[0]):
        for t in range(theta.shape[1]):
            if not loss_mask[i, t]:
                continue
            a, ratio = adv[i, t], math.exp(theta[i, t] - prox[i, t])
            pg1, pg2 = -a * ratio, -a * min(max(ratio, 1 - eps_clip), 1 + eps_clip)
            value, d = (pg1, -a * ratio) if pg1 >= pg2 else (pg2, 0.0)
            pg3 = math.copysign(1.0, a) * c_clip * a  # torch.sign(advantages) * c_clip * advantages
            if pg3 < value:
                value, d = pg3, 0.0
            total += value / count
            grad[i, t] = d / count
    return total, grad


def _thresholds(batch) -> dict[str, float]:
    """Thresholds half-way between consecutive suffix means: every cut is decided with a margin."""
    _, _, suffix = _areal_suffix_means(batch["rollout"], batch["prox"], batch["mask"] != 0)
    n = len(suffix)
    return {
        "keeps_all": suffix[0] * 1.5,
        "cuts_a_few": 0.5 * (suffix[3] + suffix[4]),
        "cuts_a_third": 0.5 * (suffix[n // 3] + suffix[n // 3 + 1]),
        "all_but_one": min(suffix) * 0.5,
    }


@pytest.mark.parametrize("cut", ["keeps_all", "cuts_a_few", "cuts_a_third", "all_but_one", "default"])
def test_m2po_equals_areal(cut):
    batch = _batch()
    threshold = 0.04 if cut == "default" else _thresholds(batch)[cut]
    with pytest.warns(PeerNameWarning, match="AReaL's m2_threshold"):
        cfg = C.from_peer_names(m2_threshold=threshold)
    assert cfg == C.m2po(threshold=threshold)
    mask = batch["mask"] != 0
    expected = _areal_m2po_mask(batch["rollout"], batch["prox"], mask, threshold)
    theta = _f32(batch["theta"]).requires_grad_(True)
    prox, rollout, adv, response = (_f32(batch[k]) for k in ("prox", "rollout", "adv", "mask"))
    out = compute_correction(prox, rollout, response, cfg)
    np.testing.assert_array_equal(out.mask.numpy() != 0, expected)
    assert torch.equal(out.weights, torch.ones_like(out.weights))
    kept, total = int(expected.sum()), int(mask.sum())
    if cut == "keeps_all":
        assert kept == total
    elif cut == "all_but_one":
        assert kept == 1
    else:
        assert 1 < kept < total
    loss, info = policy_loss(theta, prox, rollout, adv, response, PolicyLossConfig(dual_clip=3.0), correction=out)
    loss.backward()
    value, grad = _areal_ppo_actor_loss(batch["theta"], batch["prox"], batch["adv"], expected)
    # AReaL divides by the tokens M2PO kept, the kit by every response token.
    scale = kept / total
    assert float(loss.detach()) == pytest.approx(value * scale, rel=RTOL, abs=1e-7)
    np.testing.assert_allclose(theta.grad.double().numpy()[mask], grad[mask] * scale, rtol=RTOL, atol=1e-7)
    assert int(info.kept_tokens) == kept and int(info.response_tokens) == total


def test_m2po_rejects_an_impossible_token_first_and_an_empty_batch_is_untouched():
    batch = _batch(seed=3, spread=0.05)
    rollout = _f32(batch["rollout"])
    rollout[0, 4] = float("-inf")  # a token the engine called impossible: log ratio ~ +1e6
    prox, response = _f32(batch["prox"]), _f32(batch["mask"])
    out = compute_correction(prox, rollout, response, C.m2po())
    rejected = (response != 0) & (out.mask == 0)
    assert bool(rejected[0, 4]) and int(rejected.sum()) == 1, "the rest has a second moment below 0.04"
    empty = torch.zeros_like(response)
    assert torch.equal(compute_correction(prox, rollout, empty, C.m2po()).mask, empty)


def test_m2po_rate_is_a_rejection_metric():
    batch = _batch()
    cfg = C.m2po(threshold=_thresholds(batch)["cuts_a_third"])
    out = compute_correction(_f32(batch["prox"]), _f32(batch["rollout"]), _f32(batch["mask"]), cfg)
    metrics = CorrectionMetrics(cfg)
    metrics.update(stats=out.stats)
    values = metrics.compute()
    response = batch["mask"] != 0
    rejected = response & (out.mask.numpy() == 0)
    assert float(values["rollout_corr/m2po_mask_token_reject_rate"]) == pytest.approx(rejected.sum() / response.sum())
    rows = response.any(axis=1)
    assert float(values["rollout_corr/m2po_mask_seq_reject_rate"]) == pytest.approx(
        rejected.any(axis=1).sum() / rows.sum()
    )
    assert cfg.mask_names == ["m2po_mask"]


def test_m2po_combines_with_the_other_masks_as_a_token_mask():
    """Tested on every response token (it overlaps the IcePop mask), applied before the sequence
    masks, whose statistics read the tokens it kept: as tests/reference.py computes it."""
    batch = _batch()
    threshold = _thresholds(batch)["cuts_a_few"]
    prox, rollout, response = _f32(batch["prox"]), _f32(batch["rollout"]), _f32(batch["mask"])
    cfg = C.token_mis(0.7, 1.4).replace(m2po_mask=True, m2po_threshold=threshold, geo_mask=True)
    cfg = cfg.replace(geo_mask_low=0.9, geo_mask_high=1.1)
    out = compute_correction(prox, rollout, response, cfg)
    assert cfg.mask_names == ["token_mask", "m2po_mask", "geo_mask"]
    ref = ref_correction(batch["prox"], batch["rollout"], batch["mask"], cfg)
    np.testing.assert_array_equal(out.mask.numpy(), ref.mask)
    for name, rejected in ref.token_rejected.items():
        np.testing.assert_array_equal(out.stats.token_rejected[name].numpy(), rejected, err_msg=name)
    alone = compute_correction(prox, rollout, response, C.m2po(threshold=threshold)).mask
    assert torch.equal(out.stats.token_rejected["m2po_mask"], (response != 0) & (alone == 0))
    assert all(out.stats.token_rejected[name].any() for name in cfg.mask_names), "every mask acts here"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(m2po_mask=True, m2po_threshold=0.0), "m2po_threshold"),
        (dict(m2po_mask=True, m2po_threshold=float("inf")), "m2po_threshold"),
        (dict(m2po_mask=True, bypass_mode=True), "m2po_mask=True .* bypass_mode=True"),
        (dict(m2_threshold=0.04, bypass_mode=True), "bypass_mode"),
    ],
)
def test_m2po_settings_are_validated_by_name(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        with pytest.raises(CorrectionConfigError, match=message):
            C.from_peer_names(**kwargs)


def test_the_module_refuses_m2po_with_the_fused_loss():
    """The fused step computes the correction per micro-batch; M2PO ranks the tokens of the whole batch."""
    from lightning_offpolicy import OffPolicyRLModule
    from tests.module_helpers import TOKENIZER, tiny_model

    build = partial(OffPolicyRLModule, model=tiny_model(), tokenizer=TOKENIZER, correction=C.m2po())
    with pytest.raises(ValueError, match=r"fused_loss=True .* correction\.m2po_mask ranks the response tokens"):
        build(fused_loss=True)
    assert C.m2po().whole_batch_settings.keys() == {"m2po_mask"}
    assert build(fused_loss=False).correction == C.m2po()
