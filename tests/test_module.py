"""OffPolicyRLModule: one decoupled step against a hand-written float64 reference, and its errors."""

from __future__ import annotations

import copy
from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from tests.module_helpers import (
    TOKENIZER,
    fit_on,
    fused_step_on_aot_eager,
    make_rollout,
    reference_decoupled_sgd,
    rows_of,
    tiny_model,
)

LR = 0.002


def make_module(model, **kwargs) -> OffPolicyRLModule:
    defaults = dict(
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=LR),
        correction=OffPolicyCorrectionConfig.token_tis(clip_high=1.5),
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28),
        gradient_clip_val=None,
        shuffle_minibatches=False,
    )
    defaults.update(kwargs)
    return OffPolicyRLModule(model=model, **defaults)


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (pa.double() - pb.double()).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("num_minibatches", "max_tokens", "fused_loss"),
    [(1, 10_000, False), (1, 12, False), (2, 10_000, False), (3, 9, False), (1, 10_000, True), (3, 9, True)],
    ids=[
        "one-step",
        "micro-batched",
        "two-minibatches",
        "three-minibatches-micro-batched",
        "fused-one-step",
        "fused-three-minibatches-micro-batched",
    ],
)
def test_decoupled_step_equals_hand_computed_reference(num_minibatches, max_tokens, fused_loss, monkeypatch):
    if fused_loss and num_minibatches == 1:  # inductor's code for the step: the micro-batched case below
        fused_step_on_aot_eager(monkeypatch)
    model = tiny_model()
    batch = make_rollout(model)
    start = copy.deepcopy(model)
    module = make_module(
        model, num_minibatches=num_minibatches, max_tokens_per_microbatch=max_tokens, fused_loss=fused_loss
    )
    fit_on(module, [batch], max_steps=num_minibatches)

    rows = torch.arange(batch.num_sequences)
    minibatches = [part.tolist() for part in torch.tensor_split(rows, num_minibatches)]
    expected = reference_decoupled_sgd(start, batch, minibatches, LR, tis_cap=1.5, eps_low=0.2, eps_high=0.28)
    moved = max_param_diff(start, expected)
    assert moved > 1e-3  # the step is not trivially zero
    assert max_param_diff(module.policy, expected) < 1e-5 * max(1.0, moved), moved
    assert module.policy_version == num_minibatches


def test_step_changes_weights_increments_version_and_logs_finite_metrics():
    model = tiny_model()
    module = make_module(model, correction=OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.5, high=2.0), ppo_epochs=2)
    before = copy.deepcopy(model)
    trainer = fit_on(module, [make_rollout(model), make_rollout(model, seed=1)], max_steps=4)
    assert module.policy_version == 4 == trainer.global_step
    assert max_param_diff(before, module.policy) > 0
    metrics = trainer.callback_metrics
    for key in (
        "rollout_corr/kl",
        "rollout_corr/chi2_token",
        "ppo/clip_frac",
        "train/reward",
        "train/grad_norm",
    ):
        assert torch.isfinite(metrics[key]), key
    # The injected mismatch (noise 0.3 on rollout logprobs) shows up in the metric.
    assert float(metrics["rollout_corr/abs_logprob_diff_mean"]) > 0.1


def test_an_impossible_rollout_token_trains_finite_and_is_rejected():
    """A rollout logprob of -inf (vLLM's answer under top-k / top-p) reaches the step: the batch accepts it,
    the token mask rejects that token, and the weights and metrics stay finite."""
    model = tiny_model()
    batch = make_rollout(model)
    row, token = 2, int(batch.response_mask[2].nonzero()[0])
    logprobs = batch.rollout_logprobs.clone()
    logprobs[row, token] = float("-inf")
    batch = batch.with_fields(rollout_logprobs=logprobs)
    module = make_module(model, correction=OffPolicyCorrectionConfig.token_mis(low=0.5, high=2.0))
    trainer = fit_on(module, [batch], max_steps=1)
    assert module.policy_version == 1
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    metrics = trainer.callback_metrics
    keys = ("rollout_corr/kl", "rollout_corr/chi2_token", "rollout_corr/total_token_reject_rate", "train/grad_norm")
    for key in keys:
        assert torch.isfinite(metrics[key]), key
    assert float(metrics["rollout_corr/total_token_reject_rate"]) >= 1 / batch.response_mask.sum()


