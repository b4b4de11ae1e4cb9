"""OPSM (DeepSeek-V3.2's off-policy sequence masking) against the peers' own definitions, in float64.

The references below are plain loops written from the peers' code, not from the kit's:

* slime 624b824, ``slime/utils/ppo_utils.py``: ``compute_opsm_mask`` (per sample
  ``seq_kl = sum((old - log_probs) * loss_mask) / max(sum(loss_mask), 1)``, a token is dropped where
  ``advantage < 0`` and ``seq_kl > opsm_delta``), ``compute_policy_loss`` (the PPO clip on
  ``exp(log_probs - old)``), and ``slime/backends/megatron_utils/loss.py``
  ``policy_loss_function`` (``pg_loss * opsm_mask``, then ``sum_of_sample_mean``: each sample's
  masked sum over its own ``loss_mask`` count; ``old`` = the recomputed log-probs).
* TRL f2cd577, ``trl/trainer/grpo_trainer.py``: ``get_off_policy_mask`` (``avg_seq_kl`` of
  ``sampling_per_token_logps - per_token_logps.detach()`` over the completion mask; keep where
  ``advantages >= 0`` or ``avg_seq_kl <= threshold``), ``_compute_loss`` (``per_token_loss`` =
  ``-min(coef_1 A, coef_2 A)`` times the mask, times the vLLM importance sampling ratio;
  ``loss_type="bnpo"``: sum over the completion mask / its count) and the ``token_truncate``
  importance sampling ratio of ``_generate_and_score_completions``.

Each test builds the kit's config from the peer's own setting names, so the mapping is checked too.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from reference import make_batch, ref_policy_loss  # noqa: E402

from lightning_offpolicy.correction import (  # noqa: E402
    CorrectionConfigError,
    CorrectionOutput,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.correction.masks import off_policy_sequence_mask  # noqa: E402
from lightning_offpolicy.correction.peer_names import PeerNameWarning  # noqa: E402
from lightning_offpolicy.metrics.correction import PolicyLossMetrics  # noqa: E402

C = OffPolicyCorrectionConfig
RTOL = 2e-5


def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float32))


ROLLOUT_SHIFT = np.array([0.30, -0.10, 0.05, 0.20, 0.45, 0.0])
PROX_SHIFT = np.array([0.15, -0.05, 0.02, 0.12, 0.30, 0.0])


def _batch(seed: int = 0, prox_shift: np.ndarray = PROX_SHIFT) -> dict[str, np.ndarray]:
    """Six rows of distinct off-policyness: in row ``i`` the engine is ``ROLLOUT_SHIFT[i]`` nats per
    token more confident than ``pi_theta`` and the proximal policy ``prox_shift[i]``, so the mean log
    ratios are about those shifts (never within 1e-3 of the thresholds used below). Row 5 has no
    response token; padding holds NaN."""
    rng = np.random.default_rng(seed)
    lengths = np.array([10, 7, 9, 4, 6, 0])
    batch, length = len(ROLLOUT_SHIFT), 10
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    theta = -rng.exponential(1.0, (batch, length)) - 0.5
    prox = theta + prox_shift[:, None] + rng.normal(0.0, 0.01, (batch, length))
    rollout = theta + ROLLOUT_SHIFT[:, None] + rng.normal(0.0, 0.01, (batch, length))
    # Per-token advantages: rows 0 and 4 negative throughout, row 3 of mixed sign, the others positive.
    adv = np.abs(rng.normal(0.5, 0.3, (batch, length))) + 0.1
    adv[0] *= -1.0
    adv[4] *= -1.0
    adv[3, ::2] *= -1.0
    out = {"prox": prox, "theta": theta, "rollout": rollout, "adv": adv, "mask": mask}
    out = {k: v.astype(np.float32).astype(np.float64) for k, v in out.items()}  # the float32 values, exactly
    for name in ("prox", "theta", "rollout", "adv"):
        out[name] = np.where(mask == 0, np.nan, out[name])
    return out


def _slime_opsm_mask(theta, old, adv, mask, delta) -> np.ndarray:
    """slime's ``compute_opsm_mask``: 1 keeps, 0 drops (per token: its advantages are per token)."""
    keep = np.ones(theta.shape)
    for i in range(theta.shape[0]):
        tokens = [t for t in range(theta.shape[1]) if mask[i, t]]
        seq_kl = sum(old[i, t] - theta[i, t] for t in tokens) / max(len(tokens), 1)
        for t in tokens:
            keep[i, t] = 0.0 if (adv[i, t] < 0 and seq_kl > delta) else 1.0
    return keep


