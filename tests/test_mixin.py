"""OffPolicyMixin: an ordinary SFT LightningModule trained with RL steps, equal to OffPolicyRLModule's step."""

from __future__ import annotations

import copy
from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig
from lightning_offpolicy.mixin import OffPolicyMixin
from lightning_offpolicy.module import OffPolicyRLModule
from tests.module_helpers import TOKENIZER, fit_on, make_rollout, tiny_model

CORRECTION = OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.8, high=1.25, clip_high=1.5)
LOSS = PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28)


class SFTModule(L.LightningModule):
    """A user's module: its own training_step, hooks that call super(), an SGD optimizer."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = TOKENIZER
        self.own_steps = 0
        self.zero_grad_calls = 0

    def training_step(self, batch, batch_idx):
        self.own_steps += 1
        return self.model(input_ids=batch).logits.float().square().mean() * 0.0

    def on_before_zero_grad(self, optimizer):
        self.zero_grad_calls += 1
        super().on_before_zero_grad(optimizer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.05)


class RLModule(OffPolicyMixin, SFTModule):
    rl_correction = CORRECTION
    rl_loss = LOSS


def test_mixin_step_equals_the_module_step_and_leaves_the_users_hooks_alone():
    model = tiny_model()
    rollout = make_rollout(model, seed=4, rows=6)

    mixed = RLModule(copy.deepcopy(model))
    fit_on(mixed, [rollout], max_steps=1, gradient_clip_val=None)
    reference = OffPolicyRLModule(
        model=copy.deepcopy(model),
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=0.05),
        correction=CORRECTION,
        loss=LOSS,
        gradient_clip_val=None,
        max_tokens_per_microbatch=10_000,
    )
    fit_on(reference, [rollout], max_steps=1)

    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), mixed.model.parameters(), strict=True))
    assert moved > 1e-4
    for a, b in zip(mixed.model.parameters(), reference.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The RL batch never reached the user's training_step; their hook ran, the version counted once.
    assert mixed.own_steps == 0 and mixed.zero_grad_calls == 1 and mixed.policy_version == 1


def test_mixin_passes_other_batches_to_the_users_training_step_and_checkpoints_the_version(tmp_path):
    module = RLModule(tiny_model())
    trainer = fit_on(module, [torch.tensor([[1, 5, 6, 7]])] * 3, max_steps=3)
    assert module.own_steps == 3 and module.policy_version == 3
    trainer.save_checkpoint(tmp_path / "sft.ckpt")
    assert torch.load(tmp_path / "sft.ckpt", weights_only=False)["policy_version"] == 3
    restored = RLModule(tiny_model())
    restored.on_load_checkpoint({"policy_version": 3})
    assert restored.policy_version == 3


def test_mixin_names_what_is_missing():
    class NoModel(OffPolicyMixin, L.LightningModule):
        policy_attribute = "lm"

    with pytest.raises(TypeError, match="no attribute 'lm'"):
        _ = NoModel().policy
