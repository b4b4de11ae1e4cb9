"""SFT, then RL on the same LightningModule: add the mixin and a RolloutCallback, keep your module.

``ReverseLM`` below is an ordinary supervised fine-tuning module, written the way Lightning users
write one: a causal LM, a tokenizer, cross-entropy on the answer tokens, AdamW. The only RL-specific
line is ``OffPolicyMixin`` first in its bases. Phase 1 fits it with SFT batches on the ``reverse``
task; phase 2 continues the same instance with a new Trainer, a ``RolloutCallback`` (the rollouts)
and a ``PromptDataModule`` (the prompts and the reward).

    python examples/sft_then_rl.py                 # ~2-4 min on 2 CPU cores
    python examples/sft_then_rl.py --sft-steps 50 --rl-steps 10
"""

from __future__ import annotations

import argparse
import random

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from lightning_offpolicy.data.tasks import PromptDataModule, get_task
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama, greedy_reward
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.mixin import OffPolicyMixin
from lightning_offpolicy.rollout import HFEngine, SamplingConfig


class ReverseLM(OffPolicyMixin, L.LightningModule):
    """A tiny Llama fine-tuned with cross-entropy on ``prompt -> answer`` pairs."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = CharTokenizer()
        self.model = build_tiny_llama(vocab_size=64)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        self.log("sft/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr, weight_decay=0.0)


class SFTPairs(IterableDataset):
    """Endless ``prompt + answer + eos`` batches of a task, loss on the answer and eos only."""

    def __init__(self, tokenizer: CharTokenizer, task_name: str, batch_size: int, seed: int = 0) -> None:
        self.tokenizer, self.task, self.batch_size, self.seed = tokenizer, get_task(task_name), batch_size, seed

    def __iter__(self):
        rng = random.Random(self.seed)
        while True:
            rows = []
            for _ in range(self.batch_size):
                prompt, metadata = self.task.sample(rng)
                prompt_ids = self.tokenizer.encode_prompt(prompt)  # as the RolloutCallback encodes it
                answer_ids = self.tokenizer.encode(self.task.reference_completion(metadata), add_bos=False)
                rows.append((prompt_ids, answer_ids + [self.tokenizer.eos_token_id]))
            width = max(len(p) + len(a) for p, a in rows)
            batch = {
                "input_ids": torch.full((len(rows), width), self.tokenizer.pad_token_id),
                "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
                "labels": torch.full((len(rows), width), -100),
            }
            for i, (p, a) in enumerate(rows):
                ids = torch.tensor(p + a)
                batch["input_ids"][i, : len(ids)] = ids
                batch["attention_mask"][i, : len(ids)] = 1
                batch["labels"][i, len(p) : len(ids)] = torch.tensor(a)
            yield batch


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--rl-steps", type=int, default=200)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    # RL steps are noisier than SFT's: a tenth of the SFT rate (see docs/journeys.md for 1e-3 against 3e-4).
    parser.add_argument("--rl-lr", type=float, default=3e-4, help="AdamW learning rate of the RL phase")
    parser.add_argument(
        "--rl-seed", type=int, default=None, help="reseed the RL phase (its prompt order and sampling); default: not"
    )
    parser.add_argument("--logdir", default="runs")
    args = parser.parse_args(argv)
    L.seed_everything(0)
    task = get_task("reverse")
    module = ReverseLM(lr=3e-3)

    # Phase 1: supervised fine-tuning, the module's own training_step.
    sft = L.Trainer(max_steps=args.sft_steps, accelerator="cpu", logger=False, enable_checkpointing=False)
    sft.fit(module, DataLoader(SFTPairs(module.tokenizer, "reverse", batch_size=64), batch_size=None))
    after_sft = greedy_reward(module.model, module.tokenizer, task, num_prompts=128)

    # Phase 2: RL on the same instance. The callback generates (here from a bfloat16 copy of the
    # weights: a real training-inference mismatch, corrected by the mixin's token TIS).
    module.hparams.lr = args.rl_lr
    if args.rl_seed is not None:
        L.seed_everything(args.rl_seed)
    rl = L.Trainer(
        max_steps=args.rl_steps,
        accelerator="cpu",
        callbacks=[
            RolloutCallback(
                engine=HFEngine(dtype="bfloat16"), sampling=SamplingConfig(samples_per_prompt=8, max_new_tokens=8)
            )
        ],
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name="sft_then_rl"),
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    data_seed = {} if args.rl_seed is None else {"seed": args.rl_seed}
    rl.fit(module, PromptDataModule(task="reverse", prompts_per_step=args.prompts_per_step, **data_seed))
    after_rl = greedy_reward(module.model, module.tokenizer, task, num_prompts=128)
    metrics = {
        "greedy_reward_after_sft": after_sft,
        "greedy_reward_after_rl": after_rl,
        "policy_version": float(module.policy_version),
        **{k: float(v) for k, v in rl.callback_metrics.items()},
    }
    print(f"greedy reward: after SFT {after_sft:.3f}, after RL {after_rl:.3f}")
    return metrics


if __name__ == "__main__":
    main()
