"""``OffPolicyRLModule``: the decoupled PPO step of off-policy-corrected LLM RL, in Lightning.

One ``training_step`` consumes one :class:`~lightning_offpolicy.batch.RolloutBatch` (attached to
the step's :class:`~lightning_offpolicy.batch.PromptBatch` by the ``RolloutCallback``):

1. proximal forward without gradient: ``prox_logprobs`` (``pi_prox``; skipped in bypass mode);
2. reference forward when a reference KL loss is configured (a frozen copy, or with a peft model
   the base weights via ``disable_adapter()``, no second copy);
3. :func:`~lightning_offpolicy.correction.compute_correction`: IS weights, rejection masks, metrics;
4. ``ppo_epochs`` x ``num_minibatches`` optimizer steps, each over token-budget micro-batches
   with gradient accumulation, the loss normalised by the global token / sequence counts of the
   mini-batch (exact under accumulation and DDP), gradient clipping, optimizer and scheduler
   step, ``policy_version += 1``.

Held-out evaluation: ``validation_step`` aggregates the greedy and sampled completions that the
``RolloutCallback`` scores on each validation batch into ``val/*``
(:class:`~lightning_offpolicy.evaluation.EvaluationMetrics`), logged at the end of the validation epoch.

Manual optimization: ``trainer.global_step`` and ``max_steps`` count optimizer steps, i.e.
``ppo_epochs * num_minibatches`` per training batch.

Strategies: DDP and, for sharded training, ``ModelParallelStrategy`` (both tested on CPU with 2
processes against a single one): ``configure_model`` applies FSDP2 ``fully_shard`` per decoder layer
(Lightning's ``FSDPStrategy`` runs ``training_step`` inside the root module's forward, where
``manual_backward`` and several forwards per step break).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import DDPStrategy
from torchmetrics import MaxMetric, MeanMetric

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.correction import (
    CorrectionOutput,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    check_compatible,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.evaluation import EvaluationMetrics
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from lightning_offpolicy.metrics import CorrectionMetrics, PolicyLossMetrics
from lightning_offpolicy.preflight import check_model_path, check_vocab
from lightning_offpolicy.tokenizers import CharTokenizer, HFTokenizer

ReferenceMode = Literal["auto", "none", "frozen_copy", "disable_adapter"]

# The configs are saved in the checkpoint's hyperparameters; let `torch.load(weights_only=True)`,
# which Lightning uses to resume, rebuild them.
torch.serialization.add_safe_globals([OffPolicyCorrectionConfig, PolicyLossConfig])

# The policy stays in eval mode on purpose (see configure_model); Lightning's notice about it is noise.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


class OffPolicyRLModule(LightningModule):
    """Decoupled-PPO RL of a causal language model with off-policy correction.

    Args:
        model: A ``transformers`` causal LM: a local path, a hub name, ``"tiny:<task>"`` (a tiny
            Llama built and SFT-warmed locally, see :mod:`lightning_offpolicy.tiny`), or a module
            instance (then pass ``tokenizer`` too).
        tokenizer: ``None``: loaded from ``model``'s directory (a ``CharTokenizer`` for ``tiny:``
            models, else an ``HFTokenizer`` following the tokenizer's own special-token rule). An
            ``HFTokenizer`` without ``path`` (e.g. ``class_path: lightning_offpolicy.tokenizers.HFTokenizer``
            with only ``add_bos`` / ``chat_template`` / ``system_prompt`` in ``init_args``) is loaded
            from ``model``'s directory too. In Python, any object with ``encode_prompt`` (or
            ``encode``) / ``decode`` / ``pad_token_id`` / ``eos_token_id`` works.
        optimizer: Optimizer factory ``params -> Optimizer`` (LightningCLI injects it from YAML);
            default ``AdamW(lr=1e-5)``. Only parameters with ``requires_grad`` are passed.
        lr_scheduler: Scheduler factory ``optimizer -> scheduler``, stepped once per optimizer step.
        correction: The off-policy correction (weights, masks, objective); default: metrics only.
        loss: The surrogate, its aggregation and the KL penalties.
        ppo_epochs: Passes over each rollout batch.
        num_minibatches: Optimizer steps per pass (the rollout rows are split this many ways).
        max_tokens_per_microbatch: Padded-token budget of one forward/backward.
        gradient_clip_val: Max global gradient norm (``None``: no clipping; the norm is logged anyway).
        temperature: Temperature the trainer scores tokens with; must equal the engine's.
        reference: Reference policy for the reference KL loss: ``"auto"`` (``disable_adapter`` for
            a peft model, else ``frozen_copy``, and nothing when ``ref_kl_coef == 0``), ``"none"``,
            ``"frozen_copy"`` or ``"disable_adapter"``.
        torch_dtype: dtype the model is loaded in (when built from ``model``).
        logprob_chunk_size: Rows per chunk of the lean logprob computation.
        shuffle_minibatches: Shuffle rows before each pass's mini-batch split.
        seed: Seed of the mini-batch shuffles.
        lora_rank: Rank of peft LoRA adapters added to the policy (0: full fine-tuning). Only the
            adapters are trained and given to the optimizer; the reference (``reference="auto"``)
            is the same model with the adapters disabled, no second copy.
        lora_alpha: LoRA scaling numerator (the update is ``alpha / rank * B @ A``).
        lora_target_modules: Module names (or ``"all-linear"``) the adapters wrap.
        gradient_checkpointing: Recompute each decoder layer's activations in the backward pass
            instead of storing them (less memory, ~30% more compute).
    """

    def __init__(
        self,
        model: str | torch.nn.Module = "tiny:reverse",
        tokenizer: CharTokenizer | HFTokenizer | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        correction: OffPolicyCorrectionConfig = OffPolicyCorrectionConfig(),  # noqa: B008 (read-only, copied)
        loss: PolicyLossConfig = PolicyLossConfig(),  # noqa: B008 (read-only, copied)
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        max_tokens_per_microbatch: int = 8192,
        gradient_clip_val: float | None = 1.0,
        temperature: float = 1.0,
        reference: ReferenceMode = "auto",
        torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        logprob_chunk_size: int = 1024,
        shuffle_minibatches: bool = True,
        seed: int = 0,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | str = "all-linear",
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("ppo_epochs", ppo_epochs),
            ("num_minibatches", num_minibatches),
            ("max_tokens_per_microbatch", max_tokens_per_microbatch),
            ("logprob_chunk_size", logprob_chunk_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"OffPolicyRLModule.{name}={value!r} must be a positive integer.")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(f"OffPolicyRLModule.gradient_clip_val={gradient_clip_val!r} must be > 0 or None.")
        if not temperature > 0:
            raise ValueError(f"OffPolicyRLModule.temperature={temperature!r} must be > 0.")
        if not is_int(lora_rank) or lora_rank < 0:
            raise ValueError(f"OffPolicyRLModule.lora_rank={lora_rank!r} must be an int >= 0 (0: no LoRA).")
        if not lora_alpha > 0:
            raise ValueError(f"OffPolicyRLModule.lora_alpha={lora_alpha!r} must be > 0.")
        if reference not in ("auto", "none", "frozen_copy", "disable_adapter"):
            raise ValueError(
                f"OffPolicyRLModule.reference={reference!r} is not known; allowed: 'auto', 'none', "
                "'frozen_copy', 'disable_adapter'."
            )
        # Copies: the defaults above are shared objects, and a caller's config must not change under us.
        self.correction = dataclasses.replace(correction if correction is not None else OffPolicyCorrectionConfig())
        self.loss_config = dataclasses.replace(loss if loss is not None else PolicyLossConfig())
        check_compatible(self.correction, self.loss_config)
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("OffPolicyRLModule: with a model instance, pass its tokenizer too.")
            if isinstance(tokenizer, HFTokenizer) and not tokenizer.loaded:
                raise ValueError(
                    "OffPolicyRLModule: with a model instance, the HFTokenizer needs its `path` (there is no model "
                    "directory to load it from)."
                )
            self.policy: torch.nn.Module | None = model
            self.model_name = type(model).__name__
        else:
            check_model_path(str(model), "OffPolicyRLModule.model")
            self.policy = None
            self.model_name = model
        self.tokenizer = tokenizer
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.ppo_epochs = ppo_epochs
        self.num_minibatches = num_minibatches
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.gradient_clip_val = gradient_clip_val
        self.temperature = temperature
        self.reference_mode = reference
        self.torch_dtype = torch_dtype
        self.logprob_chunk_size = logprob_chunk_size
        self.shuffle_minibatches = shuffle_minibatches
        self.seed = seed
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_target_modules = lora_target_modules
        self.gradient_checkpointing = gradient_checkpointing
        self.reference_model: torch.nn.Module | None = None
        self.policy_version = 0
        self.automatic_optimization = False
        ignored = ["tokenizer", "optimizer", "lr_scheduler"] + (["model"] if self.policy is not None else [])
        self.save_hyperparameters(ignore=ignored)

        self.correction_metrics = CorrectionMetrics(self.correction)
        self.loss_metrics = PolicyLossMetrics()
        self.reward_mean = MeanMetric()
        self.reward_square_mean = MeanMetric()
        self.response_length = MeanMetric()
        self.entropy = MeanMetric()
        # Versions behind the weights of this step, per response token (0 for synchronous rollouts).
        self.staleness_mean = MeanMetric()
        self.staleness_max = MaxMetric()
        # Held-out evaluation (validation loop): val/* over the whole validation set and all ranks.
        self.evaluation_metrics = EvaluationMetrics()
        if self.policy is not None:
            self._prepare_policy()

    @property
    def optimizer_steps_per_batch(self) -> int:
        """Policy versions one training batch advances (the asynchronous rollout's admission uses it)."""
        return self.ppo_epochs * self.num_minibatches

    # ------------------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.policy is None:
            from transformers import AutoModelForCausalLM

            from lightning_offpolicy.tiny import resolve_model_path
            from lightning_offpolicy.tokenizers import load_tokenizer

            path = resolve_model_path(self.model_name)
            self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.torch_dtype))
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(path)
            elif isinstance(self.tokenizer, HFTokenizer) and not self.tokenizer.loaded:
                self.tokenizer.load(path)  # options from the config, files from the model's directory
            self._prepare_policy()
        check_vocab(self.policy, self.tokenizer)
        # Dropout off for good: pi_prox, pi_theta and the engine must be the same function of the
        # weights, or the PPO ratio is not 1 at the start of a step and the mismatch metrics lie.
        self.policy.eval()
        if self.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        if getattr(self, "device_mesh", None) is not None and not getattr(self, "_sharded", False):
            self._shard_fsdp2()

    def _prepare_policy(self) -> None:
        if self.lora_rank > 0 and not hasattr(self.policy, "disable_adapter"):
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(
                r=self.lora_rank,
                lora_alpha=self.lora_alpha,
                target_modules=self.lora_target_modules,
                lora_dropout=0.0,  # the policy runs without dropout (see configure_model)
                task_type="CAUSAL_LM",
            )
            self.policy = get_peft_model(self.policy, config)
        self._setup_reference()

    def _enable_gradient_checkpointing(self) -> None:
        model = self.policy
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError(
                "OffPolicyRLModule.gradient_checkpointing=True needs a transformers model "
                "(with gradient_checkpointing_enable)."
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers recomputes a layer only when that layer is in training mode. Flip the flag on
        # the decoder layers alone (not recursively): their attention / MLP / dropout stay in eval mode.
        from transformers.modeling_layers import GradientCheckpointingLayer

        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.training = True

    def _effective_reference_mode(self) -> str:
        if self.reference_mode != "auto":
            return self.reference_mode
        if self.loss_config.ref_kl_coef <= 0:
            return "none"
        return "disable_adapter" if hasattr(self.policy, "disable_adapter") else "frozen_copy"

    def _setup_reference(self) -> None:
        mode = self._effective_reference_mode()
        if self.loss_config.ref_kl_coef > 0 and mode == "none":
            raise ValueError(
                "PolicyLossConfig.ref_kl_coef > 0 needs a reference: set reference='auto' or another mode."
            )
        if mode == "frozen_copy" and self.reference_model is None:
            self.reference_model = copy.deepcopy(self.policy).requires_grad_(False).eval()
        if mode == "disable_adapter" and not hasattr(self.policy, "disable_adapter"):
            raise ValueError("reference='disable_adapter' needs a peft model (with LoRA adapters) as the policy.")

    def _shard_fsdp2(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = (
            self.device_mesh["data_parallel"]
            if "data_parallel" in self.device_mesh.mesh_dim_names
            else self.device_mesh
        )
        for model in (self.policy, self.reference_model):
            if model is None:
                continue
            layer_types = set(getattr(model, "_no_split_modules", None) or [])
            for module in model.modules():
                if type(module).__name__ in layer_types:
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self._sharded = True

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("OffPolicyRLModule: the policy has no trainable parameters.")
        optimizer = self.optimizer_factory(params) if self.optimizer_factory else torch.optim.AdamW(params, lr=1e-5)
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"},
        }

    # ------------------------------------------------------------------------------ logprobs
    def sequence_logprobs(
        self, batch: RolloutBatch, model: torch.nn.Module | None = None, return_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced ``[B, T]`` logprobs of ``batch``'s response tokens (one forward)."""
        return causal_lm_token_logprobs(
            model if model is not None else self.policy,
            batch.input_ids,
            batch.attention_mask,
            response_start=batch.prompt_length,
            temperature=self.temperature,
            chunk_size=self.logprob_chunk_size,
            return_entropy=return_entropy,
        )

    @torch.no_grad()
    def _no_grad_logprobs(self, batch: RolloutBatch, reference: bool = False) -> torch.Tensor:
        """Logprobs of the whole batch, micro-batch by micro-batch, without gradient."""
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
        rows_per_micro = batch.micro_batch_rows(self.max_tokens_per_microbatch)
        padding = self._global_max(len(rows_per_micro)) - len(rows_per_micro)
        for rows in rows_per_micro:
            micro = batch.select(rows).trim()
            with self._reference_context(reference) as model:
                lp = self.sequence_logprobs(micro, model=model)
            out[torch.as_tensor(rows, device=out.device), : lp.shape[1]] = lp.float()
        for _ in range(padding):  # sharded forwards are collectives: every rank runs as many
            with self._reference_context(reference) as model:
                self.sequence_logprobs(batch.select([0]).trim(), model=model)
        return out

    @contextlib.contextmanager
    def _reference_context(self, reference: bool) -> Iterator[torch.nn.Module]:
        if not reference:
            yield self.policy
        elif self._effective_reference_mode() == "disable_adapter":
            with self.policy.disable_adapter():
                yield self.policy
        else:
            yield self.reference_model

    # ------------------------------------------------------------------------------ the step
    def training_step(self, batch: PromptBatch | RolloutBatch, batch_idx: int) -> None:
        rollout = self._rollout_of(batch).to(self.device)
        rollout.validate(require_rollout_logprobs=True)
        started = time.perf_counter()
        tokens = rollout.response_mask.bool()
        staleness = (self.policy_version - rollout.policy_version[tokens]).float()
        self.staleness_mean.update(staleness)
        self.staleness_max.update(staleness if staleness.numel() else torch.zeros(1, device=self.device))
        cfg = self.correction
        prox = self._no_grad_logprobs(rollout) if cfg.needs_prox else None
        ref = self._no_grad_logprobs(rollout, reference=True) if self.loss_config.ref_kl_coef > 0 else None
        out = compute_correction(prox, rollout.rollout_logprobs, rollout.response_mask, cfg)
        self.correction_metrics.update(stats=out.stats)
        rollout = rollout.with_fields(
            prox_logprobs=prox, ref_logprobs=ref, is_weights=out.weights, correction_mask=out.mask
        )
        trained_tokens = 0
        grad_norms = []
        for epoch in range(self.ppo_epochs):
            generator = None
            if self.shuffle_minibatches and self.num_minibatches > 1:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.policy_version * 101 + epoch)
            for minibatch in rollout.split(self.num_minibatches, generator):
                grad_norms.append(self._optimizer_step(minibatch, record_entropy=epoch == 0))
                trained_tokens += minibatch.num_response_tokens
        self._log_step(rollout, grad_norms, trained_tokens, time.perf_counter() - started)

    def _rollout_of(self, batch: PromptBatch | RolloutBatch) -> RolloutBatch:
        if isinstance(batch, RolloutBatch):
            return batch
        if isinstance(batch, PromptBatch) and batch.rollout is not None:
            return batch.rollout
        raise RuntimeError(
            "OffPolicyRLModule.training_step got a batch without rollouts. Add "
            "lightning_offpolicy.rollout.RolloutCallback(...) to the Trainer's callbacks (it generates "
            "the rollouts of each PromptBatch), or feed RolloutBatch objects directly."
        )

    def _optimizer_step(self, minibatch: RolloutBatch, record_entropy: bool) -> torch.Tensor:
        world = self.trainer.world_size
        counts = torch.tensor(
            [minibatch.response_mask.sum(), (minibatch.response_mask.sum(-1) > 0).sum()],
            dtype=torch.float64,
            device=self.device,
        )
        counts = self._global_sum(counts)
        # Gradients are averaged over ranks: dividing by count / world gives the exact global mean.
        token_count, sequence_count = (counts / world).float()
        rows_per_micro = minibatch.micro_batch_rows(self.max_tokens_per_microbatch)
        micro_batches = minibatch.micro_batches(
            self.max_tokens_per_microbatch,
            num_micro_batches=self._global_max(len(rows_per_micro)),
            rows=rows_per_micro,
        )
        optimizer = self.optimizers()
        for index, micro in enumerate(micro_batches):
            with self._gradient_sync(index == len(micro_batches) - 1):
                if record_entropy:
                    logprobs, entropy = self.sequence_logprobs(micro, return_entropy=True)
                    # Every rank updates, even with nothing: compute() is a collective.
                    self.entropy.update(entropy[micro.response_mask.bool()].float())
                else:
                    logprobs = self.sequence_logprobs(micro)
                correction = CorrectionOutput(
                    weights=micro.is_weights, mask=micro.correction_mask, stats=None, config=self.correction
                )
                loss, info = policy_loss(
                    logprobs,
                    micro.prox_logprobs,
                    micro.rollout_logprobs,
                    micro.advantages,
                    micro.response_mask,
                    self.loss_config,
                    correction=correction,
                    ref_logprobs=micro.ref_logprobs,
                    token_count=token_count,
                    sequence_count=sequence_count,
                )
                self.manual_backward(loss)
            self.loss_metrics.update(info=info)
        grad_norm = self._clip_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.policy_version += 1
        return grad_norm

    @contextlib.contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on all but the last micro-batch of an optimizer step."""
        if getattr(self, "_sharded", False):
            self.policy.set_requires_gradient_sync(enabled)
            yield
        elif not enabled and isinstance(self.trainer.strategy, DDPStrategy):
            with self.trainer.strategy.block_backward_sync():
                yield
        else:
            yield

    def _clip_gradients(self) -> torch.Tensor:
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        if self.gradient_clip_val is not None:
            params = [p for p in self.policy.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.gradient_clip_val, norm)
        return norm.detach()

    # ------------------------------------------------------------------------------ logging
    def _log_step(
        self, rollout: RolloutBatch, grad_norms: list[torch.Tensor], trained_tokens: int, seconds: float
    ) -> None:
        valid = rollout.response_mask.sum(-1) > 0
        self.reward_mean.update(rollout.rewards)
        self.reward_square_mean.update(rollout.rewards.square())
        self.response_length.update(rollout.response_mask.sum(-1)[valid])
        values = {**self.correction_metrics.compute(), **self.loss_metrics.compute()}
        reward = self.reward_mean.compute()
        values["train/reward"] = reward
        values["train/reward_std"] = (self.reward_square_mean.compute() - reward.square()).clamp(min=0).sqrt()
        values["train/response_length"] = self.response_length.compute()
        values["train/entropy"] = self.entropy.compute()
        values["train/grad_norm"] = torch.stack(grad_norms).float().mean()
        values["train/policy_version"] = float(self.policy_version)
        values["staleness/mean"] = self.staleness_mean.compute()
        values["staleness/max"] = self.staleness_max.compute()
        values["train/lr"] = self.optimizers().param_groups[0]["lr"]
        tokens = self._global_sum(torch.tensor(float(trained_tokens), device=self.device, dtype=torch.float64))
        values["perf/train_tokens_per_s"] = tokens / max(seconds, 1e-9)
        values["perf/step_s"] = seconds
        values = {k: (v.float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))) for k, v in values.items()}
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
        # The progress bar's short names (the logger has the full keys).
        self.log("reward", values["train/reward"], prog_bar=True, batch_size=1, logger=False)
        self.log("stale", values["staleness/mean"], prog_bar=True, batch_size=1, logger=False)
        for metric in (
            self.correction_metrics,
            self.loss_metrics,
            self.reward_mean,
            self.reward_square_mean,
            self.response_length,
            self.entropy,
            self.staleness_mean,
            self.staleness_max,
        ):
            metric.reset()

    # ------------------------------------------------------------------------------ held-out evaluation
    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        evaluation = getattr(batch, "evaluation", None)
        if evaluation is None:
            raise RuntimeError(
                "OffPolicyRLModule.validation_step got a batch without evaluation completions. Add "
                "lightning_offpolicy.rollout.RolloutCallback(...) to the Trainer's callbacks (it generates and "
                "scores the greedy and sampled completions of each validation PromptBatch)."
            )
        self.evaluation_metrics.update(evaluation)

    def on_validation_epoch_end(self) -> None:
        if not self.evaluation_metrics.update_called:
            return
        # compute() sums the states over ranks: every rank logs the same global values.
        values = {name: value.float() for name, value in self.evaluation_metrics.compute().items()}
        self.evaluation_metrics.reset()
        self.log_dict(values, sync_dist=False)
        self.log("val_reward", values["val/reward_greedy"], prog_bar=True, logger=False)

    # ------------------------------------------------------------------------------ distributed
    def _global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.trainer.world_size <= 1:
            return tensor
        return self.trainer.strategy.reduce(tensor.clone(), reduce_op="sum")

    def _global_max(self, value: int) -> int:
        if self.trainer.world_size <= 1:
            return value
        tensor = torch.tensor(float(value), device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    # ------------------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["policy_version"] = self.policy_version

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.policy_version = int(checkpoint.get("policy_version", 0))
