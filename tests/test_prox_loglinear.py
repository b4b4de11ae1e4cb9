"""``prox_method="loglinear"``: AReaL's pi_prox without its forward pass.

The reference :func:`areal_loglinear` is AReaL's ``compute_prox_logp_approximations`` (method
``"loglinear"``) in areal/trainer/ppo/actor.py at inclusionAI/AReaL 4aef98d, transcribed line by
line in float64; its own unit test's numbers (tests/test_prox_approx.py there) are checked too.
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import partial

import pytest
import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.correction import CorrectionConfigError, PolicyLossConfig
from lightning_offpolicy.correction import OffPolicyCorrectionConfig as C
from lightning_offpolicy.correction.peer_names import PEER_DEFAULTS, PEER_OF, PeerNameWarning
from lightning_offpolicy.correction.prox import loglinear_alpha, loglinear_prox_logprobs
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from tests.module_helpers import TOKENIZER, fit_on, make_rollout, reference_logprobs, rows_of, tiny_model

LR = 0.002
CAP = 1.5
LOGLINEAR = C.token_tis(clip_high=CAP).replace(prox_method="loglinear")


def areal_loglinear(
    old_logp: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor, current_version: float
) -> torch.Tensor:
    """AReaL's loglinear proximal logprobs, as its code computes them (float64 here)."""
    v_proximal = current_version - 1
    v_behave = versions.double()
    v_theta = float(current_version)
    generated_tokens_mask = versions >= 0
    version_diff = v_theta - v_behave
    version_gap = v_proximal - v_behave
    alpha = torch.where(
        (version_diff > 0) & generated_tokens_mask,
        version_gap / version_diff,
        torch.zeros_like(v_behave),
    )
    alpha = torch.clamp(alpha, 0.0, 1.0)
    return old_logp + alpha * (logprobs - old_logp)


# ------------------------------------------------------------------------------ the formula
def test_arealsown_unit_test_numbers():
    """The expectations of AReaL's tests/test_prox_approx.py (basic, clamped and mixed versions)."""
    old, new = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -2.5, -3.5]])
    out = loglinear_prox_logprobs(old, new, torch.zeros(1, 3, dtype=torch.long), current_version=2)
    torch.testing.assert_close(out, torch.tensor([[-1.25, -2.25, -3.25]]))
    out = loglinear_prox_logprobs(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.tensor([[4]]), 5)
    assert out.item() == -1.0  # v_behave == v_proximal: alpha 0
    out = loglinear_prox_logprobs(
        torch.tensor([[-1.0], [-2.0]]), torch.tensor([[-1.5], [-2.2]]), torch.tensor([[0], [2]]), 4
    )
    torch.testing.assert_close(out, torch.tensor([[-1.375], [-2.1]]))


def test_equals_arealsown_code_on_per_token_versions_in_float64():
    """Every staleness at once, per token: 0 and 1 step (alpha 0: pi_rollout itself), 2..9 steps,
    tokens newer than the trainer (clamped to 0), and negative versions (AReaL's prompt tokens)."""
    gen = torch.Generator().manual_seed(0)
    current = 9
    versions = torch.tensor([[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 10, -1]] * 3)
    versions[1] = versions[1].flip(0)
    versions[2] = versions[2][torch.randperm(12, generator=gen)]
    old = -torch.rand(3, 12, generator=gen, dtype=torch.float64) * 5
    new = old + torch.randn(3, 12, generator=gen, dtype=torch.float64)
    expected = areal_loglinear(old, new, versions, current)
    got = loglinear_prox_logprobs(old.float(), new.float(), versions, current)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    alpha = loglinear_alpha(versions, current, current - 1)
    stale = (current - versions).double()
    fresh_or_one_behind = (stale <= 1) | (versions < 0)
    assert bool((alpha[fresh_or_one_behind] == 0).all())
    assert bool((got[fresh_or_one_behind] == old.float()[fresh_or_one_behind]).all())
    # A token s >= 1 steps stale gets (s - 1) / s.
    older = ~fresh_or_one_behind
    torch.testing.assert_close(alpha[older].double(), (stale[older] - 1) / stale[older])


def test_staleness_zero_everywhere_is_pi_rollout_bit_for_bit():
    old = torch.tensor([[-0.3, -2.0, -7.5]])
    out = loglinear_prox_logprobs(old, old - 1.0, torch.full((1, 3), 12), current_version=12)
    assert torch.equal(out, old)


