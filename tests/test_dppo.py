"""DPPO (arXiv 2602.04879) against the peers' own code, re-derived in float64 plain loops.

Each ``*_reference`` below transcribes one peer's function token by token (not the kit's code), with
its analytic gradient with respect to the current policy's logprobs:

* prime-rl 559b447, ``src/prime_rl/trainer/rl/loss.py``: ``default_loss_fn`` (DPPO-Binary-TV mask
  on ``exp(trainer) - exp(inference)`` by advantage sign, ``-keep * adv_tau * A * ratio +
  kl_tau * log_ratio^2``), summed per sample and divided by the global loss-token count
  (``compute_loss``);
* SkyRL a956457, ``skyrl/backends/skyrl_train/utils/ppo_utils.py``: ``dppo_policy_loss`` (``mu``
  = the rollout logprobs, ratio ``exp(clamp(log_probs - mu, -20, 20))``, ``binary_tv`` /
  ``binary_kl`` masks, ``-(ratio * A * mask)``), ``token_mean`` (advantages divided by the token
  count, then ``reduce_loss``'s sum);
* verl 1dda039, ``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_dppo_tv`` / ``_kl``
  (against ``old_log_prob``, ``-A * sg(min(ratio, clip_ratio_c)) * log_prob * valid_mask``,
  times ``rollout_is_weights``; ``agg_loss`` token-mean), with verl's token TIS weights
  ``min(exp(clamp(old - rollout, -20, 20)), C)`` (``compute_rollout_correction_weights``).

The kit runs in float64 here (advantages are drawn as float32 numbers: the kit reads them in
float32), so loss and gradient agree to float64 rounding; only the TIS weights that
``compute_correction`` returns are float32.
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import partial

import lightning as L
import numpy as np
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
from lightning_offpolicy.correction.dppo import binary_divergence, dppo_mask
from lightning_offpolicy.correction.peer_names import PeerNameWarning
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from tests.module_helpers import TOKENIZER, fit_on, fused_step_on_aot_eager, make_rollout, tiny_model

RTOL, ATOL = 1e-12, 1e-15


def _batch(seed: int, rows: int = 6, length: int = 12) -> dict[str, np.ndarray]:
    """Probabilities spread over (0, 1) and moved by up to ~0.5, so every mask fires in both directions.

    ``anchor`` is the policy DPPO divides by (pi_rollout in bypass mode, pi_old / pi_prox in verl's
    decoupled mode); ``rollout`` is a second, nearby engine policy for the TIS weight.
    """
    rng = np.random.default_rng(seed)
    q = rng.uniform(0.02, 0.98, (rows, length))
    p = np.clip(q + rng.normal(0.0, 0.25, (rows, length)), 0.003, 0.997)
    # A few tokens far more likely under pi_theta than under the anchor: ratios above a cap of 3.
    rare = rng.random((rows, length)) < 0.15
    q = np.where(rare, rng.uniform(0.01, 0.05, (rows, length)), q)
    p = np.where(rare, np.minimum(q * rng.uniform(3.5, 8.0, (rows, length)), 0.2), p)
    rollout = np.clip(q * np.exp(rng.normal(0.0, 0.3, (rows, length))), 1e-4, 0.999)
    lengths = rng.integers(1, length + 1, rows)
    lengths[0] = length
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(0.0, 1.0, (rows, length)).astype(np.float32).astype(np.float64)
    return {"logprobs": np.log(p), "anchor": np.log(q), "rollout": np.log(rollout), "adv": adv, "mask": mask}


def _t(x: np.ndarray, pad: float | None = None, mask: np.ndarray | None = None) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.float64)
    if pad is not None:  # padding may hold anything: make it NaN, the kit must not read it
        t = torch.where(torch.tensor(mask) != 0, t, torch.tensor(pad, dtype=torch.float64))
    return t


def _valid(b):
    rows, length = b["mask"].shape
    return [(i, t) for i in range(rows) for t in range(length) if b["mask"][i, t] != 0]


# ------------------------------------------------------------------------------- the peers' code
def prime_rl_reference(b, dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """prime-rl's default_loss_fn over every sample, divided by rl_scale (the loss-token count)."""
    trainer, inference = b["logprobs"], b["anchor"]
    tokens = _valid(b)
    rl_scale = len(tokens)
    loss, grad, is_masked = 0.0, np.zeros_like(trainer), 0
    for i, t in tokens:
        log_importance_ratio = trainer[i, t] - inference[i, t]
        importance_ratio = math.exp(log_importance_ratio)
        probs_diff = math.exp(trainer[i, t]) - math.exp(inference[i, t])
        invalid_high = probs_diff > dppo_mask_high
        invalid_low = probs_diff < -dppo_mask_low
        masked = invalid_high if b["adv"][i, t] > 0 else invalid_low  # torch.where(positive, high, low)
        keep = 0.0 if masked else 1.0
        advantage = adv_tau * b["adv"][i, t]
        per_token = -keep * advantage * importance_ratio + kl_tau * log_importance_ratio**2
        d_per_token = -keep * advantage * importance_ratio + kl_tau * 2.0 * log_importance_ratio
        loss += per_token / rl_scale
        grad[i, t] = d_per_token / rl_scale
        is_masked += masked
    return loss, grad, is_masked