def _slime_loss(theta, old, adv, mask, opsm, eps_clip=0.2, eps_clip_high=0.2) -> tuple[float, np.ndarray]:
    """slime's ``compute_policy_loss`` times the OPSM mask, reduced by ``sum_of_sample_mean`` and
    divided by the number of samples (slime's per-step normalisation); value and gradient."""
    total, grad = 0.0, np.zeros(theta.shape)
    n_samples = theta.shape[0]
    for i in range(theta.shape[0]):
        count = max(float(mask[i].sum()), 1.0)
        for t in range(theta.shape[1]):
            if not mask[i, t]:
                continue
            a, ratio = adv[i, t], math.exp(theta[i, t] - old[i, t])
            loss1, loss2 = -ratio * a, -min(max(ratio, 1 - eps_clip), 1 + eps_clip_high) * a
            value, d = (loss1, -ratio * a) if loss1 >= loss2 else (loss2, 0.0)
            total += value * opsm[i, t] / count / n_samples
            grad[i, t] = d * opsm[i, t] / count / n_samples
    return total, grad


def _trl_opsm_mask(theta, sampling, adv_seq, mask, threshold) -> np.ndarray:
    """TRL's ``get_off_policy_mask`` broadcast over the tokens: 1 keeps, 0 drops."""
    keep = np.ones(theta.shape)
    for i in range(theta.shape[0]):
        kl = sum((sampling[i, t] - theta[i, t]) if mask[i, t] else 0.0 for t in range(theta.shape[1]))
        avg = kl / max(float(mask[i].sum()), 1.0)
        keep[i, :] = 1.0 if (adv_seq[i] >= 0 or avg <= threshold) else 0.0
    return keep


def _trl_is_ratio_token_truncate(old, sampling, mask, clip_max) -> np.ndarray:
    ratio = np.ones(old.shape)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            diff = (old[i, t] - sampling[i, t]) if mask[i, t] else 0.0
            ratio[i, t] = min(math.exp(diff), clip_max)
    return ratio


def _trl_bnpo_loss(theta, old, adv_seq, mask, opsm, is_ratio, eps=0.2) -> tuple[float, np.ndarray]:
    """TRL's ``_compute_loss`` with ``loss_type="bnpo"``: value and gradient w.r.t. ``theta``."""
    total, grad = 0.0, np.zeros(theta.shape)
    count = max(float(mask.sum()), 1.0)
    for i in range(theta.shape[0]):
        for t in range(theta.shape[1]):
            if not mask[i, t]:
                continue
            a, coef_1 = adv_seq[i], math.exp(theta[i, t] - old[i, t])
            coef_2 = min(max(coef_1, 1 - eps), 1 + eps)
            value, d = (-coef_1 * a, -coef_1 * a) if coef_1 * a <= coef_2 * a else (-coef_2 * a, 0.0)
            total += value * opsm[i, t] * is_ratio[i, t] / count
            grad[i, t] = d * opsm[i, t] * is_ratio[i, t] / count
    return total, grad


def _kit_loss(batch, cfg, loss_cfg, adv):
    theta = _f32(batch["theta"]).requires_grad_(True)
    prox, rollout, mask = _f32(batch["prox"]), _f32(batch["rollout"]), _f32(batch["mask"])
    out = compute_correction(cfg.ratio_numerator(prox, theta), rollout, mask, cfg)
    loss, info = policy_loss(theta, None if cfg.bypass_mode else prox, rollout, adv, mask, loss_cfg, correction=out)
    loss.backward()
    return out, loss, info, theta.grad.double().numpy()


