"""A progress bar that counts training batches, with the optimizer step next to it.

Lightning's :class:`~lightning.pytorch.callbacks.TQDMProgressBar` sizes the training bar with
``max_steps - global_step`` as if each batch were one optimizer step. Under manual optimization
:class:`~lightning_offpolicy.OffPolicyRLModule` takes ``ppo_epochs * num_minibatches`` optimizer
steps per batch (``global_step`` counts those), so with ``max_steps: 600`` and 2 steps per batch
the bar promised 600 batches where the fit ends after 300. :class:`RLProgressBar` divides the
remaining optimizer steps by the steps per batch and shows ``opt_step=<global_step>/<max_steps>``
in the postfix. The ``lightning-offpolicy`` CLI uses it in place of Lightning's default bar; in
Python pass it yourself::

    Trainer(max_steps=600, callbacks=[RolloutCallback(...), RLProgressBar()])

Without it, Lightning's default bar (``RichProgressBar`` when ``rich`` is installed) also labels an
epoch ``Epoch 1/-2`` when ``max_steps`` ends the fit: it prints ``max_epochs - 1``, and
``max_epochs`` is -1 then. This bar labels it ``Epoch 1``.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_offpolicy.argcheck import is_int

__all__ = ["RLProgressBar", "remaining_batches"]


def remaining_batches(epoch_batches: float, max_steps: int, global_step: int, steps_per_batch: int) -> float:
    """Training batches left in this epoch when ``max_steps`` counts optimizer steps.

    Args:
        epoch_batches: Batches in one epoch (``trainer.num_training_batches``; ``inf`` for an
            iterable without length).
        max_steps: The Trainer's ``max_steps`` (optimizer steps); ``-1`` or ``None``: no limit.
        global_step: Optimizer steps taken so far.
        steps_per_batch: Optimizer steps one batch takes (>= 1).
    """
    if max_steps is None or max_steps < 0:
        return epoch_batches
    left = math.ceil(max(max_steps - global_step, 0) / max(int(steps_per_batch), 1))
    return min(epoch_batches, left)


class RLProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose training total counts batches when a batch takes several optimizer steps.

    The steps per batch come from the module's ``optimizer_steps_per_batch`` (as on
    :class:`~lightning_offpolicy.OffPolicyRLModule`); a manually optimized module without it is
    measured on its last batch; under automatic optimization one batch is one step, as Lightning
    assumes. The postfix adds ``opt_step=<global_step>/<max_steps>``.

    Args:
        refresh_rate: Update the bar every this many batches (0: disable it).
        process_position: Offset of the bar (several bars in one terminal).
        leave: Keep the finished bar of each epoch on screen.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._measured_steps_per_batch: int | None = None
        self._step_before_batch = 0

    def steps_per_batch(self) -> int:
        """Optimizer steps one training batch takes (1 until known)."""
        module = self.trainer.lightning_module
        if getattr(module, "automatic_optimization", True):
            return 1
        declared = getattr(module, "optimizer_steps_per_batch", None)
        if is_int(declared) and declared >= 1:
            return declared
        return self._measured_steps_per_batch or 1

    @property
    @override
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return remaining_batches(
                trainer.num_training_batches, trainer.max_steps, trainer.global_step, self.steps_per_batch()
            )
        return trainer.num_training_batches

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_before_batch = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        taken = trainer.global_step - self._step_before_batch
        if taken >= 1:
            self._measured_steps_per_batch = taken
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float | dict]:
        metrics = super().get_metrics(trainer, pl_module)
        limit = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
        metrics["opt_step"] = f"{trainer.global_step}/{limit}" if limit else str(trainer.global_step)
        return metrics