def test_bypass_mode_skips_the_proximal_forward(monkeypatch):
    model = tiny_model()
    module = make_module(model, correction=OffPolicyCorrectionConfig.bypass())
    calls = []
    original = module.update.no_grad_logprobs
    monkeypatch.setattr(module.update, "no_grad_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    fit_on(module, [make_rollout(model)], max_steps=1)
    assert calls == []
    assert module.policy_version == 1


def test_one_micro_batch_takes_pi_prox_from_the_training_forward(monkeypatch):
    """With the whole batch in one micro-batch and one optimizer step per pass, pi_prox is the detached
    output of the step's own forward: one policy forward per batch instead of two, and the same step
    (weights and logged metrics) as with the separate no-gradient forward."""

    def run(one_forward: bool):
        model = tiny_model()
        module = make_module(model, ppo_epochs=2)
        batches = [make_rollout(model), make_rollout(model, seed=1)]
        forwards = []
        # The decoder: the fused lm_head path calls it, not the causal LM's own forward.
        model.base_model.register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
        if not one_forward:
            monkeypatch.setattr(module.update, "fits_one_forward", lambda rollout, hooks: False)
        trainer = fit_on(module, batches, max_steps=4)
        return module, trainer, forwards

    fused, fused_trainer, fused_forwards = run(True)
    separate, separate_trainer, separate_forwards = run(False)
    # 2 batches x 2 epochs, each a forward with gradient; the separate path adds a no-grad forward per batch.
    assert fused_forwards == [True] * 4
    assert separate_forwards == [False, True, True] * 2
    assert max_param_diff(fused.policy, separate.policy) < 1e-6
    for key, value in separate_trainer.callback_metrics.items():
        if key.startswith("perf/"):  # wall-clock figures
            continue
        assert float(fused_trainer.callback_metrics[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


def test_several_micro_batches_keep_the_no_gradient_forward():
    model = tiny_model()
    module = make_module(model, max_tokens_per_microbatch=12)
    batch = make_rollout(model)
    assert len(batch.micro_batch_rows(12)) > 1
    calls = []
    original = module.update.no_grad_logprobs
    module.update.no_grad_logprobs = lambda *a, **k: calls.append(1) or original(*a, **k)
    fit_on(module, [batch], max_steps=1)
    assert calls == [1]


class _ListLogger(L.pytorch.loggers.Logger):
    """Keeps what the Trainer sends to a logger: ``{step: metrics}``."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    name = "list"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.steps.setdefault(step, {}).update({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_metrics_are_computed_only_for_the_logger_and_equal_every_step_logging():
    """log_every_n_steps=3: the logger receives, at each of its steps, the values it receives with
    log_every_n_steps=1; the metrics are computed on those batches only, plus the last one (so that
    callback_metrics end with the final batch's values)."""

    def run(every: int):
        torch.manual_seed(0)
        model = tiny_model()
        module = make_module(model)
        computes = []
        original = module.correction_metrics.compute
        module.correction_metrics.compute = lambda: computes.append(module.policy_version) or original()
        logger = _ListLogger()
        batches = [make_rollout(model, seed=i) for i in range(7)]
        trainer = fit_on(module, batches, max_steps=7, logger=logger, log_every_n_steps=every)
        return logger.steps, computes, trainer.callback_metrics

    every_step, all_computes, last_metrics = run(1)
    sparse, sparse_computes, sparse_last = run(3)
    # Computed after each batch's optimizer step (policy_version counts the steps done).
    assert all_computes == [1, 2, 3, 4, 5, 6, 7]
    assert sparse_computes == [3, 6, 7]  # batches 3 and 6 (log_every_n_steps) and the last one
    assert set(sparse) <= set(every_step) and len(sparse) >= 2
    for logged_step, values in sparse.items():
        for key, value in values.items():
            if key.startswith("perf/"):  # wall-clock figures
                continue
            assert value == pytest.approx(every_step[logged_step][key], rel=1e-6, abs=1e-7), (logged_step, key)
    for key, value in last_metrics.items():
        if key.startswith("perf/"):
            continue
        assert float(sparse_last[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-7), key


def test_reference_kl_uses_a_frozen_copy_that_does_not_move():
    model = tiny_model()
    module = make_module(model, loss=PolicyLossConfig(ref_kl_coef=0.5), correction=OffPolicyCorrectionConfig.disabled())
    assert module.reference_model is not None
    frozen = copy.deepcopy(module.reference_model)
    fit_on(module, [make_rollout(model)], max_steps=2, limit_train_batches=1, max_epochs=2)
    assert max_param_diff(frozen, module.reference_model) == 0.0
    assert max_param_diff(frozen, module.policy) > 0


def test_missing_rollouts_fail_with_the_fix():
    model = tiny_model()
    module = make_module(model)
    with pytest.raises(RuntimeError, match="RolloutCallback"):
        fit_on(module, [PromptBatch(prompts=["rev abc="])], max_steps=1)


def test_missing_rollout_logprobs_fail_fast_naming_the_engine_setting():
    model = tiny_model()
    batch = make_rollout(model).with_fields(rollout_logprobs=None)
    with pytest.raises(ValueError, match="logprobs=0"):
        fit_on(make_module(model), [batch], max_steps=1)


def test_nan_rollout_logprobs_fail_fast():
    model = tiny_model()
    batch = make_rollout(model)
    bad = batch.rollout_logprobs.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_logprobs has 1 NaN"):
        fit_on(make_module(model), [batch.with_fields(rollout_logprobs=bad)], max_steps=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(ppo_epochs=0), "ppo_epochs"),
        (dict(num_minibatches=-1), "num_minibatches"),
        (dict(max_tokens_per_microbatch=0), "max_tokens_per_microbatch"),
        (dict(gradient_clip_val=0.0), "gradient_clip_val"),
        (dict(temperature=0.0), "temperature"),
        (dict(reference="base"), "reference"),
        (
            dict(correction=OffPolicyCorrectionConfig.cispo(), loss=PolicyLossConfig(loss_type="gspo")),
            "loss_type",
        ),
        (dict(reference="disable_adapter", loss=PolicyLossConfig(ref_kl_coef=0.1)), "peft"),
    ],
)
def test_invalid_arguments_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_module(tiny_model(), **kwargs)


def test_model_instance_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        OffPolicyRLModule(model=tiny_model())


def test_too_many_minibatches_for_the_rows():
    model = tiny_model()
    with pytest.raises(ValueError, match="num_minibatches"):
        fit_on(make_module(model, num_minibatches=50), [make_rollout(model)], max_steps=1)


def test_staleness_is_logged_per_token_against_the_version_of_the_step():
    model = tiny_model()
    batch = make_rollout(model)
    # Tokens generated 0, 1 and 3 versions before the step (padding holds -1 and must not count).
    versions = batch.policy_version.clone()
    stamps = torch.tensor([0, -1, -3, 0, -1, -3])[:, None].expand_as(versions)
    batch = batch.with_fields(policy_version=torch.where(batch.response_mask.bool(), stamps, versions))
    expected = (-stamps)[batch.response_mask.bool()].float()
    module = make_module(model)
    trainer = fit_on(module, [batch], max_steps=1)
    assert float(trainer.callback_metrics["staleness/mean"]) == pytest.approx(expected.mean().item())
    assert float(trainer.callback_metrics["staleness/max"]) == 3.0


@pytest.mark.parametrize(
    "correction",
    [
        OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.7, high=1.3),
        OffPolicyCorrectionConfig.bypass_ppo_clip_k3_rs(threshold=0.1),
        OffPolicyCorrectionConfig.bypass_pg_token_icepop(low=0.7, high=1.4),
    ],
    ids=["geo_mis_token_tis", "bypass_ppo_clip_k3_rs", "bypass_pg_token_icepop"],
)
def test_fused_loss_logs_what_the_eager_step_logs(correction, monkeypatch):
    """fused_loss=True over several micro-batched, two-epoch steps with rejections: the same weights
    and, at every logged step, the same metrics as the eager path (the correction per micro-batch
    adds up to the whole batch's). In bypass mode both paths compute the masks per micro-batch from
    the current policy, and no proximal forward runs. The fused step's traced graph runs op by op
    (``aot_eager``): inductor's code for these presets is tests/test_fused_correction.py's, and the
    module's micro-batched fit through inductor is test_decoupled_step_equals_hand_computed_reference's."""
    fused_step_on_aot_eager(monkeypatch)

    def run(fused: bool):
        torch.manual_seed(0)
        model = tiny_model()
        module = make_module(
            model,
            correction=correction,
            loss=PolicyLossConfig(),
            ppo_epochs=2,
            max_tokens_per_microbatch=12,
            fused_loss=fused,
        )
        prox_forwards = []
        original = module.update.no_grad_logprobs
        module.update.no_grad_logprobs = lambda *a, **k: prox_forwards.append(1) or original(*a, **k)
        logger = _ListLogger()
        batches = [make_rollout(model, seed=i, mismatch=0.5) for i in range(3)]
        fit_on(module, batches, max_steps=6, logger=logger, log_every_n_steps=1)
        assert bool(prox_forwards) == correction.needs_prox
        return module, logger.steps

    eager, eager_steps = run(False)
    fused, fused_steps = run(True)
    assert fused._fused_steps, "the fused step was not used"
    assert max_param_diff(eager.policy, fused.policy) < 1e-5
    assert eager_steps.keys() == fused_steps.keys()
    rejected = [values["rollout_corr/total_token_reject_rate"] for values in eager_steps.values()]
    assert max(rejected) > 0, "the test needs rejected tokens"
    for step, values in eager_steps.items():
        assert values.keys() == fused_steps[step].keys()
        for key, value in values.items():
            if key.startswith("perf/"):
                continue
            assert fused_steps[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_bypass_mode_logs_the_mismatch_of_the_current_policy(fused, monkeypatch):
    """Plain bypass mode has no pi_prox (pi_prox := pi_rollout would log 0): it logs the mismatch of
    pi_theta against pi_rollout per micro-batch. On one mini-batch pi_theta is the step's starting
    policy, so the metrics equal those the decoupled step logs from its proximal forward."""

    def logged(correction, fused_loss):
        torch.manual_seed(0)
        model = tiny_model()
        module = make_module(model, correction=correction, max_tokens_per_microbatch=12, fused_loss=fused_loss)
        logger = _ListLogger()
        fit_on(module, [make_rollout(model, mismatch=0.5)], max_steps=1, logger=logger, log_every_n_steps=1)
        (values,) = logger.steps.values()
        return {k: v for k, v in values.items() if k.startswith("rollout_corr/")}

    fused_step_on_aot_eager(monkeypatch)  # what the module logs; inductor's numbers: test_fused_correction.py
    decoupled = logged(OffPolicyCorrectionConfig.disabled(), False)
    bypass = logged(OffPolicyCorrectionConfig.bypass(), fused)
    assert decoupled["rollout_corr/abs_logprob_diff_mean"] > 0.1  # a mismatch to see
    assert bypass.keys() == decoupled.keys()
    for key, value in decoupled.items():
        assert bypass[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_fused_loss_refuses_a_whole_batch_weight_mean():
    with pytest.raises(ValueError, match=r"fused_loss=True .* correction\.normalize_weights"):
        make_module(
            tiny_model(),
            correction=OffPolicyCorrectionConfig(tis_level="token", normalize_weights=True),
            fused_loss=True,
        )


@pytest.mark.parametrize("fused_loss", [False, True], ids=["eager", "fused"])
def test_entropy_bonus_moves_the_weights_along_the_entropy_gradient(fused_loss):
    """One SGD step with entropy_coef = c, minus the same step with c = 0, equals lr * c * grad of the
    response tokens' mean entropy, computed from full float64 logits by hand (an independent reference)."""
    coef = 0.5
    model = tiny_model()
    batch = make_rollout(model)
    start = copy.deepcopy(model)

    def step(entropy_coef: float) -> torch.nn.Module:
        module = make_module(
            copy.deepcopy(start), loss=PolicyLossConfig(entropy_coef=entropy_coef), fused_loss=fused_loss
        )
        fit_on(module, [batch], max_steps=1)
        return module.policy

    with_bonus, without = step(coef), step(0.0)

    reference = copy.deepcopy(start).double()
    total, count = 0.0, 0
    for prompt, response, _, _ in rows_of(batch):
        logits = reference(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits, dim=-1)
        total = total + (-(logp.exp() * logp).sum(-1)).sum()
        count += len(response)
    (total / count).backward()
    for (name, moved), plain, ref in zip(
        with_bonus.named_parameters(), without.parameters(), reference.parameters(), strict=True
    ):
        expected = LR * coef * ref.grad
        torch.testing.assert_close((moved - plain).double(), expected, rtol=1e-3, atol=2e-7, msg=name)
    assert max(p.grad.abs().max() for p in reference.parameters()) > 1e-3, "the entropy has a gradient"


def test_the_no_gradient_pass_fills_every_row_and_runs_the_padding_micro_batches_of_the_other_ranks():
    """PPOUpdate.no_grad_logprobs: micro-batch by micro-batch, each row's logprobs where the whole batch's forward
    puts them; a rank with fewer micro-batches than the most any rank has runs padding ones (their forwards are
    collectives under FSDP2) and keeps nothing of them."""
    from lightning_offpolicy.train import step as train_step

    model = tiny_model()
    module = make_module(model, max_tokens_per_microbatch=12)
    batch = make_rollout(model)
    rows = module.update.micro_batch_rows(batch)
    assert len(rows) > 1
    seen = []

    class Hooks:
        world_size = 1

        def global_max(self, value: int) -> int:
            return value + 2  # another rank has two micro-batches more

        def no_grad_forward(self, micro, reference: bool) -> torch.Tensor:
            seen.append((micro.num_response_tokens, torch.is_grad_enabled(), reference))
            return train_step.response_logprobs(model, micro, 1.0)

    out = module.update.no_grad_logprobs(batch, Hooks(), reference=False)
    with torch.no_grad():
        whole = train_step.response_logprobs(model, batch, 1.0)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(out[mask], whole[mask], rtol=0, atol=1e-5)
    assert len(seen) == len(rows) + 2 and [tokens for tokens, _, _ in seen[-2:]] == [0, 0]
    assert not any(grad for _, grad, _ in seen) and not any(reference for _, _, reference in seen)
