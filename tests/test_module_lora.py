"""LoRA and gradient checkpointing in OffPolicyRLModule: what is trained, the reference, recomputation."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from lightning_offpolicy.correction import PolicyLossConfig
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.update_hooks import ManualOptimizationHooks
from tests.module_helpers import TOKENIZER, fit_on, make_rollout, tiny_model


def lora_module(model, **kwargs) -> OffPolicyRLModule:
    return OffPolicyRLModule(
        model=model,
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=0.5),
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=["q_proj", "v_proj"],
        gradient_clip_val=None,
        **kwargs,
    )


def test_lora_trains_only_the_adapters_and_uses_the_base_model_as_reference():
    model = tiny_model()
    base = copy.deepcopy(model)
    module = lora_module(model, loss=PolicyLossConfig(ref_kl_coef=0.1))
    assert hasattr(module.policy, "disable_adapter") and module.reference_model is None  # no second copy
    optimizer = module.configure_optimizers()
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = [n for n, p in module.policy.named_parameters() if id(p) in trained]
    assert names and all("lora_" in n for n in names), names
    rollout = make_rollout(base, seed=2, rows=4)
    # peft initialises lora_B at 0: give the adapters a value so that policy and reference differ.
    with torch.no_grad():
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    adapters_before = [p.detach().clone() for n, p in module.policy.named_parameters() if "lora_" in n]
    fit_on(module, [rollout], max_steps=1)
    adapters_after = [p for n, p in module.policy.named_parameters() if "lora_" in n]
    assert any((a - b).abs().max() > 0 for a, b in zip(adapters_after, adapters_before, strict=True))
    # Base weights untouched (only the adapters were in the optimizer).
    merged_names = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p
        for n, p in module.policy.named_parameters()
        if "lora_" not in n
    }
    for name, param in base.named_parameters():
        torch.testing.assert_close(merged_names[name], param, rtol=0, atol=0)
    # The reference is the base model: the policy with its adapters disabled.
    hooks = ManualOptimizationHooks(module)
    ref = module.update.no_grad_logprobs(rollout.to("cpu"), hooks, reference=True)
    with torch.no_grad():
        expected = module.sequence_logprobs(rollout, model=base)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(ref[mask], expected[mask], rtol=1e-5, atol=1e-5)
    policy = module.update.no_grad_logprobs(rollout, hooks, reference=False)
    assert (policy[mask] - expected[mask]).abs().max() > 1e-3  # adapters on: differs


def test_gradient_checkpointing_recomputes_layers_and_leaves_the_step_unchanged():
    model = tiny_model()
    rollout = make_rollout(model, seed=5, rows=4)
    plain = OffPolicyRLModule(
        model=copy.deepcopy(model), tokenizer=TOKENIZER, optimizer=partial(torch.optim.SGD, lr=0.1)
    )
    checkpointed = OffPolicyRLModule(
        model=copy.deepcopy(model),
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        gradient_checkpointing=True,
    )
    fit_on(plain, [rollout], max_steps=1)
    calls = {"n": 0}
    layer = checkpointed.policy.model.layers[0]
    forward = layer.forward

    def counting_forward(*args, **kwargs):  # forward hooks do not fire on the recomputation
        calls["n"] += 1
        return forward(*args, **kwargs)

    layer.forward = counting_forward
    fit_on(checkpointed, [rollout], max_steps=1)
    # One forward with grad (pi_prox is its detached output: one micro-batch) and its recomputation
    # in the backward pass.
    assert calls["n"] == 2, calls
    assert not any(m.training for m in layer.modules() if m is not layer)  # dropout & co stay in eval mode
    for a, b in zip(plain.policy.parameters(), checkpointed.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"lora_rank": -1}, "lora_rank=-1"), ({"lora_alpha": 0}, "lora_alpha=0")]
)
def test_bad_lora_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffPolicyRLModule(model=tiny_model(), tokenizer=TOKENIZER, **kwargs)