@pytest.mark.parametrize("delta", [1e-4, 0.1, 0.25])
def test_slime_use_opsm(delta):
    batch = _batch()
    with pytest.warns(PeerNameWarning, match="slime's use_opsm"):
        cfg = C.from_peer_names(use_opsm=True, opsm_delta=delta)
    assert cfg == C.opsm(threshold=delta, reference="prox")
    # slime's old log-probs are the recomputed ones: the kit's pi_prox.
    expected_mask = _slime_opsm_mask(batch["theta"], batch["prox"], batch["adv"], batch["mask"], delta)
    kept = off_policy_sequence_mask(
        _f32(batch["theta"]), _f32(batch["prox"]), _f32(np.nan_to_num(batch["adv"])), _f32(batch["mask"]).bool(), delta
    )
    valid = batch["mask"] != 0
    np.testing.assert_array_equal(kept.numpy()[valid], expected_mask[valid] == 1.0)
    assert (expected_mask[valid] == 0).any(), "some token is dropped: the comparison is not vacuous"

    loss_cfg = PolicyLossConfig(aggregation="seq-mean-token-mean")
    out, loss, info, grad = _kit_loss(batch, cfg, loss_cfg, _f32(batch["adv"]))
    assert torch.equal(out.weights, torch.ones_like(out.weights)) and torch.equal(out.mask, _f32(batch["mask"]))
    # slime divides by every sample of the step, the empty one included: pass that count.
    _, loss_n, _, grad_n = _kit_loss_with_count(batch, cfg, loss_cfg, float(len(valid)))
    value, expected_grad = _slime_loss(batch["theta"], batch["prox"], batch["adv"], batch["mask"], expected_mask)
    assert float(loss_n.detach()) == pytest.approx(value, rel=RTOL, abs=1e-7)
    np.testing.assert_allclose(grad_n[valid], expected_grad[valid], rtol=RTOL, atol=1e-7)
    assert float(info.opsm_rejected_tokens) == float((expected_mask[valid] == 0).sum())
    assert float(info.opsm_rejected_sequences) == float(((expected_mask == 0) & valid).any(axis=1).sum())
    assert float(info.response_sequences) == 5.0
    assert np.isfinite(grad).all(), "NaN padding leaked into the gradient"


def _kit_loss_with_count(batch, cfg, loss_cfg, sequence_count):
    theta = _f32(batch["theta"]).requires_grad_(True)
    prox, rollout, mask = _f32(batch["prox"]), _f32(batch["rollout"]), _f32(batch["mask"])
    out = compute_correction(prox, rollout, mask, cfg)
    loss, info = policy_loss(
        theta, prox, rollout, _f32(batch["adv"]), mask, loss_cfg, correction=out, sequence_count=sequence_count
    )
    loss.backward()
    return out, loss, info, theta.grad.double().numpy()


@pytest.mark.parametrize("threshold", [0.1, 0.25])
def test_trl_off_policy_mask_threshold_with_vllm_importance_sampling(threshold):
    batch = _batch(seed=1)
    adv_seq = np.array([-1.0, 0.7, -0.4, 1.2, -0.9, 0.5])
    with pytest.warns(PeerNameWarning, match="TRL's"):
        cfg = C.from_peer_names(
            off_policy_mask_threshold=threshold,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=3.0,
        )
    assert cfg == C.token_tis(clip_high=3.0).replace(opsm_mask=True, opsm_threshold=threshold)
    mask = batch["mask"]
    valid = mask != 0
    # TRL's OPSM compares pi_theta with its vLLM sampling logprobs: the kit's pi_rollout.
    expected_mask = _trl_opsm_mask(batch["theta"], batch["rollout"], adv_seq, mask, threshold)
    is_ratio = _trl_is_ratio_token_truncate(batch["prox"], batch["rollout"], mask, 3.0)
    out, loss, info, grad = _kit_loss(batch, cfg, PolicyLossConfig(), _f32(adv_seq))
    np.testing.assert_allclose(out.weights.double().numpy()[valid], is_ratio[valid], rtol=1e-6)
    kept = off_policy_sequence_mask(
        _f32(batch["theta"]), _f32(batch["rollout"]), _f32(adv_seq)[:, None].expand(6, 10), _f32(mask).bool(), threshold
    )
    np.testing.assert_array_equal(kept.numpy()[valid], expected_mask[valid] == 1.0)
    assert (expected_mask[valid] == 0).any() and (expected_mask[valid] == 1).any()
    value, expected_grad = _trl_bnpo_loss(batch["theta"], batch["prox"], adv_seq, mask, expected_mask, is_ratio)
    assert float(loss.detach()) == pytest.approx(value, rel=RTOL, abs=1e-7)
    np.testing.assert_allclose(grad[valid], expected_grad[valid], rtol=RTOL, atol=1e-7)
    assert float(info.kept_tokens) == float((expected_mask[valid] == 1).sum())