def skyrl_reference(b, dppo_type="binary_tv", delta_low=0.2, delta_high=0.2):
    """SkyRL's dppo_policy_loss with rollout logprobs (mu = rollout), token_mean reduction."""
    log_probs, mu_log_probs = b["logprobs"], b["anchor"]
    tokens = _valid(b)
    count = len(tokens)  # apply_loss_reduction_to_advantages_minibatch: advantages / loss_mask.sum()
    loss, grad, zeros = 0.0, np.zeros_like(log_probs), 0
    for i, t in tokens:
        delta = log_probs[i, t] - mu_log_probs[i, t]
        ratio = math.exp(min(max(delta, -20.0), 20.0))  # safe_exp_delta(clip=20)
        d_ratio = ratio if -20.0 < delta < 20.0 else 0.0
        current_probs, mu_probs = math.exp(log_probs[i, t]), math.exp(mu_log_probs[i, t])
        prob_diff = current_probs - mu_probs
        advantage = b["adv"][i, t]
        mask = 1.0
        if dppo_type == "binary_tv":
            if advantage > 0 and prob_diff > delta_high:
                mask = 0.0
            if advantage < 0 and -prob_diff > delta_low:
                mask = 0.0
        else:
            eps = 1e-8
            binary_kl = mu_probs * (mu_log_probs[i, t] - log_probs[i, t]) + (1 - mu_probs) * math.log(
                (1 - mu_probs + eps) / (1 - current_probs + eps)
            )
            if advantage > 0 and prob_diff > 0 and binary_kl > delta_high:
                mask = 0.0
            if advantage < 0 and prob_diff < 0 and binary_kl > delta_low:
                mask = 0.0
        scaled = advantage / count
        loss += -(ratio * scaled * mask)
        grad[i, t] = -(d_ratio * scaled * mask)
        zeros += mask == 0.0
    return loss, grad, zeros


