"""What a fit prints: a model summary without its empty FLOPs count, no tips, and where the run's files are.

The ``lightning-offpolicy`` CLI installs all three (docs/getting_started.md, "What a fit prints");
from Python, add :class:`FitSummary` and :class:`ModelSummaryWithoutFlops` to the Trainer's callbacks
and call :func:`silence_lightning_tips` once.
"""

from __future__ import annotations

import glob
import logging
import os
import statistics
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

__all__ = ["FitSummary", "ModelSummaryWithoutFlops", "silence_lightning_tips", "summary_lines"]

#: The summary goes where Lightning's own goes (its logger prints INFO to the console).
_SUMMARY_LOG = logging.getLogger("lightning.pytorch.callbacks.model_summary")

#: Lightning's tips (litlogger, litmodels) start with this; they advertise services, not the run.
TIP_PREFIX = "💡 Tip:"
#: The logger Lightning's ``rank_zero_info`` writes to.
_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TIP_PREFIX)


def silence_lightning_tips() -> None:
    """Drop Lightning's "💡 Tip: ..." lines from its console log; every other message is kept."""
    logger = logging.getLogger(_RANK_ZERO_LOGGER)
    if not any(isinstance(f, _DropTips) for f in logger.filters):
        logger.addFilter(_DropTips())


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's text :class:`~lightning.pytorch.callbacks.ModelSummary`, without the FLOPs column and
    total when no FLOPs were counted.

    Lightning counts FLOPs on the module's ``example_input_array``; an RL module has none (its inputs
    are rollouts), so the plain summary ends with a misleading ``Total FLOPs: 0``.
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
            )
            return
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns
        )
        _SUMMARY_LOG.info("\n" + "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops")))


def _window_mean(values: list[float], first: bool, window: int) -> float:
    return statistics.fmean(values[:window] if first else values[-window:])


def summary_lines(
    log_dir: str | None,
    checkpoint: str | None,
    events: str | None,
    rewards: list[float],
    window: int = 30,
    tensorboard_dir: str | None = None,
) -> list[str]:
    """The lines :class:`FitSummary` prints at the end of a fit.

    Args:
        log_dir: The run's directory (``config.yaml``, events, checkpoints); ``None``: no logger.
        checkpoint: The last checkpoint this run wrote; ``None``: none.
        events: This run's TensorBoard event file; ``None``: no TensorBoard logger.
        rewards: ``train/reward`` of each training batch that took an optimizer step, in order.
        window: Batches averaged at each end of ``rewards`` (fewer when the run had under ``2 * window``).
        tensorboard_dir: The directory to point ``tensorboard --logdir`` at (the logger's ``save_dir``).

    Returns:
        The lines, without newlines.
    """
    lines = [f"Run directory:     {log_dir or '(no logger)'}"]
    lines.append(f"Last checkpoint:   {checkpoint or '(none saved)'}")
    if checkpoint:
        lines.append("                   (add --ckpt_path last to the same command to resume from it)")
    if events:
        lines.append(f"TensorBoard:       {events}")
        if tensorboard_dir:
            lines.append(f"                   (tensorboard --logdir {tensorboard_dir})")
    if rewards:
        n = max(1, min(window, len(rewards) // 2))
        first, last = _window_mean(rewards, True, n), _window_mean(rewards, False, n)
        lines.append(
            f"train/reward:      {first:.3f} (mean of the first {n} batches) -> {last:.3f} (last {n}), "
            f"{len(rewards)} batches"
        )
    return lines


class FitSummary(Callback):
    """Print, at the end of a fit, where the run, its last checkpoint and its TensorBoard events are,
    and ``train/reward`` over the first and the last batches.

    Args:
        window: Batches averaged at each end of the run for the reward (the docs' tables use 30).
    """

    def __init__(self, window: int = 30) -> None:
        self.window = window
        self.rewards: list[float] = []
        self._step_before_batch = 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_before_batch = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # A batch without an optimizer step logged nothing: the metric still holds the batch before's value.
        reward = trainer.callback_metrics.get("train/reward")
        if reward is not None and trainer.global_step > self._step_before_batch:
            self.rewards.append(float(reward))

    @override
    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        events, tensorboard_dir = _events(trainer)
        lines = summary_lines(
            _log_dir(trainer), _checkpoint(trainer), events, self.rewards, self.window, tensorboard_dir
        )
        print("\n".join(lines))


def _log_dir(trainer: Trainer) -> str | None:
    logger = trainer.logger
    if logger is None:
        return None
    return getattr(logger, "log_dir", None) or logger.save_dir


def _checkpoint(trainer: Trainer) -> str | None:
    paths = [
        c.last_model_path or c.best_model_path for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)
    ]
    paths += [getattr(c, "saved_path", None) for c in trainer.callbacks]  # PreemptionCheckpoint's
    existing = [p for p in paths if p and os.path.exists(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def _events(trainer: Trainer) -> tuple[str | None, str | None]:
    """The TensorBoard logger's newest event file (a resumed run adds one beside the first) and its ``save_dir``."""
    logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
    if logger is None:
        return None, None
    files = glob.glob(os.path.join(logger.log_dir, "events.out.tfevents.*"))
    return (max(files, key=os.path.getmtime) if files else None), logger.save_dir
