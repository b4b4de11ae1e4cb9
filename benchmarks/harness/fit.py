"""The one way the scripts build a Lightning ``Trainer``, and the clock of an RL fit's batches."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning as L


def bare_trainer(max_steps: int, callbacks: Sequence[L.Callback] = (), **overrides: Any) -> L.Trainer:
    """A one-device CPU ``Trainer`` that writes nothing: no logger, checkpoint, progress bar or model summary.

    Args:
        max_steps: optimizer steps of the fit.
        callbacks: the fit's callbacks, in the order they run.
        overrides: further ``Trainer`` arguments (e.g. ``log_every_n_steps=1`` where a callback reads
            ``callback_metrics`` after every batch).

    Returns:
        The ``Trainer``; the caller runs ``fit``.
    """
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(max_steps=max_steps, callbacks=list(callbacks), **{**settings, **overrides})


class StepClock(L.Callback):
    """Per batch: wall time between consecutive batch starts, and the rollout side's share of it.

    Placed before the ``RolloutCallback``; its ``after_rollout`` part right after it, so the time
    between the two ``on_train_batch_start`` calls is the rollout side of the step: push, generate,
    score (synchronous), or the wait for the background producer (asynchronous).
    """

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.rollout_side: list[float] = []
        self.after_rollout = _AfterRollout(self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())


class _AfterRollout(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.rollout: Any = None  # the RolloutCallback, when its per-batch counts are to be read
        self.interrupted_frac: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.rollout_side.append(time.perf_counter() - self.clock.starts[-1])
        if self.rollout is not None:
            self.interrupted_frac.append(self.rollout.last_timing.get("interrupted_frac", 0.0))


class KeptOpen:
    """Lets several fits share one engine (the callback closes its engine at the end of a fit)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def close(self) -> None:  # the script closes the engine itself, once
        pass