def verl_reference(b, loss_mode="dppo_tv", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis=None):
    """verl's compute_policy_loss_dppo_tv / _kl, old_log_prob = the anchor; rollout_is_weights: token TIS at ``tis``.

    Returns verl's loss, its gradient, the same aggregation of ``-A * sg(min(r, C)) * valid * w``
    (the kit's loss value: verl's without the factor ``log_prob``), pg_clipfrac and pg_clipfrac_lower.
    """
    old_log_prob, log_prob = b["anchor"], b["logprobs"]
    tokens = _valid(b)
    count = len(tokens)
    loss, grad, at_ratio, clipfrac, clipfrac_lower = 0.0, np.zeros_like(log_prob), 0.0, 0.0, 0.0
    for i, t in tokens:
        ratio = math.exp(min(max(log_prob[i, t] - old_log_prob[i, t], -20.0), 20.0))
        truncated_ratio = min(ratio, clip_ratio_c)
        prob, old_prob = math.exp(log_prob[i, t]), math.exp(old_log_prob[i, t])
        if loss_mode == "dppo_tv":
            valid_positive = (prob - old_prob) <= clip_ratio_high
            valid_negative = (prob - old_prob) >= -clip_ratio_low
        else:
            binary_kl = old_prob * (old_log_prob[i, t] - log_prob[i, t]) + (1 - old_prob) * math.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            valid_positive = (binary_kl <= clip_ratio_high) or (prob <= old_prob)
            valid_negative = (binary_kl <= clip_ratio_low) or (prob >= old_prob)
        valid = float(valid_positive if b["adv"][i, t] > 0 else valid_negative)
        weight = 1.0
        if tis is not None:
            weight = min(math.exp(min(max(old_log_prob[i, t] - b["rollout"][i, t], -20.0), 20.0)), tis)
        advantage = b["adv"][i, t]
        loss += -advantage * truncated_ratio * log_prob[i, t] * valid * weight / count
        grad[i, t] = -advantage * truncated_ratio * valid * weight / count
        at_ratio += -advantage * truncated_ratio * valid * weight / count
        clipfrac += (1.0 - valid) / count
        clipfrac_lower += (ratio > clip_ratio_c) * valid / count
    return loss, grad, at_ratio, clipfrac, clipfrac_lower


# ------------------------------------------------------------------------------------ the kit's
def _kit(b, loss_cfg, corr_cfg, *, weights=None):
    lp = _t(b["logprobs"], pad=float("nan"), mask=b["mask"]).requires_grad_(True)
    anchor = _t(b["anchor"], pad=float("nan"), mask=b["mask"])
    rollout = _t(b["rollout"], pad=float("nan"), mask=b["mask"])
    mask, adv = _t(b["mask"]), _t(b["adv"], pad=float("nan"), mask=b["mask"])
    if corr_cfg.bypass_mode:  # DPPO against pi_rollout: the anchor is the engine
        loss, info = policy_loss(
            lp, None, anchor, adv, mask, loss_cfg, correction=compute_correction(None, anchor, mask, corr_cfg)
        )
    elif weights is not None:
        correction = CorrectionOutput(_t(weights), mask, None, corr_cfg)
        loss, info = policy_loss(lp, anchor, rollout, adv, mask, loss_cfg, correction=correction)
    else:
        correction = compute_correction(anchor, rollout, mask, corr_cfg)
        loss, info = policy_loss(lp, anchor, rollout, adv, mask, loss_cfg, correction=correction)
    loss.backward()
    return loss.item(), lp.grad.numpy(), info


def _peer_config(**names) -> PolicyLossConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        return PolicyLossConfig.from_peer_names(**names)


def _both_signs_masked(b, masked: np.ndarray) -> None:
    """The comparison is not vacuous: tokens of both advantage signs are masked, and some are not."""
    valid = b["mask"] != 0
    assert (masked & valid & (b["adv"] > 0)).any() and (masked & valid & (b["adv"] < 0)).any()
    assert (~masked & valid).any()


def _masked(b, divergence, low, high) -> np.ndarray:
    return dppo_mask(_t(b["logprobs"]), _t(b["anchor"]), _t(b["adv"]), _t(b["mask"]), divergence, low, high).numpy()


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("low, high, kl_tau", [(0.2, 0.2, 1e-3), (0.1, 0.3, 0.05), (0.25, 0.05, 0.0)])
def test_prime_rl_default_loss_is_bypass_dppo_tv_with_rollout_k2(seed, low, high, kl_tau):
    """prime-rl's default loss, given in prime-rl's names, is the kit's bypass + dppo_tv + rollout KL k2."""
    b = _batch(seed)
    loss_cfg = _peer_config(dppo_mask_low=low, dppo_mask_high=high, kl_tau=kl_tau)
    assert loss_cfg.rollout_kl_coef == 2 * kl_tau and loss_cfg.rollout_kl_estimator == "k2"
    loss, grad, info = _kit(b, loss_cfg, OffPolicyCorrectionConfig.bypass())
    ref_loss, ref_grad, ref_masked = prime_rl_reference(b, low, high, kl_tau=kl_tau)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert info.clipped_tokens.item() == ref_masked  # prime-rl's is_masked numerator (no A = 0 here)
    _both_signs_masked(b, _masked(b, "tv", low, high))


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(
    "dppo_type, low, high", [("binary_tv", 0.2, 0.2), ("binary_kl", 0.05, 0.05), ("binary_kl", 0.02, 0.1)]
)
def test_skyrl_dppo_is_bypass_dppo(seed, dppo_type, low, high):
    """SkyRL's policy_loss_type 'dppo' (mu = the rollout logprobs) is the kit's DPPO in bypass mode."""
    b = _batch(seed)
    loss_cfg = _peer_config(policy_loss_type="dppo", dppo_type=dppo_type, delta_low=low, delta_high=high)
    loss, grad, info = _kit(b, loss_cfg, OffPolicyCorrectionConfig.bypass())
    ref_loss, ref_grad, ref_zeros = skyrl_reference(b, dppo_type, low, high)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    assert info.clipped_tokens.item() == ref_zeros  # SkyRL's clip_ratio numerator
    _both_signs_masked(b, _masked(b, dppo_type.removeprefix("binary_"), low, high))


