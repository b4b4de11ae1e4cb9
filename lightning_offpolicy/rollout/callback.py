"""``RolloutCallback``: turns each step's prompts into scored rollouts for ``training_step``.

Synchronous form: in ``on_train_batch_start`` (after the previous optimizer step, so with the
weights of this very step) it generates ``samples_per_prompt`` completions per prompt with the
engine, scores them with the reward function, computes group advantages, and attaches the
:class:`~lightning_offpolicy.batch.RolloutBatch` to the :class:`~lightning_offpolicy.batch.PromptBatch`.
Generating here rather than in the DataLoader matters: Lightning reads the loader one batch ahead,
so a loader that generated would always train one version stale.

What it needs from the LightningModule (``OffPolicyRLModule`` has all of it):

* ``policy``: the causal LM to sample with (shared with ``HFEngine``, no copy);
* ``tokenizer``: ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``pad_token_id``, ``eos_token_id``;
* ``policy_version``: the number of optimizer steps taken, stamped on every generated token.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_offpolicy.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.rollout.engine import RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.hf_engine import HFEngine


class RolloutCallback(Callback):
    """Generate, score and attach rollouts for every training batch.

    Args:
        engine: The rollout engine; ``None`` builds an :class:`HFEngine` that shares the module's
            weights. ``HFEngine(dtype="bfloat16")`` samples from a bfloat16 copy (a real
            training-inference mismatch, as with vLLM).
        reward_fn: ``(prompts, completions, metadata) -> rewards``; ``None`` takes the
            datamodule's ``reward_fn``.
        max_new_tokens: Maximum tokens generated per completion.
        temperature: Sampling temperature (the module scores with its own ``temperature``: keep
            them equal).
        top_k: Top-k filter of the sampler (0: off).
        top_p: Nucleus filter of the sampler (1.0: off).
        samples_per_prompt: Completions per prompt (the advantage group).
        advantage_estimator: ``"grpo"``, ``"dr_grpo"``, ``"rloo"`` or ``"reinforce"``.
        seed: Base seed of the sampler; step ``s`` on rank ``r`` uses a seed derived from (seed, s, r).
    """

    def __init__(
        self,
        engine: RolloutEngine | None = None,
        reward_fn: Any = None,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        samples_per_prompt: int = 4,
        advantage_estimator: str = "grpo",
        seed: int = 0,
    ) -> None:
        if advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"RolloutCallback.advantage_estimator={advantage_estimator!r} is not known; allowed: "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}."
            )
        self.engine = engine
        self.reward_fn = reward_fn
        self.sampling = SamplingConfig(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            samples_per_prompt=samples_per_prompt,
        )
        self.advantage_estimator = advantage_estimator
        self.seed = seed
        self.generated_batches = 0
        self.last_timing: dict[str, float] = {}

    # ------------------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for name in ("policy_version", "tokenizer"):
            if not hasattr(pl_module, name):
                raise TypeError(
                    f"RolloutCallback needs the LightningModule to expose `{name}` (see "
                    "lightning_offpolicy.rollout.callback's docstring); OffPolicyRLModule does."
                )
        if self.reward_fn is None:
            datamodule = trainer.datamodule
            self.reward_fn = getattr(datamodule, "reward_fn", None)
            if self.reward_fn is None:
                raise ValueError(
                    "RolloutCallback has no reward_fn: pass reward_fn=... or use a datamodule with a "
                    "`reward_fn` attribute (e.g. lightning_offpolicy.tasks.PromptDataModule)."
                )
        policy_temperature = getattr(pl_module, "temperature", None)
        if policy_temperature is not None and abs(policy_temperature - self.sampling.temperature) > 1e-9:
            raise ValueError(
                f"RolloutCallback.temperature={self.sampling.temperature} differs from the module's "
                f"temperature={policy_temperature}: the trainer would score another distribution than the "
                "engine samples. Set both to the same value."
            )

    def _engine(self, pl_module: LightningModule) -> RolloutEngine:
        if self.engine is None:
            self.engine = HFEngine()
        if hasattr(self.engine, "set_special_tokens"):
            self.engine.set_special_tokens(pl_module.tokenizer.pad_token_id, pl_module.tokenizer.eos_token_id)
        return self.engine

    # ------------------------------------------------------------------------------ the step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, PromptBatch):
            raise TypeError(
                f"RolloutCallback expects the train dataloader to yield PromptBatch; got {type(batch).__name__}."
            )
        batch.rollout = self.generate(pl_module, batch, trainer.global_rank)

    def generate(self, pl_module: LightningModule, prompts: PromptBatch, rank: int = 0) -> RolloutBatch:
        """Sample, score and build the rollout batch of ``prompts`` with the module's current weights."""
        tokenizer = pl_module.tokenizer
        engine = self._engine(pl_module)
        version = int(pl_module.policy_version)
        start = time.perf_counter()
        engine.update_weights(pl_module.policy, version)
        prompt_ids = [tokenizer.encode(text) for text in prompts.prompts]
        seed = _mix_seed(self.seed, self.generated_batches, rank)
        completions = engine.generate(prompt_ids, self.sampling, seed=seed)
        generate_s = time.perf_counter() - start
        texts = [tokenizer.decode(c.token_ids) for c in completions]
        owners = [c.prompt_index for c in completions]
        rewards = torch.tensor(
            [
                float(r)
                for r in self.reward_fn(
                    [prompts.prompts[i] for i in owners], texts, [prompts.metadata[i] for i in owners]
                )
            ],
            dtype=torch.float32,
        )
        if rewards.numel() != len(completions):
            raise ValueError(f"reward_fn returned {rewards.numel()} rewards for {len(completions)} completions.")
        group_ids = torch.tensor(owners, dtype=torch.long)
        advantages = compute_advantages(self.advantage_estimator, rewards, group_ids)
        rollout = RolloutBatch.from_sequences(
            prompt_ids=[prompt_ids[i] for i in owners],
            response_ids=[c.token_ids for c in completions],
            rewards=rewards,
            advantages=advantages,
            group_ids=group_ids,
            policy_versions=[c.policy_version for c in completions],
            rollout_logprobs=None
            if any(c.logprobs is None for c in completions)
            else [c.logprobs for c in completions],
            pad_token_id=tokenizer.pad_token_id,
        )
        self.generated_batches += 1
        tokens = rollout.num_response_tokens
        self.last_timing = {"generate_s": generate_s, "tokens": float(tokens)}
        if self.generated_batches == 1:
            rank_zero_info(f"RolloutCallback: first rollout: {len(completions)} completions, {tokens} tokens")
        return rollout

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.last_timing:
            generate_s = max(self.last_timing["generate_s"], 1e-9)
            pl_module.log("rollout/generate_s", generate_s, on_step=True, batch_size=1)
            pl_module.log("rollout/tokens_per_s", self.last_timing["tokens"] / generate_s, on_step=True, batch_size=1)
        if isinstance(batch, PromptBatch):
            batch.rollout = None  # free the rollout's tensors before the loader's next batch

    # ------------------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"generated_batches": self.generated_batches, "seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generated_batches = int(state_dict["generated_batches"])
        self.seed = int(state_dict.get("seed", self.seed))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # The engine's processes and memory end with the fit (vLLM would otherwise outlive it).
        if self.engine is not None:
            self.engine.close()


def _mix_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 9_973 + rank * 7_919) % (2**31 - 1)
