"""RL with your own reward function: any ``(prompts, completions, metadata) -> rewards`` callable.

The built-in tasks give partial credit per correct character. Here the reward is stricter: 1.0 for
an exact answer, and a small length-shaping term otherwise, on the `reverse` prompts. The reward
function is handed to the ``RolloutCallback``; everything else is the quickstart.

    python examples/custom_reward.py --max-steps 200
"""

from __future__ import annotations

import argparse
from functools import partial

import lightning as L
import torch

from lightning_offpolicy.correction import OffPolicyCorrectionConfig
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.progress import RLProgressBar
from lightning_offpolicy.rollout import HFEngine, SamplingConfig


def exact_match_reward(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float]:
    """1.0 for the exact answer; otherwise up to 0.2 for getting the length right."""
    rewards = []
    for completion, meta in zip(completions, metadata, strict=True):
        answer = meta["answer"]
        if completion.strip() == answer:
            rewards.append(1.0)
        else:
            rewards.append(0.2 * max(0.0, 1.0 - abs(len(completion.strip()) - len(answer)) / len(answer)))
    return rewards


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps (2 per batch)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--logdir", default="runs", help="TensorBoard directory")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    data = PromptDataModule(task="reverse", prompts_per_step=args.prompts_per_step)
    module = OffPolicyRLModule(
        model="tiny:reverse",
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        correction=OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.98, high=1.02),
        num_minibatches=2,
    )
    rollout = RolloutCallback(
        engine=HFEngine(dtype="bfloat16"),
        reward_fn=exact_match_reward,
        sampling=SamplingConfig(samples_per_prompt=8, max_new_tokens=data.task.max_new_tokens),
    )
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=[rollout, RLProgressBar()],  # counts batches (2 optimizer steps each), not optimizer steps
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name="custom_reward"),
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print(f"reward {metrics['train/reward']:.3f} | rollout_corr/kl {metrics['rollout_corr/kl']:.2e}")
    return metrics


if __name__ == "__main__":
    main()