@pytest.mark.parametrize("seed", [0, 4])
@pytest.mark.parametrize("loss_mode, low, high", [("dppo_tv", 0.15, 0.15), ("dppo_kl", 0.05, 0.05)])
@pytest.mark.parametrize("tis", [None, 2.0], ids=["no-weight", "token-tis"])
def test_verl_dppo_gradient_with_and_without_tis(seed, loss_mode, low, high, tis):
    """verl's dppo_tv / dppo_kl (decoupled, ratio truncated at clip_ratio_c = 3) times its token TIS
    weight: the kit's gradient equals verl's at float64 (the weight passed as a float64 tensor)."""
    b = _batch(seed)
    loss_cfg = _peer_config(loss_mode=loss_mode, clip_ratio_low=low, clip_ratio_high=high)
    assert loss_cfg.dppo_ratio_cap == 3.0  # verl's ActorConfig.clip_ratio_c
    ref_loss, ref_grad, ref_at_ratio, clipfrac, clipfrac_lower = verl_reference(b, loss_mode, low, high, tis=tis)
    weights = None
    if tis is not None:
        log_rho = np.clip(b["anchor"] - b["rollout"], -20.0, 20.0)
        weights = np.minimum(np.exp(log_rho), tis)
    loss, grad, info = _kit(b, loss_cfg, OffPolicyCorrectionConfig.disabled(), weights=weights)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    # verl's value is -A * sg(min(r, C)) * log pi (a score-function surrogate); the kit's is the
    # same sum without the log pi factor, -A * min(r, C): another value, the same gradient.
    assert not math.isclose(loss, ref_loss)
    np.testing.assert_allclose(loss, ref_at_ratio, rtol=RTOL, atol=ATOL)
    responses = info.response_tokens.item()
    np.testing.assert_allclose(info.clipped_tokens.item() / responses, clipfrac, rtol=RTOL)
    np.testing.assert_allclose(info.dual_clipped_tokens.item() / responses, clipfrac_lower, rtol=RTOL)
    assert info.dual_clipped_tokens.item() > 0, "no ratio reached the cap: the truncation is untested"
    _both_signs_masked(b, _masked(b, loss_mode.removeprefix("dppo_"), low, high))


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl"])
def test_verl_dppo_with_the_kits_token_tis(loss_mode):
    """The same with the weight from compute_correction's token TIS (float32 weights: 1e-6)."""
    b = _batch(5)
    loss_cfg = _peer_config(loss_mode=loss_mode, clip_ratio_low=0.1, clip_ratio_high=0.1)
    _, ref_grad, ref_at_ratio, _, _ = verl_reference(b, loss_mode, 0.1, 0.1, tis=2.0)
    loss, grad, _ = _kit(b, loss_cfg, OffPolicyCorrectionConfig.token_tis(clip_high=2.0))
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(loss, ref_at_ratio, rtol=1e-6, atol=1e-9)
    # Without the weight the gradient differs: the weight is not silently dropped.
    _, unweighted, _, _, _ = verl_reference(b, loss_mode, 0.1, 0.1)
    assert not np.allclose(grad, unweighted, rtol=1e-3)


