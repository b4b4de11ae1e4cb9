"""A tool-using agent in Python: a tiny Qwen2 learns to answer products by calling a `multiply` tool.

1. **Checkpoint**: :func:`lightning_offpolicy.demo.tool_use.prepare_tool_use_checkpoint` builds (once,
   cached) a tiny Qwen2 with a BPE tokenizer and Qwen2.5-Instruct's chat template, warmed up on solved
   episodes to call the tool. Replace it by your own instruct checkpoint.
2. **Episodes**: ``RolloutCallback(episodes=EpisodeSettings(tools=[multiply]))``: the chat template shows
   the tool to the model, a reply's ``<tool_call>`` runs it, and its result is appended as context that
   is not trained (docs/multi_turn.md). The episode ends at a reply without a call.
3. **Reward**: the ``multiply`` task's own: 1 when the last turn states the exact product.

    python examples/tool_use_agent.py                    # build (~2.5 min the first time) + 100 RL batches
    python examples/tool_use_agent.py --rl-steps 0       # only build the checkpoint
    lightning-offpolicy fit --config configs/tool_use.yaml   # the same run from YAML, with evaluation
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import lightning as L
import torch

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.data.tasks.tool_use import multiply
from lightning_offpolicy.demo.tool_use import prepare_tool_use_checkpoint
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.progress import RLProgressBar
from lightning_offpolicy.rollout import HFEngine, SamplingConfig
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings


class RewardHistory(L.Callback):
    """The mean reward of every trained batch."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rewards.append(float(batch.rollout.rewards.mean()))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rl-steps", type=int, default=100, help="RL batches (one optimizer step each)")
    parser.add_argument("--rl-lr", type=float, default=3e-4, help="RL learning rate (AdamW)")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="warm-up steps (default: the checkpoint's); a custom warm-up is built without measuring its success",
    )
    parser.add_argument("--logdir", default="runs", help="TensorBoard directory")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model gains nothing from more threads
    L.seed_everything(0)
    settings = {} if args.sft_steps is None else {"sft_steps": args.sft_steps, "eval_prompts": 0}
    checkpoint = prepare_tool_use_checkpoint(**settings)
    print(f"checkpoint: {checkpoint}")
    if args.rl_steps == 0:
        return {}

    module = OffPolicyRLModule(model=str(checkpoint), optimizer=partial(torch.optim.AdamW, lr=args.rl_lr))
    history = RewardHistory()
    rollout = RolloutCallback(
        HFEngine(),
        sampling=SamplingConfig(samples_per_prompt=8, max_new_tokens=48),
        episodes=EpisodeSettings(tools=[multiply], max_turns=3, max_episode_tokens=208),
    )
    trainer = L.Trainer(
        max_steps=args.rl_steps,
        accelerator="cpu",
        devices=1,
        callbacks=[rollout, history, RLProgressBar()],  # no reward_fn: the task's own
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name="tool_use_agent"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        limit_val_batches=0,  # held-out evaluation: see configs/tool_use.yaml
    )
    trainer.fit(module, datamodule=PromptDataModule(task="multiply", prompts_per_step=8, num_train_prompts=2048))
    window = max(1, min(10, len(history.rewards) // 2))
    metrics = {
        "reward_first": statistics.fmean(history.rewards[:window]),
        "reward_last": statistics.fmean(history.rewards[-window:]),
        "steps": float(len(history.rewards)),
    }
    print(
        f"success, first {window} batches {metrics['reward_first']:.3f} -> last {window} {metrics['reward_last']:.3f}"
    )
    return metrics


if __name__ == "__main__":
    main()
