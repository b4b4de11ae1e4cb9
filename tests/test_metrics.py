"""Metrics against a float64 NumPy re-derivation, plus accumulation and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_offpolicy.correction import (
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.metrics.correction import (
    ChiSquared,
    CorrectionMetrics,
    EffectiveSampleSize,
    ImportanceWeightMax,
    MismatchKL,
    PolicyLossMetrics,
    RejectionRate,
)


def make_batch(seed: int, batch: int = 6, length: int = 9, spread: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(batch, length, generator=gen) * 3
    rollout = prox + spread * torch.randn(batch, length, generator=gen)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = length  # at least one full row
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    # Garbage in padding must never matter.
    prox = torch.where(mask.bool(), prox, torch.tensor(float("nan")))
    rollout = torch.where(mask.bool(), rollout, torch.tensor(float("inf")))
    return prox, rollout, mask


def clamp_exp(x: float) -> float:
    return math.exp(min(max(x, -20.0), 20.0))


def reference_metrics(prox, rollout, mask) -> dict[str, float]:
    """Float64 loops over tokens and sequences, written from the metric definitions."""
    p = prox.double().numpy()
    r = rollout.double().numpy()
    m = mask.numpy() > 0
    tokens, seqs = [], []
    for i in range(p.shape[0]):
        row = [p[i, t] - r[i, t] for t in range(p.shape[1]) if m[i, t]]
        tokens += row
        if row:
            seqs.append((sum(row), len(row)))
    rho = [clamp_exp(x) for x in tokens]
    seq_rho = [clamp_exp(s) for s, _ in seqs]
    n, ns = len(tokens), len(seqs)
    return {
        "kl": sum(-x for x in tokens) / n,
        "k3_kl": sum(clamp_exp(x) - 1 - x for x in tokens) / n,
        "log_ppl_diff": sum(-s / k for s, k in seqs) / ns,
        "ppl_ratio": sum(clamp_exp(-s / k) for s, k in seqs) / ns,
        "chi2_token": sum(x * x for x in rho) / n - 1,
        "chi2_seq": sum(x * x for x in seq_rho) / ns - 1,
        "ess": sum(rho) ** 2 / (n * sum(x * x for x in rho)),
        "ess_seq": sum(seq_rho) ** 2 / (ns * sum(x * x for x in seq_rho)),
        "abs_logprob_diff_mean": sum(abs(x) for x in tokens) / n,
        "abs_logprob_diff_max": max(abs(x) for x in tokens),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mismatch_metrics_match_float64_reference(seed):
    prox, rollout, mask = make_batch(seed)
    out = compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.disabled())
    metrics = CorrectionMetrics(OffPolicyCorrectionConfig.disabled())
    metrics.update(stats=out.stats)
    values = {k.removeprefix("rollout_corr/"): float(v) for k, v in metrics.compute().items()}
    for key, expected in reference_metrics(prox, rollout, mask).items():
        assert values[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    # No weight applied: the neutral weight, nothing truncated, nothing rejected.
    assert values["is_weight_mean"] == values["is_weight_min"] == values["is_weight_max"] == 1.0
    assert values["is_weight_clip_frac"] == 0.0
    assert values["total_token_reject_rate"] == 0.0


def test_accumulating_two_updates_equals_one_update_on_the_concatenation():
    (p1, r1, m1), (p2, r2, m2) = make_batch(3), make_batch(4)
    cfg = OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.95, high=1.05, clip_high=1.2)
    split = CorrectionMetrics(cfg)
    for p, r, m in ((p1, r1, m1), (p2, r2, m2)):
        split.update(stats=compute_correction(p, r, m, cfg).stats)
    whole = CorrectionMetrics(cfg)
    whole.update(stats=compute_correction(torch.cat([p1, p2]), torch.cat([r1, r2]), torch.cat([m1, m2]), cfg).stats)
    a, b = split.compute(), whole.compute()
    assert a.keys() == b.keys()
    for key in a:
        assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-12, abs=1e-12), key


def test_rejection_rates_and_weight_stats_by_hand():
    # Sequence 0: log_rho = [0.0, 1.0] -> token 1 (rho=e) outside the IcePop band [0.5, 2].
    # Sequence 1: log_rho = [-0.1, 0.1] -> kept; token TIS weights exp(-0.1), min(exp(0.1), 1.05).
    prox = torch.tensor([[0.0, 1.0], [-0.1, 0.1]]) - 2.0
    rollout = torch.full((2, 2), -2.0)
    mask = torch.ones(2, 2)
    cfg = OffPolicyCorrectionConfig(token_mask=True, tis_level="token", tis_clip_high=1.05)
    metrics = CorrectionMetrics(cfg)
    metrics.update(stats=compute_correction(prox, rollout, mask, cfg).stats)
    v = {k.removeprefix("rollout_corr/"): float(x) for k, x in metrics.compute().items()}
    assert v["token_mask_token_reject_rate"] == pytest.approx(1 / 4)
    assert v["token_mask_seq_reject_rate"] == pytest.approx(1 / 2)
    assert v["total_token_reject_rate"] == pytest.approx(1 / 4)
    kept_weights = [1.0, math.exp(-0.1), 1.05]
    assert v["is_weight_mean"] == pytest.approx(sum(kept_weights) / 3, rel=1e-6)
    assert v["is_weight_min"] == pytest.approx(math.exp(-0.1), rel=1e-6)
    assert v["is_weight_max"] == pytest.approx(1.05, rel=1e-6)
    assert v["is_weight_clip_frac"] == pytest.approx(1 / 3)


def test_empty_update_leaves_neutral_values():
    mask = torch.zeros(2, 3)
    nan = torch.full((2, 3), float("nan"))
    metrics = CorrectionMetrics(OffPolicyCorrectionConfig.token_tis())
    metrics.update(stats=compute_correction(nan, nan, mask, OffPolicyCorrectionConfig.token_tis()).stats)
    values = metrics.compute()
    assert all(torch.isfinite(v) for v in values.values())
    assert float(values["rollout_corr/kl"]) == 0.0
    assert float(values["rollout_corr/ess"]) == 1.0


def test_huge_log_ratios_stay_finite():
    prox = torch.tensor([[-1000.0, 1000.0, -1.0]])
    rollout = torch.tensor([[0.0, 0.0, -1.0]])
    metrics = CorrectionMetrics()
    metrics.update(stats=compute_correction(prox, rollout, torch.ones(1, 3)).stats)
    values = metrics.compute()
    assert all(torch.isfinite(v) for v in values.values())
    assert float(values["rollout_corr/abs_logprob_diff_max"]) == 1000.0
    assert float(values["rollout_corr/chi2_token"]) == pytest.approx((math.exp(-40) + math.exp(40) + 1) / 3 - 1)


def test_policy_loss_metrics_against_hand_counts():
    # r = exp(logprobs - prox) = [1.5, 0.5, 1.0]; eps 0.2; A = [+1, -1, +1]
    # token 0: A>0, r>1.2 -> clipped; token 1: A<0, r<0.8 -> clipped; token 2: r=1 -> not.
    prox = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    _, info = policy_loss(logprobs, prox, prox, adv, torch.ones(1, 3), PolicyLossConfig())
    metrics = PolicyLossMetrics()
    metrics.update(info=info)
    values = metrics.compute()
    assert float(values["ppo/clip_frac"]) == pytest.approx(2 / 3)
    expected_kl = np.mean([(r - 1) - math.log(r) for r in (1.5, 0.5, 1.0)])
    assert float(values["ppo/approx_kl"]) == pytest.approx(expected_kl, rel=1e-6)
    assert float(values["ppo/dual_clip_frac"]) == 0.0


def test_metric_arguments_are_validated():
    with pytest.raises(ValueError, match="estimator"):
        MismatchKL("k2")
    with pytest.raises(ValueError, match="level"):
        ChiSquared("batch")
    with pytest.raises(ValueError, match="level"):
        EffectiveSampleSize("tokens")
    with pytest.raises(ValueError, match="level"):
        RejectionRate("geo_mask", "seq")


def test_standalone_metric_reset():
    prox, rollout, mask = make_batch(5)
    metric = ImportanceWeightMax()
    metric.update(compute_correction(prox, rollout, mask, OffPolicyCorrectionConfig.token_tis(clip_high=5.0)).stats)
    assert float(metric.compute()) > 1.0
    metric.reset()
    assert float(metric.compute()) == 1.0


def test_infinite_logprob_at_a_response_token_keeps_every_metric_finite():
    # rollout -inf at a response token: before, kl / k3 / log_ppl / abs diff went to +-inf and stayed there.
    prox = torch.tensor([[-1.0, -1.0, -2.0]])
    rollout = torch.tensor([[-1.0, float("-inf"), -2.0]])
    cfg = OffPolicyCorrectionConfig.token_tis()
    metrics, loss_metrics = CorrectionMetrics(cfg), PolicyLossMetrics()
    metrics.update(stats=compute_correction(prox, rollout, torch.ones(1, 3), cfg).stats)
    _, info = policy_loss(prox.clone(), prox, rollout, torch.ones(1), torch.ones(1, 3), PolicyLossConfig())
    loss_metrics.update(info=info)
    values = {**metrics.compute(), **loss_metrics.compute()}
    assert all(torch.isfinite(v) for v in values.values()), {k: float(v) for k, v in values.items()}
    # The -inf logprob counts as -INFINITE_LOG_RATIO = -1e6, so log_rho = -1 + 1e6: loud, but finite.
    assert float(values["rollout_corr/abs_logprob_diff_max"]) == 1e6 - 1
    assert float(values["rollout_corr/kl"]) == pytest.approx(-(1e6 - 1) / 3)
    assert float(values["ppo/rollout_kl"]) == pytest.approx(0.5 * (1e6 - 1) ** 2 / 3)  # k2 (the default)


def test_nan_at_a_response_token_never_reaches_the_metric_states():
    metrics = CorrectionMetrics()
    prox = torch.tensor([[-1.0, float("nan")]])
    with pytest.raises(ValueError, match=r"prox_logprobs is nan .*row 0, token 1"):
        metrics.update(stats=compute_correction(prox, torch.zeros(1, 2), torch.ones(1, 2)).stats)
    metrics.update(stats=compute_correction(torch.tensor([[-1.0, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2)).stats)
    assert float(metrics.compute()["rollout_corr/kl"]) == pytest.approx(1.0)  # -mean(log_rho) = -mean(-1, -1)