def test_opsm_in_bypass_mode_reads_the_rollout_and_the_reference_choice_matters():
    batch = _batch(seed=2, prox_shift=np.zeros(6))
    adv = _f32(batch["adv"])
    # pi_theta ~ pi_prox here, so against "prox" nothing exceeds the threshold.
    _, _, near, _ = _kit_loss(batch, C.opsm(threshold=0.1, reference="prox"), PolicyLossConfig(), adv)
    _, _, far, _ = _kit_loss(batch, C.opsm(threshold=0.1, reference="rollout"), PolicyLossConfig(), adv)
    assert float(near.opsm_rejected_tokens) == 0.0 < float(far.opsm_rejected_tokens)
    bypass = C.opsm(threshold=0.1, reference="prox").replace(bypass_mode=True)  # pi_prox := pi_rollout
    _, _, info, _ = _kit_loss(batch, bypass, PolicyLossConfig(), adv)
    assert float(info.opsm_rejected_tokens) == float(far.opsm_rejected_tokens)


def test_opsm_metrics_are_the_rejection_rates():
    batch = _batch()
    cfg = C.opsm(threshold=0.1)
    _, _, info, _ = _kit_loss(batch, cfg, PolicyLossConfig(), _f32(batch["adv"]))
    metrics = PolicyLossMetrics(cfg)
    metrics.update(info=info)
    values = metrics.compute()
    valid = batch["mask"] != 0
    assert float(values["ppo/opsm_mask_token_reject_rate"]) == pytest.approx(
        float(info.opsm_rejected_tokens) / valid.sum()
    )
    assert float(values["ppo/opsm_mask_seq_reject_rate"]) == pytest.approx(float(info.opsm_rejected_sequences) / 5)
    assert 0 < float(values["ppo/opsm_mask_seq_reject_rate"]) < 1
    assert not any("opsm" in key for key in PolicyLossMetrics(C()).keys()), "no key without the mask"
    theta, prox, adv, mask = (_f32(batch[k]) for k in ("theta", "prox", "adv", "mask"))
    plain_info = policy_loss(theta, prox, None, adv, mask)[1]
    with pytest.raises(ValueError, match="no OPSM counts"):
        PolicyLossMetrics(cfg).update(info=plain_info)


def test_policy_loss_of_a_correction_slice_equals_the_correction_output():
    batch = _batch()
    cfg = C.opsm(threshold=0.1)
    theta, prox, rollout = _f32(batch["theta"]), _f32(batch["prox"]), _f32(batch["rollout"])
    adv, mask = _f32(batch["adv"]), _f32(batch["mask"])
    with_output = policy_loss(theta, prox, rollout, adv, mask, correction=compute_correction(prox, rollout, mask, cfg))
    plain = policy_loss(
        theta, prox, rollout, adv, mask, correction=CorrectionOutput(torch.ones_like(mask), mask, None, cfg)
    )
    assert torch.equal(with_output[0], plain[0])
    assert float(with_output[1].opsm_rejected_tokens) == float(plain[1].opsm_rejected_tokens) > 0
    with pytest.raises(ValueError, match="policy_loss needs rollout_logprobs"):
        policy_loss(
            theta, prox, None, adv, mask, correction=CorrectionOutput(torch.ones_like(mask), mask, None, C.opsm())
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(opsm_mask=True, opsm_threshold=0.0), "opsm_threshold"),
        (dict(opsm_mask=True, opsm_threshold=float("nan")), "opsm_threshold"),
        (dict(use_opsm=True, opsm_delta=-1.0), "opsm_delta"),
        (dict(opsm_mask=True, opsm_reference="theta"), "opsm_reference"),
        (dict(off_policy_mask_threshold=-0.5), "off_policy_mask_threshold"),
        (dict(use_opsm=True, off_policy_mask_threshold=0.5), "TRL and slime are mixed"),
    ],
)
def test_opsm_settings_are_validated_by_name(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        with pytest.raises(CorrectionConfigError, match=message):
            C.from_peer_names(**kwargs)


def test_trl_threshold_alone_turns_on_opsm_only_and_slime_off_is_the_default():
    with pytest.warns(PeerNameWarning, match="only when a vllm_importance_sampling"):
        cfg = C.from_peer_names(off_policy_mask_threshold=0.5)
    assert cfg == C.opsm() == C.opsm(threshold=0.5, reference="rollout")
    with pytest.warns(PeerNameWarning, match="kit's default"):
        assert C.from_peer_names(use_opsm=False) == C()
    with pytest.warns(PeerNameWarning, match="read only with use_opsm"):
        assert C.from_peer_names(opsm_delta=0.01) == C(), "slime reads --opsm-delta only with --use-opsm"


# ------------------------------------------------------------------ with the rest of the kit, vs tests/reference.py
GRID = {
    "prox": (C.opsm(threshold=0.02, reference="prox"), PolicyLossConfig()),
    "rollout+token_tis": (C.token_tis(clip_high=1.5).replace(opsm_mask=True, opsm_threshold=0.02),
                          PolicyLossConfig(aggregation="seq-mean-token-mean", dual_clip=3.0)),
    "bypass": (C.bypass().replace(opsm_mask=True, opsm_threshold=0.02, opsm_reference="prox"),
               PolicyLossConfig(rollout_kl_coef=0.1)),
    "gspo+geo": (C.geo_mis(low=0.9, high=1.1).replace(opsm_mask=True, opsm_threshold=0.01),
                 PolicyLossConfig(loss_type="gspo")),
    "cispo": (C.cispo(clip_high=1.2).replace(opsm_mask=True, opsm_threshold=0.01, opsm_reference="prox"),
              PolicyLossConfig()),
}  # fmt: skip
VARIANTS = {"plain": dict(seed=11, spread=0.2), "holes": dict(seed=12, spread=0.2, holes=True),
            "huge": dict(seed=13, spread=0.1, huge=True)}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(GRID))
