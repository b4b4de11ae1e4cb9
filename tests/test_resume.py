"""Save -> resume -> compare: the module's policy version and weights and the callback's state survive."""

from __future__ import annotations

from functools import partial

import lightning as L
import torch

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import HFEngine, SamplingConfig


def build(max_steps: int, root):
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3), num_minibatches=2)
    callback = RolloutCallback(
        engine=HFEngine(dtype="bfloat16"), sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=7), seed=3
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[callback],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return module, callback, trainer


def test_resume_restores_version_weights_and_callback_state(tmp_path):
    data = PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64)
    module, callback, trainer = build(4, tmp_path)
    trainer.fit(module, data)
    checkpoint = tmp_path / "after4.ckpt"
    trainer.save_checkpoint(checkpoint)
    assert module.policy_version == 4 and callback.generated_batches == 2

    resumed, resumed_callback, resumed_trainer = build(6, tmp_path)
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["version"] = pl_module.policy_version
            seen["batches"] = resumed_callback.generated_batches
            seen["weights"] = [p.detach().clone() for p in pl_module.policy.parameters()]

    resumed_trainer.callbacks.append(Probe())
    resumed_trainer.fit(
        resumed, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64), ckpt_path=checkpoint
    )
    assert seen["version"] == 4 and seen["batches"] == 2
    for restored, saved in zip(seen["weights"], module.policy.parameters(), strict=True):
        torch.testing.assert_close(restored, saved.detach(), rtol=0, atol=0)
    assert resumed.policy_version == 6 == resumed_trainer.global_step
    assert resumed_callback.generated_batches == 3
