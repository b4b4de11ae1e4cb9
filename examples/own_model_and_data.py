"""Your own model, data and reward: a real-format checkpoint directory trained on a reasoning-gym task.

1. **Data and reward**: ``DatasetDataModule(source="reasoning_gym:basic_arithmetic")`` generates the
   task locally (no download) and scores completions with the task's own scorer. The task is set to
   its simplest form (one term of 1-3 digits, so ``"Calculate 482."`` -> ``"482"``), which a tiny
   model learns on a CPU in seconds; raise ``min_terms`` / ``max_terms`` for real arithmetic.
2. **Model and tokenizer**: :func:`lightning_offpolicy.demo.tiny_bpe.build_bpe_checkpoint` writes an
   ordinary Hugging Face directory: a tiny Qwen2 built from a config, a byte-level BPE tokenizer
   trained on the task's text, a ChatML chat template, a generation config that stops on
   ``<|im_end|>`` and ``<|endoftext|>``; then a short supervised warm-up teaches it the answer
   format (a real instruct model already knows it). Replace this step by your own checkpoint.
3. **RL**: ``OffPolicyRLModule(model=<directory>)`` loads the model and, with
   ``HFTokenizer(chat_template=True)``, renders every prompt through the tokenizer's chat template.

    python examples/own_model_and_data.py                       # build + warm up the checkpoint, then RL
    python examples/own_model_and_data.py --rl-steps 0          # only build checkpoints/tiny-qwen2-arith
    lightning-offpolicy fit --config configs/reasoning_gym.yaml # the same RL run from YAML
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from pathlib import Path

import lightning as L
import torch

from lightning_offpolicy.data import DatasetDataModule
from lightning_offpolicy.data.tokenizers import HFTokenizer
from lightning_offpolicy.demo.tiny_bpe import build_bpe_checkpoint
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.progress import RLProgressBar
from lightning_offpolicy.rollout import HFEngine, SamplingConfig

#: basic_arithmetic at its simplest: one term of 1-3 digits, no sign, no parentheses.
TASK_CONFIG = {"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 3}
TASK_CONFIG |= {"allow_parentheses": False, "allow_negation": False}


class RewardHistory(L.Callback):
    """Mean reward of every training batch (placed after the RolloutCallback, which attaches it)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rewards.append(float(batch.rollout.rewards.mean()))


def make_data(prompts_per_step: int = 8, seed: int = 0) -> DatasetDataModule:
    return DatasetDataModule(
        source="reasoning_gym:basic_arithmetic",
        reasoning_gym_config=TASK_CONFIG,
        reasoning_gym_size=1000,
        val_size=64,
        prompts_per_step=prompts_per_step,
        seed=seed,
    )


def build_checkpoint(directory: Path, data: DatasetDataModule, sft_steps: int, seed: int = 0) -> Path:
    """The tokenizer learns the task's text; the warm-up pairs are the training prompts and answers."""
    rows = [data.train_dataset[i] for i in range(len(data.train_dataset))]
    texts = [question for question, _ in rows] + [entry["answer"] for _, entry in rows]
    pairs = [(question, entry["answer"]) for question, entry in rows]
    return build_bpe_checkpoint(
        directory, texts, architecture="qwen2", vocab_size=300, sft_pairs=pairs, sft_steps=sft_steps, seed=seed
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/tiny-qwen2-arith"))
    parser.add_argument("--sft-steps", type=int, default=80, help="supervised warm-up steps of the new model")
    parser.add_argument("--rl-steps", type=int, default=200, help="RL optimizer steps (one per batch)")
    parser.add_argument("--rl-lr", type=float, default=1e-3, help="RL learning rate (AdamW)")
    parser.add_argument("--logdir", default="runs", help="TensorBoard directory")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model gains nothing from more threads
    L.seed_everything(0)
    data = make_data()
    checkpoint = build_checkpoint(args.checkpoint, data, args.sft_steps)
    print(f"checkpoint: {checkpoint}")
    if args.rl_steps == 0:
        return {"checkpoint": str(checkpoint)}

    module = OffPolicyRLModule(
        model=str(checkpoint),  # any Hugging Face checkpoint directory
        tokenizer=HFTokenizer(chat_template=True),  # loaded from the model's directory, prompts as chat
        optimizer=partial(torch.optim.AdamW, lr=args.rl_lr),
    )
    history = RewardHistory()
    trainer = L.Trainer(
        max_steps=args.rl_steps,
        accelerator="cpu",
        devices=1,
        # No reward_fn: the datamodule's reasoning-gym scorer is used.
        # RLProgressBar: Lightning's default bar labels the second epoch "Epoch 1/-2" when max_steps ends the fit.
        callbacks=[
            RolloutCallback(HFEngine(), sampling=SamplingConfig(samples_per_prompt=8, max_new_tokens=8)),
            history,
            RLProgressBar(),
        ],
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name="own_model_and_data"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        limit_val_batches=0,  # held-out evaluation: see configs/reasoning_gym.yaml
    )
    trainer.fit(module, datamodule=data)
    window = max(1, min(10, len(history.rewards) // 2))
    metrics = {
        "reward_first": statistics.fmean(history.rewards[:window]),
        "reward_last": statistics.fmean(history.rewards[-window:]),
        "steps": float(len(history.rewards)),
    }
    print(f"reward, first {window} batches {metrics['reward_first']:.3f} -> last {window} {metrics['reward_last']:.3f}")
    return metrics


if __name__ == "__main__":
    main()