def test_an_explicit_proximal_version_and_a_detached_result():
    old = torch.tensor([[-1.0, -1.0]])
    new = torch.tensor([[-2.0, -3.0]], requires_grad=True)
    out = loglinear_prox_logprobs(old, new, torch.tensor([[0, 2]]), current_version=4, proximal_version=3)
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.tensor([[-1.75, -2.0]]))  # alpha 3/4 and 1/2


def test_infinite_and_nan_logprobs_do_not_make_nan():
    """-inf (a token outside the kept support of one policy) stays -inf where AReaL's form gives
    NaN; NaN or inf where alpha is 0 (padding) does not leak into the result."""
    old = torch.tensor([[-float("inf"), -1.0, -1.0, float("nan")]])
    new = torch.tensor([[-2.0, -float("inf"), float("nan"), -1.0]])
    versions = torch.tensor([[0, 0, 4, -1]])
    out = loglinear_prox_logprobs(old, new, versions, current_version=4)
    assert out[0, 0] == -float("inf") and out[0, 1] == -float("inf")
    assert out[0, 2] == -1.0
    assert math.isnan(out[0, 3])  # padding keeps the rollout value, whatever it is
    assert not bool(torch.isnan(out[0, :3]).any())


def test_shapes_and_integer_versions_are_checked():
    with pytest.raises(ValueError, match="one shape"):
        loglinear_prox_logprobs(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="integer tensor"):
        loglinear_prox_logprobs(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), 1)


# ------------------------------------------------------------------------------ the config
def test_config_defaults_to_recompute_and_loglinear_skips_the_forward():
    assert C().prox_method == "recompute" and C().needs_prox
    assert not C().correction_reads_current_policy
    assert not LOGLINEAR.needs_prox and LOGLINEAR.correction_reads_current_policy
    assert LOGLINEAR.to_dict()["prox_method"] == "loglinear"
    assert LOGLINEAR.tis_level == "token"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prox_method="linear"), r"prox_method='linear' is not a known choice; allowed: 'recompute', 'loglinear'"),
        (
            dict(prox_method="loglinear", bypass_mode=True),
            r"prox_method='loglinear' .* bypass_mode=True has no pi_prox",
        ),
        (
            dict(prox_method="loglinear", tis_level="token", normalize_weights=True),
            r"prox_method='loglinear' computes the correction per micro-batch, .* but normalize_weights needs the "
            r"mean weight of the whole batch",
        ),
        (
            dict(prox_method="loglinear", m2po_mask=True),
            r"prox_method='loglinear' computes the correction per micro-batch, .* but m2po_mask ranks the "
            r"response tokens of the whole batch",
        ),
    ],
    ids=["unknown", "bypass", "normalize_weights", "m2po_mask"],
)
def test_config_refusals_name_the_setting(kwargs, message):
    with pytest.raises(CorrectionConfigError, match=message):
        C(**kwargs)


def test_presets_take_it_through_replace():
    with pytest.raises(CorrectionConfigError, match="bypass_mode=True has no pi_prox"):
        C.bypass().replace(prox_method="loglinear")
    assert C.geo_mis().replace(prox_method="loglinear").geo_mask


