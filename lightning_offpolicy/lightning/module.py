"""``OffPolicyRLModule``: the decoupled PPO step of off-policy-corrected LLM RL, in Lightning.

One ``training_step`` consumes one :class:`~lightning_offpolicy.batch.RolloutBatch` (attached to
the step's :class:`~lightning_offpolicy.batch.PromptBatch` by the ``RolloutCallback``):

1. proximal forward without gradient: ``prox_logprobs`` (``pi_prox``; skipped in bypass mode, and
   with ``correction.prox_method="loglinear"``, where each micro-batch interpolates ``pi_prox``
   between ``pi_rollout`` and its own forward's ``pi_theta`` by version, AReaL's method);
2. reference forward when a reference KL loss is configured (a frozen copy, or with a peft model
   the base weights via ``disable_adapter()``, no second copy);
3. :func:`~lightning_offpolicy.correction.compute_correction`: IS weights, rejection masks, metrics;
4. ``ppo_epochs`` x ``num_minibatches`` optimizer steps, each over token-budget micro-batches
   (packed, padding-free, where the model allows it: ``packing``) with gradient accumulation, the
   loss normalised by the global token / sequence counts of the mini-batch (exact under
   accumulation and DDP), gradient clipping, optimizer and scheduler step, ``policy_version += 1``.

Steps 1-4 are :class:`~lightning_offpolicy.train.update.PPOUpdate`, which imports no Lightning;
this module gives it its forward, backward, optimizer and collectives
(:mod:`lightning_offpolicy.lightning.update_hooks`).

Held-out evaluation: ``validation_step`` aggregates the greedy and sampled completions that the
``RolloutCallback`` scores on each validation batch into ``val/*``
(:class:`~lightning_offpolicy.metrics.evaluation.EvaluationMetrics`), logged at the end of the validation epoch.

Manual optimization: ``trainer.global_step`` and ``max_steps`` count optimizer steps, i.e.
``ppo_epochs * num_minibatches`` per training batch.

Strategies: DDP and, for sharded training, ``ModelParallelStrategy`` (both tested on CPU with 2
processes against a single one): ``configure_model`` applies FSDP2 ``fully_shard`` per decoder layer
(Lightning's ``FSDPStrategy`` runs ``training_step`` inside the root module's forward, where
``manual_backward`` and several forwards per step break).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MaxMetric, MeanMetric

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig, check_compatible
from lightning_offpolicy.correction.distributed import global_sum
from lightning_offpolicy.correction.fused import FusedCorrectionStep
from lightning_offpolicy.data.tokenizers import CharTokenizer, HFTokenizer
from lightning_offpolicy.lightning import checkpoint_identity as identity
from lightning_offpolicy.lightning.log_steps import is_logging_step
from lightning_offpolicy.lightning.update_hooks import ManualOptimizationHooks, MetricsRecorder
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics
from lightning_offpolicy.metrics.evaluation import EvaluationMetrics
from lightning_offpolicy.preflight import check_model_path, check_vocab
from lightning_offpolicy.seeding import run_seed
from lightning_offpolicy.train import compiled_policy, step
from lightning_offpolicy.train import policy as policy_building
from lightning_offpolicy.train.compiled_policy import COMPILE_MODES, CompileMode
from lightning_offpolicy.train.micro_step import MicroBatchStep
from lightning_offpolicy.train.policy import REFERENCE_MODES, PackingMode, ReferenceMode
from lightning_offpolicy.train.update import PPOUpdate

#: Lightning's notice about modules in eval mode at the start of fit: the policy is in eval mode on
#: purpose (see ``configure_model``).
EVAL_MODE_NOTICE = r"Found \d+ module\(s\) in eval mode at the start of training"


class OffPolicyRLModule(LightningModule):
    """Decoupled-PPO RL of a causal language model with off-policy correction.

    Args:
        model: A ``transformers`` causal LM: a local path, a hub name, ``"tiny:<task>"`` (a tiny
            Llama built and SFT-warmed locally, see :mod:`lightning_offpolicy.demo.tiny`), or a module
            instance (then pass ``tokenizer`` too).
        tokenizer: ``None``: loaded from ``model``'s directory (a ``CharTokenizer`` for ``tiny:``
            models, else an ``HFTokenizer`` following the tokenizer's own special-token rule). An
            ``HFTokenizer`` without ``path`` (e.g. ``class_path: lightning_offpolicy.data.tokenizers.HFTokenizer``
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
        max_tokens_per_microbatch: Tokens per forward/backward (real ones when packed).
        gradient_clip_val: Max global gradient norm (``None``: no clipping; the norm is logged anyway).
        temperature: Temperature the trainer scores tokens with; must equal the engine's.
        reference: Reference policy for the reference KL loss: ``"auto"`` (``disable_adapter`` for
            a peft model, else ``frozen_copy``, and nothing when ``ref_kl_coef == 0``), ``"none"``,
            ``"frozen_copy"`` or ``"disable_adapter"``.
        torch_dtype: dtype the model is loaded in (when built from ``model``).
        logprob_chunk_size: Rows per chunk of the lean logprob computation.
        shuffle_minibatches: Shuffle rows before each pass's mini-batch split.
        seed: Shuffle seed (None: the run's).
        lora_rank: Rank of peft LoRA adapters added to the policy (0: full fine-tuning); only they
            train, and the reference is the model with them disabled.
        lora_alpha: LoRA scaling numerator (the update is ``alpha / rank * B @ A``).
        lora_target_modules: Module names (or ``"all-linear"``) the adapters wrap.
        gradient_checkpointing: Recompute each decoder layer's activations in the backward pass.
        fused_loss: The correction, loss, gradient and metric sums of each micro-batch in one compiled
            graph (``FusedCorrectionStep``): the same values, faster (docs/reports/performance_correction.md).
            Needs a C++ compiler; not with ``normalize_weights`` or ``m2po_mask``.
        packing: Packed, padding-free micro-batches: auto (where the model allows it), on or off.
        compile_policy: ``torch.compile`` the policy's decoder for the step's forwards and backwards
            (docs/training.md, "Compiled policy"): on, off or auto (eager until measured to win).
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
        seed: int | None = None,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | str = "all-linear",
        gradient_checkpointing: bool = False,
        fused_loss: bool = False,
        packing: PackingMode = "auto",
        compile_policy: CompileMode = "auto",
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
        if reference not in REFERENCE_MODES:
            raise ValueError(
                f"OffPolicyRLModule.reference={reference!r} is not known; allowed: 'auto', 'none', "
                "'frozen_copy', 'disable_adapter'."
            )
        policy_building.check_packing_mode(packing, "OffPolicyRLModule.packing")
        if compile_policy not in COMPILE_MODES:
            raise ValueError(
                f"OffPolicyRLModule.compile_policy={compile_policy!r} is not known; allowed: 'auto' (compiled only "
                "where it was measured to be faster), 'on' (compiled) or 'off' (eager)."
            )
        # Copies: the defaults above are shared objects, and a caller's config must not change under us.
        self.correction = dataclasses.replace(correction if correction is not None else OffPolicyCorrectionConfig())
        self.loss_config = dataclasses.replace(loss if loss is not None else PolicyLossConfig())
        check_compatible(self.correction, self.loss_config)
        whole_batch = self.correction.whole_batch_settings
        if fused_loss and whole_batch:
            raise ValueError(
                "OffPolicyRLModule.fused_loss=True computes the correction per micro-batch, but "
                + "; ".join(f"correction.{name} {need}" for name, need in whole_batch.items())
                + ": turn one of them off."
            )
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
        self.seed = seed = run_seed(seed, "OffPolicyRLModule.seed")
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_target_modules = lora_target_modules
        self.gradient_checkpointing = gradient_checkpointing
        self.fused_loss = fused_loss
        self.packing = packing
        self.compile_policy = compile_policy
        self.reference_model: torch.nn.Module | None = None
        self._tokenizer_fingerprint: dict[str, Any] | None = None
        self.policy_version = 0
        self.automatic_optimization = False
        ignored = ["tokenizer", "optimizer", "lr_scheduler"] + (["model"] if self.policy is not None else [])
        self.save_hyperparameters(ignore=ignored)
        self.hparams["seed"] = self.seed  # the seed the run used (None: resolved from seed_everything)

        self.correction_metrics = CorrectionMetrics(self.correction)
        self.update = PPOUpdate(
            MicroBatchStep(
                self.correction,
                self.loss_config,
                compiled=fused_loss,
                statistics=self.correction_metrics.sums,
                steps_per_batch=self.optimizer_steps_per_batch,
            ),
            ppo_epochs=ppo_epochs,
            num_minibatches=num_minibatches,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            shuffle_minibatches=shuffle_minibatches,
            seed=seed,
        )
        self.loss_metrics = PolicyLossMetrics(self.correction)
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
            self.policy, self.tokenizer = policy_building.load_policy(self.model_name, self.torch_dtype, self.tokenizer)
            self._prepare_policy()
        check_vocab(self.policy, self.tokenizer)
        # Dropout off for good: pi_prox, pi_theta and the engine must be the same function of the
        # weights, or the PPO ratio is not 1 at the start of a step and the mismatch metrics lie.
        self.policy.eval()
        if self.gradient_checkpointing:
            policy_building.enable_gradient_checkpointing(self.policy)
        if getattr(self, "device_mesh", None) is not None and not getattr(self, "_sharded", False):
            policy_building.shard_fsdp2([self.policy, self.reference_model], self.device_mesh)
            self._sharded = True
        # Last: the compiled call wraps the decoder as LoRA, checkpointing and sharding left it.
        sharded = bool(getattr(self, "_sharded", False))
        setting = "OffPolicyRLModule.compile_policy"
        if compiled_policy.resolve_compile(self.compile_policy, self.policy, self.device, sharded, setting):
            for model in (self.policy, self.reference_model):
                if model is not None:
                    compiled_policy.compile_policy(model)

    def on_fit_start(self) -> None:
        # Filtered here, not at import: only fits of this module keep their policy in eval mode.
        warnings.filterwarnings("ignore", message=EVAL_MODE_NOTICE)

    def _prepare_policy(self) -> None:
        self.policy = policy_building.add_lora(self.policy, self.lora_rank, self.lora_alpha, self.lora_target_modules)
        self.reference_model = policy_building.build_reference(
            self.policy, self.reference_mode, self.loss_config.ref_kl_coef, self.reference_model
        )
        self.update.packed = policy_building.resolve_packing(
            self.packing, [self.policy, self.reference_model], "OffPolicyRLModule.packing"
        )

    @property
    def packed(self) -> bool:
        """Whether micro-batches run packed (``packing`` resolved against the model; ``False`` until it is built)."""
        return self.update.packed

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
        model = model if model is not None else self.policy
        return step.response_logprobs(
            model, batch, self.temperature, self.logprob_chunk_size, return_entropy, packed=self.packed
        )

    @contextlib.contextmanager
    def _reference_context(self, reference: bool) -> Iterator[torch.nn.Module]:
        if not reference:
            yield self.policy
            return
        mode = policy_building.effective_reference_mode(self.reference_mode, self.policy, self.loss_config.ref_kl_coef)
        with policy_building.reference_policy(self.policy, self.reference_model, mode) as model:
            yield model

    # ------------------------------------------------------------------------------ the step
    def training_step(self, batch: PromptBatch | RolloutBatch, batch_idx: int) -> None:
        rollout = step.rollout_of(batch, "OffPolicyRLModule.training_step").to(self.device)
        rollout.validate(require_rollout_logprobs=True)
        started = time.perf_counter()
        # The metrics are updated and computed only on the batches whose values reach the logger.
        logging = is_logging_step(self._trainer, batch_idx, self.optimizer_steps_per_batch)
        # The version of the weights at the start of the step (prox_method="loglinear" interpolates by it).
        step_version = self.policy_version
        staleness = step.token_staleness(rollout, step_version)
        if logging:
            self.staleness_mean.update(staleness)
            self.staleness_max.update(staleness if staleness.numel() else torch.zeros(1, device=self.device))
        recorder = MetricsRecorder(self.correction_metrics, self.loss_metrics, self.entropy)
        result = self.update(
            rollout, ManualOptimizationHooks(self), recorder, logging=logging, step_version=step_version
        )
        if logging:
            self._log_step(rollout, result.grad_norms, result.trained_tokens, time.perf_counter() - started)
        else:
            self._log_progress_bar(rollout, staleness)

    @property
    def _fused_steps(self) -> dict[bool, FusedCorrectionStep]:
        """The compiled graphs built so far (with and without the metric sums)."""
        return {with_sums: fused for with_sums, fused in self.update.step.graphs.items() if fused.compiled}

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
        tokens = global_sum(torch.tensor(float(trained_tokens), device=self.device, dtype=torch.float64))
        values["perf/train_tokens_per_s"] = tokens / max(seconds, 1e-9)
        values["perf/step_s"] = seconds
        step.log_step(self, values, progress_bar={"reward": "train/reward", "stale": "staleness/mean"})
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

    def _log_progress_bar(self, rollout: RolloutBatch, staleness: torch.Tensor) -> None:
        """Between logging steps: only the progress bar's values (this rank's, not synchronized)."""
        if self._trainer is None or self.trainer.progress_bar_callback is None:
            return
        stale = staleness.mean() if staleness.numel() else torch.zeros((), device=self.device)
        self.log("reward", rollout.rewards.float().mean(), prog_bar=True, batch_size=1, logger=False)
        self.log("stale", stale, prog_bar=True, batch_size=1, logger=False)

    # ------------------------------------------------------------------------------ held-out evaluation
    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        evaluation = getattr(batch, "evaluation", None)
        if evaluation is None:
            raise RuntimeError(
                "OffPolicyRLModule.validation_step got a batch without evaluation completions. Add "
                "lightning_offpolicy.lightning.callback.RolloutCallback(...) to the Trainer's callbacks (it generates "
                "and scores the greedy and sampled completions of each validation PromptBatch)."
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
    def _global_max(self, value: int) -> int:
        if self.trainer.world_size <= 1:
            return value
        tensor = torch.tensor(float(value), device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    # ------------------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["policy_version"] = self.policy_version
        if self.policy is not None:
            # Which policy these weights belong to: a resume into another model is refused (on_load_checkpoint).
            checkpoint[identity.IDENTITY_KEY] = self.policy_identity()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another policy (before Lightning loads its weights), then restore the version.

        Raises:
            CheckpointMismatchError: The checkpoint was saved from another architecture, other shapes, other
                LoRA adapters or another tokenizer (:mod:`lightning_offpolicy.lightning.checkpoint_identity`). Under
                ``ModelParallelStrategy`` the strategy loads the weights before this hook, so a shape mismatch
                there stops in ``torch.distributed.checkpoint``'s own error first.
        """
        if self.policy is not None:  # None: OffPolicyRLModule.load_from_checkpoint, before configure_model
            state = self.state_dict() if identity.IDENTITY_KEY not in checkpoint else None
            path = getattr(self._trainer, "ckpt_path", None)
            current = self.policy_identity()
            other = identity.check_checkpoint_matches(checkpoint, current, state, path)
            if other is not None:
                rank_zero_warn(
                    f"The checkpoint {str(path)!r} was saved from a run of {other}, and this run trains "
                    f"{identity.describe_model(current)}. Their architecture, shapes and tokenizer are the same, so "
                    "training continues from the checkpoint's weights (this model's own weights are not used)."
                )
            changed = identity.setting_differences(checkpoint.get("hyper_parameters"), self.hparams)
            if changed:
                rank_zero_warn(
                    f"Resuming {str(path)!r} with settings other than the run that saved it; this run trains with its "
                    "own (the checkpoint's weights, optimizer state and data position are restored): "
                    + "; ".join(changed)
                )
        self.policy_version = int(checkpoint.get("policy_version", 0))

    def policy_identity(self) -> dict[str, Any]:
        """What a checkpoint records about this policy (:func:`.checkpoint_identity.policy_identity`)."""
        if self._tokenizer_fingerprint is None:  # hashing a large vocabulary is slow: once
            self._tokenizer_fingerprint = identity.tokenizer_fingerprint(self.tokenizer)
        return identity.policy_identity(
            self.policy,
            self.tokenizer,
            self.model_name,
            self._tokenizer_fingerprint,
            from_instance=not isinstance(self.hparams.get("model"), str),
        )