def test_opsm_with_the_rest_of_the_kit_matches_the_reference(name, variant):
    cfg, loss_cfg = GRID[name]
    batch = make_batch(**VARIANTS[variant])
    lp = _f32(batch["logprobs"]).requires_grad_(True)
    prox, rollout, mask, adv = (_f32(batch[k]) for k in ("prox", "rollout", "mask", "adv"))
    out = compute_correction(cfg.ratio_numerator(prox, lp), rollout, mask, cfg)
    total, info = policy_loss(lp, None if cfg.bypass_mode else prox, rollout, adv, mask, loss_cfg, correction=out)
    total.backward()
    ref = ref_policy_loss(
        batch["logprobs"], batch["prox"], batch["rollout"], batch["adv"], batch["mask"], loss_cfg, cfg
    )
    tol = 1e-6 * (1.0 + ref.scale)
    np.testing.assert_allclose(total.item(), ref.total, rtol=1e-5, atol=tol)
    np.testing.assert_allclose(lp.grad.numpy(), ref.grad, rtol=1e-5, atol=1e-6)
    assert info.kept_tokens.item() == ref.kept_tokens
    assert info.opsm_rejected_tokens.item() == ref.opsm_rejected_tokens
    assert info.opsm_rejected_sequences.item() == ref.opsm_rejected_sequences


def test_the_grid_drops_something():
    dropped = 0
    for cfg, loss_cfg in GRID.values():
        for variant in VARIANTS.values():
            batch = make_batch(**variant)
            ref = ref_policy_loss(
                batch["logprobs"], batch["prox"], batch["rollout"], batch["adv"], batch["mask"], loss_cfg, cfg
            )
            dropped += ref.opsm_rejected_tokens
            assert ref.opsm_rejected_tokens < int((batch["mask"] != 0).sum()), "not everything either"
    assert dropped > 0


# ------------------------------------------------------------------------------ in the training module
@pytest.mark.parametrize("fused_loss", [False, True], ids=["eager", "fused"])
def test_the_module_applies_opsm_and_logs_its_rates(fused_loss, monkeypatch):
    from functools import partial

    from lightning_offpolicy import OffPolicyRLModule
    from tests.module_helpers import TOKENIZER, fit_on, fused_step_on_aot_eager, make_rollout, tiny_model

    fused_step_on_aot_eager(monkeypatch)  # OPSM through inductor: tests/test_fused_correction.py

    def logged(correction):
        torch.manual_seed(0)
        model = tiny_model()
        module = OffPolicyRLModule(
            model=model, tokenizer=TOKENIZER, optimizer=partial(torch.optim.SGD, lr=0.002), correction=correction,
            gradient_clip_val=None, shuffle_minibatches=False, fused_loss=fused_loss,
        )  # fmt: skip
        trainer = fit_on(module, [make_rollout(model, rows=12, mismatch=0.3)], max_steps=1)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}

    plain = logged(C.disabled())
    opsm = logged(C.opsm(threshold=0.05))
    assert not any("opsm" in key for key in plain)
    token_rate, seq_rate = opsm["ppo/opsm_mask_token_reject_rate"], opsm["ppo/opsm_mask_seq_reject_rate"]
    assert 0 < token_rate < 1 and 0 < seq_rate < 1, (token_rate, seq_rate)
    # The loss decides OPSM: compute_correction, and so the mismatch metrics, are unchanged.
    assert opsm["rollout_corr/kl"] == pytest.approx(plain["rollout_corr/kl"])