# --------------------------------------------------------------------------------- hand-computed
def _one_token(p_theta: float, p_anchor: float, advantage: float, loss_type: str, **kw):
    lp = torch.tensor([[math.log(p_theta)]], dtype=torch.float64, requires_grad=True)
    anchor = torch.tensor([[math.log(p_anchor)]], dtype=torch.float64)
    loss, info = policy_loss(
        lp, anchor, None, torch.tensor([[advantage]]), torch.ones(1, 1), PolicyLossConfig(loss_type=loss_type, **kw)
    )
    loss.backward()
    return loss.item(), lp.grad.item(), int(info.clipped_tokens.item()), int(info.dual_clipped_tokens.item())


@pytest.mark.parametrize(
    "p_theta, p_anchor, advantage, masked",
    [
        (0.7, 0.4, 1.0, True),  # rose by 0.3 > 0.2, pushed further up: masked
        (0.7, 0.4, -1.0, False),  # rose, but the advantage pushes it down: kept
        (0.1, 0.4, -1.0, True),  # fell by 0.3, pushed further down: masked
        (0.1, 0.4, 1.0, False),
        (0.55, 0.4, 1.0, False),  # rose by 0.15, inside the region
        (0.7, 0.4, 0.0, False),  # no advantage: never masked
    ],
)
def test_binary_tv_masks_only_in_the_direction_of_the_advantage(p_theta, p_anchor, advantage, masked):
    loss, grad, clipped, _ = _one_token(p_theta, p_anchor, advantage, "dppo_tv")
    ratio = p_theta / p_anchor
    assert clipped == int(masked)
    expected = 0.0 if masked else -advantage * ratio
    assert loss == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert grad == pytest.approx(expected, rel=1e-12, abs=1e-15)  # d(-A r)/d log pi = -A r


def test_binary_kl_value_and_mask():
    # p = 0.3, q = 0.1: KL(Bern(0.1) || Bern(0.3)) = 0.1 log(1/3) + 0.9 log(0.9/0.7) = 0.116327...
    div, diff = binary_divergence(
        torch.tensor([[math.log(0.3)]], dtype=torch.float64), torch.tensor([[math.log(0.1)]], dtype=torch.float64),
        torch.ones(1, 1), "kl",
    )  # fmt: skip
    expected = 0.1 * math.log(0.1 / 0.3) + 0.9 * math.log((0.9 + 1e-8) / (0.7 + 1e-8))
    assert div.item() == pytest.approx(expected, rel=1e-12) and diff.item() == pytest.approx(0.2)
    # TV 0.2 is inside a TV bound of 0.25, the KL 0.116 outside a KL bound of 0.05 (rare tokens).
    assert _one_token(0.3, 0.1, 1.0, "dppo_tv", dppo_delta_high=0.25)[2] == 0
    assert _one_token(0.3, 0.1, 1.0, "dppo_kl", dppo_delta_high=0.05)[2] == 1
    assert _one_token(0.3, 0.1, -1.0, "dppo_kl", dppo_delta_low=0.05)[2] == 0  # rose, A < 0: kept


def test_ratio_cap_keeps_the_gradient_at_the_cap():
    loss, grad, clipped, capped = _one_token(0.05, 0.01, 1.0, "dppo_tv", dppo_ratio_cap=3.0)
    assert (clipped, capped) == (0, 1)
    assert loss == pytest.approx(-3.0) and grad == pytest.approx(-3.0)
    assert _one_token(0.05, 0.01, 1.0, "dppo_tv")[:2] == pytest.approx((-5.0, -5.0))  # no cap: r = 5