# ------------------------------------------------------------------------------ AReaL's name
@pytest.mark.parametrize(
    ("method", "kit"), [("loglinear", "loglinear"), ("recompute", "recompute"), ("metrics", "recompute")]
)
def test_arealsown_prox_logp_method_maps(method, kit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = C.from_peer_names(prox_logp_method=method, tis_level="token", tis_clip_high=CAP)
    assert built.prox_method == kit
    assert not hasattr(built, "prox_logp_method") and "prox_logp_method" not in built.to_dict()
    messages = [str(w.message) for w in caught if issubclass(w.category, PeerNameWarning)]
    assert len(messages) == 1 and messages[0].startswith("AReaL's prox_logp_method") and "the kit's" in messages[0]
    assert PEER_OF["prox_logp_method"] == "AReaL" and PEER_DEFAULTS["prox_logp_method"] is None
    if kit == "loglinear":
        assert built == LOGLINEAR


def test_arealsown_name_refusals():
    with pytest.raises(CorrectionConfigError, match="AReaL's prox_logp_method='linear' is not one of"):
        C.from_peer_names(prox_logp_method="linear")
    with pytest.raises(CorrectionConfigError, match="AReaL and verl are mixed"):
        C.from_peer_names(prox_logp_method="loglinear", rollout_is="token")
    with pytest.raises(CorrectionConfigError, match="conflicts with the peer setting"):
        C.from_peer_names(prox_method="loglinear", prox_logp_method="recompute")
    # AReaL's loglinear in bypass mode: the kit's own refusal, naming its fields.
    with pytest.raises(CorrectionConfigError, match="bypass_mode=True has no pi_prox"):
        C.from_peer_names(prox_logp_method="loglinear", bypass_mode=True)


# ------------------------------------------------------------------------------ the module step
VERSIONS = (8, 6, 4, 2, 0)  # the step runs at version 8: 0, 1, 2, 3 and 4 batches of 2 steps stale
STEP_VERSION = 8


def stale_rollout(model: torch.nn.Module, seed: int = 0) -> RolloutBatch:
    """A batch whose tokens carry every version of :data:`VERSIONS` (row and position mixed)."""
    batch = make_rollout(model, seed=seed)
    rows, cols = batch.response_mask.shape
    pattern = torch.tensor(VERSIONS)[(torch.arange(rows)[:, None] + torch.arange(cols)[None, :]) % len(VERSIONS)]
    return batch.with_fields(policy_version=torch.where(batch.response_mask.bool(), pattern, batch.policy_version))


def make_module(model, **kwargs) -> OffPolicyRLModule:
    defaults = dict(
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=LR),
        correction=LOGLINEAR,
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28),
        gradient_clip_val=None,
        shuffle_minibatches=False,
    )
    defaults.update(kwargs)
    module = OffPolicyRLModule(model=model, **defaults)
    module.policy_version = STEP_VERSION
    return module


def reference_loglinear_sgd(model, batch, minibatches, steps_per_batch):
    """Decoupled PPO with token TIS and plain SGD in float64, pi_prox from AReaL's code per mini-batch.

    AReaL's versions count batches: the kit's versions divided by the optimizer steps per batch (as
    real numbers: the formula is a ratio of version differences). pi_theta in the interpolation is
    the model at that mini-batch (detached), as in AReaL's loss.
    """
    ref = copy.deepcopy(model).double()
    rows = rows_of(batch)
    for minibatch in minibatches:
        ref.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        count = sum(len(rows[i][1]) for i in minibatch)
        for i in minibatch:
            prompt, response, rollout, adv = rows[i]
            logp = reference_logprobs(ref, prompt, response)
            versions = batch.policy_version[i, : len(response)].double() / steps_per_batch
            prox = areal_loglinear(rollout, logp.detach(), versions, STEP_VERSION / steps_per_batch)
            for t in range(len(response)):
                w = min(math.exp(float(prox[t] - rollout[t])), CAP)
                ratio = torch.exp(logp[t] - prox[t])
                clipped = torch.clamp(ratio, 0.8, 1.28)
                total = total + w * torch.maximum(-adv * ratio, -adv * clipped)
        (total / count).backward()
        with torch.no_grad():
            for param in ref.parameters():
                if param.grad is not None:
                    param -= LR * param.grad
    return ref


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (pa.double() - pb.double()).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("num_minibatches", "max_tokens", "fused_loss"),
    [(2, 10_000, False), (2, 12, False), (1, 10_000, False), (3, 9, True)],
    ids=["two-minibatches", "two-minibatches-micro-batched", "one-step", "fused-three-minibatches-micro-batched"],
)
def test_loglinear_step_equals_arealsown_formula_in_a_hand_written_step(num_minibatches, max_tokens, fused_loss):
    model = tiny_model()
    batch = stale_rollout(model)
    start = copy.deepcopy(model)
    module = make_module(
        model, num_minibatches=num_minibatches, max_tokens_per_microbatch=max_tokens, fused_loss=fused_loss
    )
    fit_on(module, [batch], max_steps=num_minibatches)
    minibatches = [part.tolist() for part in torch.tensor_split(torch.arange(batch.num_sequences), num_minibatches)]
    expected = reference_loglinear_sgd(start, batch, minibatches, steps_per_batch=num_minibatches)
    moved = max_param_diff(start, expected)
    assert moved > 1e-3
    assert max_param_diff(module.policy, expected) < 1e-5 * max(1.0, moved), moved
    assert module.policy_version == STEP_VERSION + num_minibatches


