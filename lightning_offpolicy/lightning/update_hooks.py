"""The Lightning side of the PPO update (:mod:`lightning_offpolicy.train.update`).

:class:`ManualOptimizationHooks` gives the update a LightningModule's forward, ``manual_backward``,
optimizer, scheduler, gradient sync (DDP's ``block_backward_sync``, FSDP2's
``set_requires_gradient_sync``) and collectives; :class:`MetricsRecorder` sends the update's
statistics to torchmetrics states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.correction import CorrectionStats, PolicyLossInfo
from lightning_offpolicy.correction.distributed import global_sum
from lightning_offpolicy.correction.fused import Statistics
from lightning_offpolicy.train.update import Forward


class ManualOptimizationHooks:
    """:class:`~lightning_offpolicy.train.update.UpdateHooks` of an ``OffPolicyRLModule`` under manual optimization.

    Args:
        module: The module: its ``sequence_logprobs``, ``_reference_context``, ``_global_max``, ``policy``,
            ``policy_version`` and ``gradient_clip_val`` are used.
    """

    def __init__(self, module: Any) -> None:
        self.module = module

    @property
    def world_size(self) -> int:
        """The Trainer's number of processes."""
        return self.module.trainer.world_size

    def forward(self, batch: RolloutBatch, return_entropy: bool) -> Forward:
        """The policy's teacher-forced logprobs (and entropies) of ``batch``, with gradient."""
        return self.module.sequence_logprobs(batch, return_entropy=return_entropy)

    def no_grad_forward(self, batch: RolloutBatch, reference: bool) -> torch.Tensor:
        """The policy's (or the reference's) logprobs of one micro-batch (the caller disables the gradient)."""
        with self.module._reference_context(reference) as model:
            return self.module.sequence_logprobs(batch, model=model)

    def backward(self, loss: torch.Tensor) -> None:
        """``manual_backward`` (precision and strategy aware)."""
        self.module.manual_backward(loss)

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on all but the last micro-batch of an optimizer step."""
        module = self.module
        if getattr(module, "_sharded", False):
            module.policy.set_requires_gradient_sync(enabled)
            yield
        elif not enabled and isinstance(module.trainer.strategy, DDPStrategy):
            with module.trainer.strategy.block_backward_sync():
                yield
        else:
            yield

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step the optimizer and the scheduler, zero the gradients, ``policy_version += 1``.

        Returns:
            The global gradient norm before clipping.
        """
        module = self.module
        optimizer = module.optimizers()
        grad_norm = self.clip_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = module.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        module.policy_version += 1
        return grad_norm

    def clip_gradients(self) -> torch.Tensor:
        """Clip the policy's gradients to ``module.gradient_clip_val`` (``None``: no clipping); return their norm."""
        module = self.module
        grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=module.device)
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        if module.gradient_clip_val is not None:
            params = [p for p in module.policy.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, module.gradient_clip_val, norm)
        return norm.detach()

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks."""
        return global_sum(tensor)

    def global_max(self, value: int) -> int:
        """``value``'s maximum over ranks."""
        return self.module._global_max(value)


class MetricsRecorder:
    """:class:`~lightning_offpolicy.train.update.UpdateRecorder` into torchmetrics states.

    Args:
        correction: A :class:`~lightning_offpolicy.metrics.correction.CorrectionMetrics`.
        losses: A :class:`~lightning_offpolicy.metrics.correction.PolicyLossMetrics`.
        entropy: A mean metric (``torchmetrics.MeanMetric``) of the response tokens' entropy.
    """

    def __init__(self, correction: Any, losses: Any, entropy: Any) -> None:
        self.correction_metrics = correction
        self.loss_metrics = losses
        self.entropy_metric = entropy

    def entropy(self, values: torch.Tensor) -> None:
        """Add one micro-batch's response-token entropies."""
        self.entropy_metric.update(values)

    def correction(self, stats: CorrectionStats) -> None:
        """Add a batch's (or micro-batch's) correction statistics."""
        self.correction_metrics.update(stats=stats)

    def correction_sums(self, sums: Statistics) -> None:
        """Add the metric sums a compiled step computed."""
        self.correction_metrics.update_from_sums(sums)

    def losses(self, info: PolicyLossInfo) -> None:
        """Add one micro-batch's policy-loss statistics."""
        self.loss_metrics.update(info=info)
