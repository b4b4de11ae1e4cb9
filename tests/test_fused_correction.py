"""``FusedCorrectionStep`` (torch.compile of correction + loss + metric sums) against the eager path.

The eager functions are the reference: for every preset, the compiled step's loss, gradient,
``PolicyLossInfo`` and metric sums equal ``compute_correction`` -> ``policy_loss`` -> ``CorrectionMetrics``
on the same tensors (float32 reductions in another order: relative 1e-5). Inputs hold NaN padding,
large outliers, an empty row and a full row, as the benchmark's do.
"""

from __future__ import annotations

import pytest
import torch

from lightning_offpolicy.correction import (
    PRESETS,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.correction.fused import FusedCorrectionStep
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics

RTOL, ATOL = 1e-5, 1e-7


def _inputs(batch: int = 6, seq_len: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(batch, seq_len, generator=gen) * 3.0
    rollout = prox + 0.3 * torch.randn(batch, seq_len, generator=gen)
    rollout[1, 3] += 6.0  # an outlier token: the veto and the token masks fire
    logprobs = prox + 0.05 * torch.randn(batch, seq_len, generator=gen)
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=gen)
    lengths[0], lengths[-1] = seq_len, 0  # a full row and an empty one
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).float()
    nan = torch.tensor(float("nan"))
    prox, rollout, logprobs = (torch.where(mask.bool(), t, nan) for t in (prox, rollout, logprobs))
    return {
        "prox": prox,
        "rollout": rollout,
        "logprobs": logprobs,
        "advantages": torch.randn(batch, generator=gen),
        "mask": mask,
        "ref": prox + 0.1 * torch.randn(batch, seq_len, generator=gen),
    }