def test_loglinear_runs_no_forward_without_gradient(monkeypatch):
    """Two mini-batches: recompute runs a forward without gradient and two with; loglinear only the two."""

    def forwards(correction):
        model = tiny_model()
        module = make_module(model, correction=correction, num_minibatches=2)
        batches = [stale_rollout(model), stale_rollout(model, seed=1)]
        seen = []
        # The decoder: the fused lm_head path calls it, not the causal LM's own forward.
        model.base_model.register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
        calls = []
        original = module.update.no_grad_logprobs
        monkeypatch.setattr(module.update, "no_grad_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
        fit_on(module, batches, max_steps=4)
        return seen, calls

    assert forwards(C.token_tis(clip_high=CAP)) == ([False, True, True] * 2, [1, 1])
    assert forwards(LOGLINEAR) == ([True, True] * 2, [])


def test_fresh_or_one_batch_stale_tokens_train_as_bypass_mode():
    """alpha is 0 at staleness 0 and 1 (batches): pi_prox is pi_rollout, the TIS weight 1, and the
    step is bypass mode's (PPO clipped against the engine); the mismatch metrics read 0."""

    def run(correction):
        model = tiny_model()
        batch = stale_rollout(model)
        near = torch.where(batch.policy_version >= 6, batch.policy_version, torch.full_like(batch.policy_version, 6))
        batch = batch.with_fields(policy_version=torch.where(batch.response_mask.bool(), near, batch.policy_version))
        module = make_module(model, correction=correction, num_minibatches=2)
        trainer = fit_on(module, [batch], max_steps=2)
        return module, trainer.callback_metrics

    loglinear, metrics = run(LOGLINEAR)
    bypass, _ = run(C.bypass())
    assert max_param_diff(loglinear.policy, bypass.policy) < 1e-6
    assert float(metrics["rollout_corr/kl"]) == 0.0
    assert float(metrics["rollout_corr/is_weight_mean"]) == 1.0


def test_the_mismatch_metrics_compare_the_interpolated_prox_with_pi_rollout():
    """One step, one micro-batch: rollout_corr/kl (mean of log pi_rollout - log pi_prox) is the token
    mean of alpha * (log pi_rollout - log pi_theta), pi_theta the weights at the start of the step."""
    model = tiny_model()
    batch = stale_rollout(model)
    module = make_module(model, num_minibatches=1)
    start = copy.deepcopy(model)
    trainer = fit_on(module, [batch], max_steps=1)
    diffs = []
    for i, (prompt, response, rollout, _) in enumerate(rows_of(batch)):
        with torch.no_grad():
            theta = reference_logprobs(start.double(), prompt, response)
        prox = areal_loglinear(rollout, theta, batch.policy_version[i, : len(response)], STEP_VERSION)
        diffs.append(rollout - prox)
    expected = torch.cat(diffs).mean().item()
    assert abs(expected) > 1e-2
    assert float(trainer.callback_metrics["rollout_corr/kl"]) == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_under_a_sampling_mask_the_interpolation_reads_renormalized_logprobs():
    """top-k / top-p: pi_rollout and pi_theta are both renormalized over the kept support, so an engine
    with the trainer's weights gives pi_prox == pi_rollout even where alpha > 0 (no log(kept mass)
    term: without the renormalization rollout_corr/kl would read alpha * log(kept mass) < 0)."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    responses = [[20, 21, 22], [23, 24], [25, 26, 27, 28], [29]]
    # Each token's kept set: itself and three others (some rows uncut: [] keeps everything).
    supports = [
        [[tok, *torch.randperm(34, generator=gen)[:3].add(30).tolist()] if r % 2 == 0 else [] for tok in resp]
        for r, resp in enumerate(responses)
    ]
    batch = RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=[0.0, 1.0, 0.5, 0.2],
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        group_ids=[0, 1, 2, 3],
        policy_versions=[0, 2, 4, 6],
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        pad_token_id=TOKENIZER.pad_token_id,
        sampling_supports=supports,
    )
    with torch.no_grad():
        renormalized = causal_lm_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_length,
            1.0,
            sampling_support=batch.sampling_support,
        )
        full = causal_lm_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length, 1.0)
    mask = batch.response_mask.bool()
    batch = batch.with_fields(rollout_logprobs=torch.where(mask, renormalized, torch.zeros_like(renormalized)))
    assert float((full - renormalized)[mask].min()) < -1e-2  # the cut carries real mass
    module = make_module(model, num_minibatches=1)
    trainer = fit_on(module, [batch], max_steps=1)
    assert abs(float(trainer.callback_metrics["rollout_corr/kl"])) < 1e-6
    assert float(trainer.callback_metrics["rollout_corr/abs_logprob_diff_max"]) < 1e-5
