"""Which training batches log: the values computed only where a logger receives them."""

from __future__ import annotations

from typing import Any


def is_logging_step(trainer: Any, batch_idx: int, optimizer_steps_per_batch: int = 1, steps_done: bool = False) -> bool:
    """Whether the values of a training batch reach the logger.

    Lightning's own rule (``Trainer(log_every_n_steps=n)``: every n-th batch, or when the trainer is
    stopping), plus the fit's last batch (its ``max_steps``, or the end of its epoch), so that
    ``trainer.callback_metrics`` end with the final values. On the other batches Lightning drops
    ``on_step`` values before they reach a logger, so computing them there is wasted (metric updates,
    their ``compute`` and dozens of ``self.log`` calls per step).

    Args:
        trainer: The ``Trainer`` (``None``: outside a fit, always True).
        batch_idx: The batch's index in its epoch.
        optimizer_steps_per_batch: Optimizer steps (``trainer.global_step`` increments) per batch.
        steps_done: The batch's optimizer steps are already counted in ``trainer.global_step``
            (asked from ``on_train_batch_end``) rather than still to come (``training_step``).
    """
    if trainer is None:
        return True
    if trainer._logger_connector.should_update_logs:
        return True
    steps_after = trainer.global_step + (0 if steps_done else optimizer_steps_per_batch)
    if trainer.max_steps >= 0 and steps_after >= trainer.max_steps:
        return True
    return batch_idx + 1 >= trainer.num_training_batches