def test_padding_and_probabilities_above_one_stay_finite():
    lp = torch.tensor([[0.01, float("nan"), -1.0]], requires_grad=True)  # 0.01: a logprob rounded above 0
    anchor = torch.tensor([[-0.2, float("inf"), float("-inf")]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    for loss_type in ("dppo_tv", "dppo_kl"):
        div, _ = binary_divergence(lp, anchor, mask, loss_type.removeprefix("dppo_"))
        assert torch.isfinite(div).all() and div[0, 1] == 0
        loss, _ = policy_loss(lp, anchor, None, torch.tensor([1.0]), mask, PolicyLossConfig(loss_type=loss_type))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0
        lp.grad = None


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="dppo_tv", dppo_delta_low=-0.1), "dppo_delta_low=-0.1 must be a finite number >= 0"),
        (dict(loss_type="dppo_kl", dppo_delta_high=float("nan")), "dppo_delta_high=nan"),
        (dict(loss_type="dppo_tv", dppo_ratio_cap=0.0), "dppo_ratio_cap=0.0 must be a positive"),
        (dict(dppo_ratio_cap=3.0), "dppo_ratio_cap=3.0 has no effect with loss_type='ppo'"),
        (dict(loss_type="dppo_tv", dual_clip=3.0), "dual_clip=3.0 bounds PPO's clipped loss"),
        (dict(loss_type="dppo"), r"loss_type='dppo' is not a known choice; allowed: .*'dppo_tv', 'dppo_kl'"),
    ],
)
def test_settings_are_validated_eagerly_naming_the_field(kwargs, match):
    with pytest.raises(CorrectionConfigError, match=match):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize("objective", ["pure_is", "cispo", "reinforce"])
def test_objectives_that_replace_the_surrogate_refuse_dppo(objective):
    cfg = OffPolicyCorrectionConfig(objective=objective, bypass_mode=objective != "cispo")
    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    correction = compute_correction(None if cfg.bypass_mode else x, x, mask, cfg)
    with pytest.raises(CorrectionConfigError, match="replaces the surrogate"):
        policy_loss(x, x, x, torch.ones(1), mask, PolicyLossConfig(loss_type="dppo_tv"), correction=correction)


# ------------------------------------------------------------------------------------ training
class _StepLogger(L.pytorch.loggers.Logger):
    """Keeps what the Trainer sends to a logger: ``{step: metrics}``."""

    name, version = "steps", 0

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step=None):
        self.steps.setdefault(step, {}).update({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((pa.double() - pb.double()).abs().max().item() for pa, pb in pairs)


def test_prime_rl_default_loss_trains_through_the_module_eager_and_fused(monkeypatch):
    """bypass + DPPO-TV + rollout KL k2 in OffPolicyRLModule: micro-batched, two epochs; the fused
    step (its traced graph run op by op: DPPO through inductor is tests/test_fused_correction.py's) ends
    at the eager weights, and ppo/clip_frac reports DPPO's masked tokens."""
    fused_step_on_aot_eager(monkeypatch)
    loss = PolicyLossConfig(loss_type="dppo_tv", dppo_delta_low=2e-3, dppo_delta_high=2e-3, rollout_kl_coef=2e-3)

    def run(fused: bool):
        torch.manual_seed(0)
        model = tiny_model()
        start = copy.deepcopy(model)
        module = OffPolicyRLModule(
            model=model, tokenizer=TOKENIZER, optimizer=partial(torch.optim.SGD, lr=0.002),
            correction=OffPolicyCorrectionConfig.bypass(), loss=loss, gradient_clip_val=None,
            shuffle_minibatches=False, ppo_epochs=2, max_tokens_per_microbatch=12, fused_loss=fused,
        )  # fmt: skip
        logger = _StepLogger()
        fit_on(module, [make_rollout(model, seed=i) for i in range(2)], 4, logger=logger, log_every_n_steps=1)
        return module, start, logger.steps

    eager, start, eager_steps = run(False)
    fused, _, fused_steps = run(True)
    assert fused._fused_steps, "the fused step was not used"
    diff = _max_difference(eager.policy, fused.policy)
    moved = _max_difference(eager.policy, start)
    assert diff < 1e-5 < moved
    clip = [values["ppo/clip_frac"] for values in eager_steps.values() if "ppo/clip_frac" in values]
    assert clip and 0 < max(clip) < 1, clip
    for step, values in eager_steps.items():
        for key in ("ppo/clip_frac", "ppo/rollout_kl"):
            if key in values:
                assert fused_steps[step][key] == pytest.approx(values[key], rel=1e-4, abs=1e-6), (step, key)
