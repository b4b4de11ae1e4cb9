"""``OffPolicyMixin``: off-policy-corrected RL steps for an existing causal-LM LightningModule.

Put it first in the bases (``class MyLM(OffPolicyMixin, L.LightningModule)``) and add a
:class:`~lightning_offpolicy.lightning.callback.RolloutCallback` and a prompt DataModule to the
Trainer. The module exposes its causal LM (``policy_attribute``, default ``"model"``), a
``tokenizer``, its own ``training_step`` and ``configure_optimizers``. The mixin wraps the class's
``training_step`` and checkpoint / batch-end hooks when the class is created: a
:class:`~lightning_offpolicy.batch.PromptBatch` gets one corrected policy-gradient step under
automatic optimization (dropout off, ``pi_prox`` the detached ``pi_theta``), every other batch the
module's own code; ``policy_version`` counts every optimizer step. Its forward runs packed,
without padding, where the model allows it (``rl_packing``, as ``OffPolicyRLModule``'s
``packing``). What it requires and does, and when to use
:class:`~lightning_offpolicy.OffPolicyRLModule` instead: docs/journeys.md, "2. RL added to an
existing SFT module".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig, check_compatible
from lightning_offpolicy.lightning import checkpoint_identity as identity
from lightning_offpolicy.lightning.update_hooks import MetricsRecorder
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics
from lightning_offpolicy.train import step
from lightning_offpolicy.train.micro_step import MicroBatchStep
from lightning_offpolicy.train.policy import PackingMode, check_packing_mode, resolve_packing
from lightning_offpolicy.train.update import Forward, PPOUpdate

__all__ = ["OffPolicyMixin"]


class OffPolicyMixin:
    """Mix into a LightningModule (first in the bases) to train it with RL from a ``RolloutCallback``.

    Class attributes (override them in the subclass, or set them on the instance before the RL fit):

    Attributes:
        policy_attribute: Name of the attribute holding the causal LM.
        rl_correction: The off-policy correction (default: token TIS capped at 2).
        rl_loss: The surrogate and its aggregation (default: decoupled PPO, eps 0.2 / 0.28).
        temperature: Temperature the tokens are scored with; must equal the callback's.
        rl_packing: Packed, padding-free RL forwards: ``"auto"`` (where the model allows it), ``"on"``
            (required: a model that cannot pack is refused at the first RL step) or ``"off"`` (padded).
            Resolved against the policy at the first RL step (:attr:`rl_packed`).
        policy_version: Optimizer steps taken so far.
    """

    policy_attribute: str = "model"
    rl_correction: OffPolicyCorrectionConfig = OffPolicyCorrectionConfig.token_tis(clip_high=2.0)
    rl_loss: PolicyLossConfig = PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    temperature: float = 1.0
    rl_packing: PackingMode = "auto"
    policy_version: int = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_packing_mode(cls.rl_packing, _PACKING_SETTING)  # a class attribute: refused when the class is defined
        for name, before in _ROUTED.items():
            method = cls.__dict__.get(name) or getattr(cls, name, None)
            if method is not None and not getattr(method, "_off_policy_wrapped", False):
                setattr(cls, name, _wrap(method, before))

    @property
    def policy(self) -> torch.nn.Module:
        """The causal LM the rollouts are generated with and the RL step trains."""
        try:
            return getattr(self, self.policy_attribute)
        except AttributeError:
            # Not an AttributeError: torch.nn.Module.__getattr__ would replace the message.
            raise TypeError(
                f"OffPolicyMixin: the module has no attribute {self.policy_attribute!r} holding the causal LM; "
                "set `policy_attribute` on the class to the attribute's name."
            ) from None

    @property
    def rl_packed(self) -> bool:
        """Whether the RL forwards run packed: ``rl_packing`` resolved against the policy.

        Resolved at the first RL step (or here, when asked before it), again only if the policy or
        ``rl_packing`` changes.

        Raises:
            ValueError: ``rl_packing`` is not a known mode, or is ``"on"`` and the policy cannot pack.
        """
        policy, mode = self.policy, self.rl_packing
        cached = self.__dict__.get("_rl_packed")
        if cached is None or cached[0] is not policy or cached[1] != mode:
            check_packing_mode(mode, _PACKING_SETTING)
            cached = self.__dict__["_rl_packed"] = (policy, mode, resolve_packing(mode, [policy], _PACKING_SETTING))
        return cached[2]

    def _route_training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        if isinstance(batch, (PromptBatch, RolloutBatch)):
            return True, self.off_policy_step(batch, batch_idx)
        return False, None

    def off_policy_step(self, batch: PromptBatch | RolloutBatch, batch_idx: int) -> torch.Tensor:
        """The loss of one corrected policy-gradient step on the batch's rollouts."""
        rollout = step.rollout_of(batch, "OffPolicyMixin.off_policy_step")
        if self.rl_correction.bypass_mode or self.rl_loss.ref_kl_coef > 0:
            raise ValueError(
                "OffPolicyMixin supports neither bypass_mode (its pi_prox is free already) nor ref_kl_coef > 0 (no "
                "reference model); use OffPolicyRLModule for those."
            )
        if self.rl_correction.prox_method != "recompute":
            # Its single step's pi_prox is the detached pi_theta: exact, and already without a forward.
            raise ValueError(
                f"OffPolicyMixin takes pi_prox from its one forward already (exact, no extra pass), so "
                f"rl_correction.prox_method={self.rl_correction.prox_method!r} has nothing to save; use 'recompute', "
                "or OffPolicyRLModule."
            )
        check_compatible(self.rl_correction, self.rl_loss)
        packed = self.rl_packed
        rollout = rollout.to(self.device)
        rollout.validate(require_rollout_logprobs=True)
        if self.__dict__.get("_modes_before_rl") is None:
            self.__dict__["_modes_before_rl"] = _dropout_off(self)
        if getattr(self, "_off_policy_metrics", None) is None:
            # Created on first use: the module's own __init__ is not ours to extend.
            self._off_policy_metrics = torch.nn.ModuleList(
                [CorrectionMetrics(self.rl_correction), PolicyLossMetrics(self.rl_correction)]
            ).to(self.device)
        # One optimizer step, one micro-batch: pi_prox is the detached pi_theta of its forward (exact).
        micro_step = MicroBatchStep(self.rl_correction, self.rl_loss, statistics=self._off_policy_metrics[0].sums)
        update = PPOUpdate(micro_step, shuffle_minibatches=False, packed=packed)
        hooks = _AutomaticOptimizationHooks(self.policy, self.temperature, packed)
        recorder = _StepRecorder(*self._off_policy_metrics)
        update(rollout, hooks, recorder, logging=True, step_version=int(self.policy_version))
        self._log_off_policy(rollout, recorder)
        return hooks.loss

    def _count_optimizer_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        # Called once per optimizer step under automatic optimization, after optimizer.step().
        self.policy_version = int(self.policy_version) + 1
        return False, None

    def _restore_modes(self, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        # After the batch's backward (and optimizer step): the modes the module had before the RL batch.
        modes = self.__dict__.pop("_modes_before_rl", None)
        for sub, training in modes or ():
            sub.training = training
        return False, None

    def _save_policy_version(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        checkpoint["policy_version"] = self.policy_version
        # Which policy these weights belong to: a resume into another one is refused (_load_policy_version).
        checkpoint[identity.IDENTITY_KEY] = self._policy_identity()
        return False, None

    def _load_policy_version(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        # Before Lightning loads the weights: another architecture, other shapes or another tokenizer is
        # refused naming both (CheckpointMismatchError) rather than by a list of missing keys, or not at all.
        trainer = getattr(self, "_trainer", None)
        identity.check_checkpoint_matches(checkpoint, self._policy_identity(), path=getattr(trainer, "ckpt_path", None))
        self.policy_version = int(checkpoint.get("policy_version", 0))
        return False, None

    def _policy_identity(self) -> dict[str, Any]:
        """What a checkpoint records about the policy (:func:`.checkpoint_identity.policy_identity`); the
        tokenizer when the module has one as ``tokenizer``."""
        tokenizer = getattr(self, "tokenizer", None)
        cached = self.__dict__.get("_tokenizer_fingerprint")
        if tokenizer is not None and (cached is None or cached[0] is not tokenizer):
            # Hashing a large vocabulary is slow: once per tokenizer, not at every save.
            cached = self.__dict__["_tokenizer_fingerprint"] = (tokenizer, identity.tokenizer_fingerprint(tokenizer))
        fingerprint = cached[1] if tokenizer is not None else None
        return identity.policy_identity(
            self.policy, tokenizer, type(self.policy).__name__, fingerprint, from_instance=True
        )

    def _log_off_policy(self, rollout: RolloutBatch, recorder: _StepRecorder) -> None:
        correction_metrics, loss_metrics = self._off_policy_metrics
        values = {**correction_metrics.compute(), **loss_metrics.compute()}
        values["train/reward"] = rollout.rewards.mean()
        # Mean entropy (nats) of the policy over the response tokens: a fall towards 0 is collapse.
        entropy = recorder.entropies
        values["train/entropy"] = entropy.mean() if entropy.numel() else torch.zeros(())
        values["staleness/mean"] = step.token_staleness(rollout, self.policy_version).mean()
        values["train/policy_version"] = float(self.policy_version)
        step.log_step(self, values, progress_bar={"reward": "train/reward"})
        correction_metrics.reset()
        loss_metrics.reset()


class _AutomaticOptimizationHooks:
    """:class:`~lightning_offpolicy.train.update.UpdateHooks` of one step under automatic optimization.

    Lightning runs the backward and the optimizer step on the loss ``training_step`` returns: the
    update's one micro-batch loss is kept (:attr:`loss`), not back-propagated here. Under DDP the
    loss is each rank's own token mean (no collectives).
    """

    world_size = 1

    def __init__(self, policy: torch.nn.Module, temperature: float, packed: bool) -> None:
        self.policy = policy
        self.temperature = temperature
        self.packed = packed
        self.loss: torch.Tensor | None = None

    def forward(self, batch: RolloutBatch, return_entropy: bool) -> Forward:
        return step.response_logprobs(
            self.policy, batch, self.temperature, return_entropy=return_entropy, packed=self.packed
        )

    def no_grad_forward(self, batch: RolloutBatch, reference: bool) -> torch.Tensor:
        raise RuntimeError("OffPolicyMixin takes pi_prox from its one forward and has no reference model.")

    def backward(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def optimizer_step(self) -> torch.Tensor:
        return torch.zeros(())

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def global_max(self, value: int) -> int:
        return value


class _StepRecorder(MetricsRecorder):
    """The module's metric states, and the step's entropies kept as they are (one mean per step)."""

    def __init__(self, correction: CorrectionMetrics, losses: PolicyLossMetrics) -> None:
        super().__init__(correction, losses, entropy=None)
        self.entropies = torch.zeros(0)

    def entropy(self, values: torch.Tensor) -> None:
        self.entropies = values


_PACKING_SETTING = "OffPolicyMixin.rl_packing"


def _dropout_off(module: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Put every submodule in eval mode; return each one's previous mode, to be restored later.

    Not before the backward: a checkpointed layer is recomputed there in its mode at that time.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    for sub in module.modules():
        # transformers recomputes a checkpointed layer only in training mode: set the layer's flag
        # alone, not its children's, so that its dropout stays off (as OffPolicyRLModule does).
        if isinstance(sub, GradientCheckpointingLayer) and sub.gradient_checkpointing:
            sub.training = True
    return modes


#: Methods a subclass may define that would hide the mixin's, and the mixin part run before them:
#: it returns ``(handled, result)``; when handled, the subclass's method is not called.
_ROUTED: dict[str, Callable[..., tuple[bool, Any]]] = {
    "training_step": OffPolicyMixin._route_training_step,
    "on_before_zero_grad": OffPolicyMixin._count_optimizer_step,
    "on_train_batch_end": OffPolicyMixin._restore_modes,
    "on_save_checkpoint": OffPolicyMixin._save_policy_version,
    "on_load_checkpoint": OffPolicyMixin._load_policy_version,
}


def _wrap(own: Callable[..., Any], before: Callable[..., tuple[bool, Any]]) -> Callable[..., Any]:
    flag = f"_off_policy_in_{own.__name__}"

    @functools.wraps(own)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get(flag):  # a subclass's method calling super(): the mixin part ran already
            return own(self, *args, **kwargs)
        self.__dict__[flag] = True
        try:
            handled, result = before(self, *args, **kwargs)
            return result if handled else own(self, *args, **kwargs)
        finally:
            self.__dict__[flag] = False

    wrapped._off_policy_wrapped = True  # type: ignore[attr-defined]
    return wrapped