def _eager(cfg, loss_cfg, x, leaf, **kwargs):
    prox = cfg.ratio_numerator(x["prox"], leaf)
    out = compute_correction(prox, x["rollout"], x["mask"], cfg)
    loss, info = policy_loss(leaf, prox, x["rollout"], x["advantages"], x["mask"], loss_cfg, correction=out, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad.clone(), info, out.stats


def _fused(step, cfg, x, leaf, **kwargs):
    prox = None if cfg.bypass_mode else x["prox"]
    out = step(leaf, prox, x["rollout"], x["advantages"], x["mask"], **kwargs)
    out.loss.backward()
    return out, leaf.grad.clone()


def _assert_same(fused_out, fused_grad, eager, metrics_cfg):
    loss, grad, info, stats = eager
    torch.testing.assert_close(fused_out.loss.detach(), loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(fused_grad, grad, rtol=RTOL, atol=ATOL)
    for name in vars(info):
        if getattr(info, name) is None:
            assert getattr(fused_out.info, name) is None, name
            continue
        torch.testing.assert_close(
            getattr(fused_out.info, name).double(), getattr(info, name).double(), rtol=RTOL, atol=ATOL, msg=name
        )
    reference, fused = CorrectionMetrics(metrics_cfg), CorrectionMetrics(metrics_cfg)
    reference.update(stats=stats)
    fused.update_from_sums(fused_out.statistics)
    expected, got = reference.compute(), fused.compute()
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=RTOL, atol=1e-9, msg=key)
    ppo_ref, ppo_fused = PolicyLossMetrics(metrics_cfg), PolicyLossMetrics(metrics_cfg)
    ppo_ref.update(info=info)
    ppo_fused.update(info=fused_out.info)
    for key, value in ppo_ref.compute().items():
        torch.testing.assert_close(ppo_fused.compute()[key], value, rtol=RTOL, atol=1e-9, msg=key)


# Inductor (C++ code generation, ~5 s per preset) for presets that together use every mask, weight
# and objective (the token weight alone: token_tis under inductor in the loss-settings and DPPO tests
# below); every preset through the same traced graph with the aot_eager backend.
INDUCTOR_PRESETS = {
    "geo_mis_seq_tis",
    "seq_mis_token_tis",
    "decoupled_k3_rs",
    "outlier_veto",
    "cispo",
    "bypass_pg_token_icepop",
    "opsm",
    "m2po",
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_equals_the_eager_path(name):
    cfg, loss_cfg, x = PRESETS[name](), PolicyLossConfig(), _inputs()
    metrics = CorrectionMetrics(cfg)
    backend = "inductor" if name in INDUCTOR_PRESETS else "aot_eager"
    step = FusedCorrectionStep(cfg, loss_cfg, statistics=metrics.sums, backend=backend)
    out, grad = _fused(step, cfg, x, x["logprobs"].clone().requires_grad_(True))
    assert out.compiled, "the compiled graph was not used"
    _assert_same(out, grad, _eager(cfg, loss_cfg, x, x["logprobs"].clone().requires_grad_(True)), cfg)
    assert torch.isfinite(grad).all(), "NaN padding leaked into the gradient"


@pytest.mark.parametrize(
    "loss_cfg",
    [
        PolicyLossConfig(aggregation="seq-mean-token-mean", dual_clip=3.0, rollout_kl_coef=0.1, ref_kl_coef=0.05),
        PolicyLossConfig(loss_type="gspo", aggregation="seq-mean-token-sum-norm", loss_norm_constant=16),
        PolicyLossConfig(loss_type="sapo", rollout_kl_coef=0.2, rollout_kl_estimator="k2"),
    ],
    ids=["seq-mean+dual+kl", "gspo", "sapo"],
)
def test_loss_settings_and_global_counts_equal_the_eager_path(loss_cfg):
    cfg, x = OffPolicyCorrectionConfig.token_tis(), _inputs(seed=1)
    counts = {"token_count": 37.5, "sequence_count": torch.tensor(2.5)}
    step = FusedCorrectionStep(cfg, loss_cfg, statistics=CorrectionMetrics(cfg).sums)
    out, grad = _fused(step, cfg, x, x["logprobs"].clone().requires_grad_(True), ref_logprobs=x["ref"], **counts)
    assert out.compiled
    eager = _eager(cfg, loss_cfg, x, x["logprobs"].clone().requires_grad_(True), ref_logprobs=x["ref"], **counts)
    _assert_same(out, grad, eager, cfg)


@pytest.mark.parametrize(
    "cfg, loss_cfg, backend",
    [
        (
            OffPolicyCorrectionConfig.token_tis(),
            PolicyLossConfig(loss_type="dppo_tv", dppo_delta_low=0.01, dppo_delta_high=0.01, rollout_kl_coef=0.1),
            "inductor",
        ),
        (
            OffPolicyCorrectionConfig.token_mis(),
            PolicyLossConfig(
                loss_type="dppo_kl",
                dppo_delta_low=1e-3,
                dppo_delta_high=1e-3,
                dppo_ratio_cap=1.02,
                aggregation="seq-mean-token-mean",
            ),
            "inductor",
        ),
        # prime-rl's default loss: bypass, DPPO-TV against pi_rollout, rollout KL k2.
        (
            OffPolicyCorrectionConfig.bypass(),
            PolicyLossConfig(loss_type="dppo_tv", dppo_delta_low=0.05, dppo_delta_high=0.05, rollout_kl_coef=2e-3),
            "aot_eager",
        ),
        (
            OffPolicyCorrectionConfig.bypass().replace(token_mask=True),
            PolicyLossConfig(loss_type="dppo_kl", dppo_delta_low=0.01, dppo_delta_high=0.01),
            "aot_eager",
        ),
    ],
    ids=["tv+token_tis+kl", "kl+cap+token_mis", "prime-rl-default", "kl+bypass-token-mask"],
)
def test_dppo_equals_the_eager_path(cfg, loss_cfg, backend):
    x = _inputs(seed=8)
    x["logprobs"] = x["logprobs"] + 0.2 * torch.randn(x["logprobs"].shape, generator=torch.Generator().manual_seed(9))
    step = FusedCorrectionStep(cfg, loss_cfg, statistics=CorrectionMetrics(cfg).sums, backend=backend)
    out, grad = _fused(step, cfg, x, x["logprobs"].clone().requires_grad_(True))
    assert out.compiled
    eager = _eager(cfg, loss_cfg, x, x["logprobs"].clone().requires_grad_(True))
    _assert_same(out, grad, eager, cfg)
    assert eager[2].clipped_tokens > 0, "DPPO masked no token: the comparison would not see its mask"
    if loss_cfg.dppo_ratio_cap is not None:
        assert eager[2].dual_clipped_tokens > 0


def test_new_shapes_reuse_the_step_and_stay_equal():
    cfg, loss_cfg = OffPolicyCorrectionConfig.geo_mis(), PolicyLossConfig()
    step = FusedCorrectionStep(cfg, loss_cfg, statistics=CorrectionMetrics(cfg).sums)
    for batch, seq_len, seed in ((6, 24, 0), (4, 40, 1), (9, 17, 2)):
        x = _inputs(batch, seq_len, seed)
        out, grad = _fused(step, cfg, x, x["logprobs"].clone().requires_grad_(True))
        assert out.compiled
        _assert_same(out, grad, _eager(cfg, loss_cfg, x, x["logprobs"].clone().requires_grad_(True)), cfg)


#: What the step does around its graph (the gradient it hands back, the eager fallback) is the same whatever
#: compiles the graph: these tests run the traced graph op by op.
WRAPPER_BACKEND = "aot_eager"


def test_gradient_is_scaled_by_the_upstream_gradient_and_reaches_earlier_tensors():
    cfg, x = OffPolicyCorrectionConfig.seq_tis(), _inputs(seed=3)
    step = FusedCorrectionStep(cfg, backend=WRAPPER_BACKEND)
    source = x["logprobs"].clone().requires_grad_(True)
    out = step(source * 1.0, x["prox"], x["rollout"], x["advantages"], x["mask"])
    (3.0 * out.loss).backward()
    leaf = x["logprobs"].clone().requires_grad_(True)
    _, grad, _, _ = _eager(cfg, PolicyLossConfig(), x, leaf)
    torch.testing.assert_close(source.grad, 3.0 * grad, rtol=RTOL, atol=ATOL)
    assert out.statistics == {}


def test_no_gradient_needed_gives_the_loss_alone():
    cfg, x = OffPolicyCorrectionConfig.token_tis(), _inputs(seed=4)
    step = FusedCorrectionStep(cfg, backend=WRAPPER_BACKEND)
    out = step(x["logprobs"], x["prox"], x["rollout"], x["advantages"], x["mask"])
    assert out.compiled and not out.loss.requires_grad
    reference, _ = policy_loss(
        x["logprobs"], x["prox"], x["rollout"], x["advantages"], x["mask"],
        correction=compute_correction(x["prox"], x["rollout"], x["mask"], cfg),
    )  # fmt: skip
    torch.testing.assert_close(out.loss, reference, rtol=RTOL, atol=ATOL)


def test_nan_at_a_response_token_raises_the_eager_error():
    cfg, x = OffPolicyCorrectionConfig.token_tis(), _inputs(seed=5)
    x["rollout"][0, 2] = float("nan")
    step = FusedCorrectionStep(cfg, backend=WRAPPER_BACKEND)
    with pytest.raises(ValueError, match=r"rollout_logprobs is nan at a response token \(row 0, token 2"):
        step(x["logprobs"].clone().requires_grad_(True), x["prox"], x["rollout"], x["advantages"], x["mask"])


def test_infinite_logprob_takes_the_eager_rule():
    cfg, loss_cfg, x = OffPolicyCorrectionConfig.geo_mis(), PolicyLossConfig(), _inputs(seed=6)
    x["prox"][0, 1] = float("-inf")
    step = FusedCorrectionStep(cfg, loss_cfg, statistics=CorrectionMetrics(cfg).sums, backend=WRAPPER_BACKEND)
    out, grad = _fused(step, cfg, x, x["logprobs"].clone().requires_grad_(True))
    assert not out.compiled, "an infinite logprob must take the eager path"
    _assert_same(out, grad, _eager(cfg, loss_cfg, x, x["logprobs"].clone().requires_grad_(True)), cfg)


def test_bad_input_gets_the_eager_messages():
    cfg, x = OffPolicyCorrectionConfig.token_tis(), _inputs()
    step = FusedCorrectionStep(cfg, compiled=False)
    with pytest.raises(ValueError, match="prox_logprobs=None but bypass_mode=False"):
        step(x["logprobs"], None, x["rollout"], x["advantages"], x["mask"])
    with pytest.raises(ValueError, match="advantages has shape"):
        step(x["logprobs"], x["prox"], x["rollout"], x["advantages"][:2], x["mask"])
    with pytest.raises(ValueError, match="objective"):
        FusedCorrectionStep(OffPolicyCorrectionConfig.cispo(), PolicyLossConfig(loss_type="gspo"))


def test_update_from_sums_equals_update_for_every_preset():
    x = _inputs(seed=7)
    for name, make in PRESETS.items():
        cfg = make()
        stats = compute_correction(cfg.ratio_numerator(x["prox"], x["logprobs"]), x["rollout"], x["mask"], cfg).stats
        direct, from_sums = CorrectionMetrics(cfg), CorrectionMetrics(cfg)
        for _ in range(2):
            direct.update(stats=stats)
            from_sums.update_from_sums(direct.sums(stats))
        assert direct.compute().keys() == from_sums.compute().keys()
        for key, value in direct.compute().items():
            assert torch.equal(from_sums.compute()[key], value), (name, key)
    with pytest.raises(ValueError, match="no sums for"):
        CorrectionMetrics(OffPolicyCorrectionConfig.geo_mis()).update_from_sums({"kl": direct.sums(stats)["kl"]})
