"""``PreemptionCheckpoint``: on SIGTERM, save a checkpoint at a batch boundary and exit non-zero.

Lightning alone exits 0 on SIGTERM and saves nothing. This callback records the signal, stops every
rank at the same batch boundary (cutting a generation in flight short through the rollout callbacks'
``preempt()``), saves ``<dirpath>/<filename>.ckpt`` and exits with ``exit_code`` (143), or with
``save_error_exit_code`` (74) when the save fails. On any other exception, in a single process at a
batch boundary, it saves ``<dirpath>/<exception_filename>.ckpt`` and re-raises. ``lightning-offpolicy
fit`` always adds it; resume with ``--ckpt_path last``. The mechanics, the engine's processes and the
sanity check: docs/training.md, "PreemptionCheckpoint"; exit statuses and resume:
docs/getting_started.md, "Stopping, preemption and exit codes".
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.lightning.checkpointing import CheckpointSaveError, save_on_every_rank

log = logging.getLogger(__name__)

#: The status a shell reports for a process ended by SIGTERM (128 + 15).
SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)

#: The status after a first Ctrl-C, as a shell reports a process ended by SIGINT (128 + 2).
SIGINT_EXIT_CODE = 128 + int(signal.SIGINT)

#: The status when the preemption checkpoint could not be written: ``EX_IOERR`` of ``sysexits.h``.
SAVE_ERROR_EXIT_CODE = 74


def _forget_unstarted_batch(trainer: Trainer) -> None:
    """Count a batch that was fetched but never started as not fetched, so that the checkpoint is the last boundary.

    A batch stopped in ``on_train_batch_start`` leaves Lightning's progress at "ready" one past
    "started"; a run resumed from that state counts one batch more than it trained (its logged steps
    shift by one). Its data position (:func:`~lightning_offpolicy.data.sampler.trained_position`,
    batches processed) already excludes it, so the resumed run fetches the same prompts again.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    unstarted = [
        counts
        for counts in (progress.total, progress.current)
        if counts.ready == counts.started + 1 and counts.started == counts.processed == counts.completed
    ]
    for counts in unstarted:
        counts.ready -= 1
    if unstarted:
        progress.is_last_batch = False  # the epoch's last batch, if it was, is still to come


def _resume_replays_the_batch_end(trainer: Trainer) -> bool:
    """Whether a run resumed from the trainer's current state would run the last batch's end again.

    Lightning resumes a checkpoint whose last batch was a validation batch (all its progress counts
    equal) by running that batch's end once more (``on_advance_end``, validation skipped), which
    counts the batch as stepped again. That suits a checkpoint saved during the validation, before
    the batch was counted (as ``ModelCheckpoint`` saves on validation end); a save from the exception
    path after the batch's end was counted would log every later step one too far.
    """
    loop = trainer.fit_loop.epoch_loop
    total = loop.batch_progress.total
    at_the_end_of_a_batch = total.ready == total.started == total.processed == total.completed > 0
    counted = loop._batches_that_stepped == total.completed  # the last batch's end ran (once per batch)
    return at_the_end_of_a_batch and counted and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def on_any_rank(trainer: Trainer, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (a collective: every rank calls it at the same point).

    Args:
        trainer: The running Trainer.
        flag: This rank's value.

    Returns:
        ``flag`` in a single process; else whether any rank passed ``True``.
    """
    if trainer.world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=trainer.strategy.root_device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item() > 0)


class PreemptionCheckpoint(Callback):
    """On SIGTERM: save a checkpoint at the next batch boundary, then exit with a non-zero status.

    A first Ctrl-C (SIGINT, where Python's own handler is in place) is handled the same way and exits 130; a
    second one raises ``KeyboardInterrupt`` at once (then the on-exception rule below applies).

    Args:
        dirpath: Directory of the checkpoint; ``None``: the ``ModelCheckpoint`` callback's directory, else
            where one would write (the run's own ``<save_dir>/<name>/version_N/checkpoints``).
        filename: Checkpoint file name without the ``.ckpt`` extension.
        exit_code: Exit status of the process after the checkpoint (143 = 128 + SIGTERM; must be
            1-255, non-zero so that a scheduler sees the job did not finish).
        save_error_exit_code: Exit status when the checkpoint could not be written (a full disk): 1-255 and
            not ``exit_code``, so that a scheduler does not take the job for a resumable preemption.
        save_on_exception: On any other exception, save ``<dirpath>/<exception_filename>.ckpt`` when the
            state is that of the last completed batch and the run is a single process.
        exception_filename: File name of that checkpoint, without ``.ckpt``.

    Raises:
        ValueError: A file name is empty or holds a path separator, an exit status is outside 1..255, or the
            two exit statuses are equal.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "preempted",
        exit_code: int = SIGTERM_EXIT_CODE,
        save_error_exit_code: int = SAVE_ERROR_EXIT_CODE,
        save_on_exception: bool = True,
        exception_filename: str = "on_exception",
    ):
        for key, name in (("filename", filename), ("exception_filename", exception_filename)):
            if not isinstance(name, str) or not name or os.sep in name:
                raise ValueError(f"PreemptionCheckpoint.{key}={name!r} must be a non-empty file name (no '{os.sep}').")
        if filename == exception_filename:
            raise ValueError(
                f"PreemptionCheckpoint.exception_filename={exception_filename!r} must differ from filename: "
                "--ckpt_path last tells them apart by time only, and one would overwrite the other."
            )
        for key, code in (("exit_code", exit_code), ("save_error_exit_code", save_error_exit_code)):
            if not is_int(code) or not 1 <= code <= 255:
                raise ValueError(
                    f"PreemptionCheckpoint.{key}={code!r} must be an int in 1..255: 0 would tell the scheduler "
                    "the job finished."
                )
        if save_error_exit_code == exit_code:
            raise ValueError(
                f"PreemptionCheckpoint.save_error_exit_code={save_error_exit_code} must differ from exit_code: "
                "a failed save would read as a preemption with a checkpoint to resume from."
            )
        if not isinstance(save_on_exception, bool):
            raise ValueError(f"PreemptionCheckpoint.save_on_exception={save_on_exception!r} must be true or false.")
        self.dirpath = dirpath
        self.filename = filename
        self.exit_code = exit_code
        self.save_error_exit_code = save_error_exit_code
        self.save_on_exception = save_on_exception
        self.exception_filename = exception_filename
        #: Path of the checkpoint written on SIGTERM or on an exception (``None`` until then).
        self.saved_path: str | None = None
        #: The error of a save that failed (``None`` when none did).
        self.save_error: OSError | None = None
        self._signalled = False
        self._interrupted = False  # the signal was a Ctrl-C (SIGINT)
        self._previous_handler: Any = None
        self._handles_sigint = False
        self._installed = False
        # global_step at the last batch boundary: a save from the exception path is consistent only there.
        self._boundary_step: int | None = None
        # Set while this callback saves: the checkpoint must not count the last batch twice on resume.
        self._uncount_the_last_batch = False
        self._rollouts: list[Any] = []  # callbacks with preempt() (RolloutCallback): cut short on SIGTERM
        self._run_directory: str | None = None  # where a ModelCheckpoint of this run would write (set up per fit)

    @property
    def signalled(self) -> bool:
        """Whether this process received SIGTERM (or a first Ctrl-C) during training."""
        return self._signalled

    @property
    def cause(self) -> str:
        """What stopped the run, for messages: ``"SIGTERM"`` or ``"Ctrl-C"``."""
        return "Ctrl-C" if self._interrupted else "SIGTERM"

    @property
    def status(self) -> int:
        """The exit status after a SIGTERM: ``exit_code`` (after a first Ctrl-C: 130), or ``save_error_exit_code``
        when the save failed."""
        if self.save_error is not None:
            return self.save_error_exit_code
        return SIGINT_EXIT_CODE if self._interrupted else self.exit_code

    def checkpoint_path(self, trainer: Trainer, filename: str | None = None) -> str:
        """Where the checkpoint goes (see ``dirpath``).

        Args:
            trainer: The running Trainer.
            filename: The file name without ``.ckpt``; ``None``: ``filename``.

        Returns:
            The checkpoint's path.
        """
        directory = self.dirpath or getattr(trainer.checkpoint_callback, "dirpath", None) or self._run_directory
        if directory is None:
            directory = _checkpoint_directory_of_the_run(trainer)
        return os.path.join(directory, f"{filename or self.filename}.ckpt")

    # ------------------------------------------------------------------------------ signal
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag here, and threads started: no I/O, no lock and no collective inside a signal handler.
        first = not self._signalled
        self._signalled = True
        for callback in self._rollouts if first else ():
            # A rollout in flight (a remote request that hangs, a long generation) is cut short from
            # another thread: the interrupt takes locks the interrupted main thread may hold.
            threading.Thread(target=callback.preempt, name="preempt-rollout", daemon=True).start()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # A first Ctrl-C stops the run as a SIGTERM does (at the end of the batch, with a checkpoint): a
        # KeyboardInterrupt inside a batch, between its optimizer steps, leaves no state worth saving. A
        # second one interrupts at once.
        if self._interrupted:
            signal.default_int_handler(signum, frame)
        self._interrupted = True
        os.write(2, b"\nCtrl-C: stopping at the end of this batch, with a checkpoint (Ctrl-C again: stop now)\n")
        self._on_sigterm(signum, frame)

    def _install(self) -> None:
        # Signal handlers can only be set from the main thread (a Trainer run from another thread keeps Lightning's).
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        # Ctrl-C only where Python's own handler would raise KeyboardInterrupt (not a handler of the user's).
        self._handles_sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if self._handles_sigint:
            signal.signal(signal.SIGINT, self._on_sigint)
        self._installed = True

    def _restore(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            previous = self._previous_handler
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if self._handles_sigint and signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._installed = False

    # ------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # As ModelCheckpoint resolves its directory: once, on every rank, rank 0's (a logger's next version).
        self._run_directory = trainer.strategy.broadcast(_checkpoint_directory_of_the_run(trainer))

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # From here on rather than from on_train_start: Lightning's own SIGTERM handler, registered just before
        # the sanity check, runs a broadcast inside the handler, and under DDP a signal to the process group
        # (which rank 0's handler forwards to the other ranks once more) leaves a rank waiting in it for good.
        self._start(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._installed:  # no sanity check ran (num_sanity_val_steps=0)
            self._start(trainer)

    def _start(self, trainer: Trainer) -> None:
        # Under several ranks the rollout callback stops every rank at the batch one of them was cut in.
        self._rollouts = [c for c in trainer.callbacks if callable(getattr(c, "preempt", None))]
        self._signalled = self._interrupted = False
        self.saved_path = None
        self.save_error = None
        self._boundary_step = trainer.global_step
        self._install()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._boundary_step = trainer.global_step
        if not self._any_rank_signalled(trainer):
            return
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "received_sigterm"):
            # Every rank sets Lightning's own flag at this same batch: its loop then raises SIGTERMException
            # once the batch is complete (metrics logged, progress counted), and on_exception saves.
            connector.received_sigterm = True
            return
        self._save(trainer)  # a Lightning without the signal connector: stop here
        raise SIGTERMException(self.status)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()
        if not isinstance(exception, SIGTERMException):
            if self._signalled:
                self._save_after_failure(trainer, exception)
            elif self.save_on_exception:
                self._save_on_exception(trainer, exception)
            return
        if self.saved_path is None and self.save_error is None and trainer.global_step > 0:
            # Lightning raises it between two batches (every rank at the same one), after the batch's logging;
            # RolloutCallback raises it at the start of a batch whose rollout a preemption stopped.
            self._save(trainer)
        if not exception.code or self.save_error is not None:
            # Lightning raises it with no code (the process would exit 0); a failed save is not a preemption.
            exception.code = self.status

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._uncount_the_last_batch:  # see _resume_replays_the_batch_end
            checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1

    # ------------------------------------------------------------------------------ helpers
    def _any_rank_signalled(self, trainer: Trainer) -> bool:
        return on_any_rank(trainer, self._signalled or bool(trainer.received_sigterm))

    def _at_batch_boundary(self, trainer: Trainer) -> bool:
        """Whether the trainer's state is that of a completed batch: no batch is between its optimizer steps.

        Either the failing batch had not stepped yet (``global_step`` is the last boundary's), or its training
        step had finished and a hook after it failed (asynchronous rollouts push the weights to the engine in
        ``on_train_batch_end``, where an engine stopped by the same SIGTERM fails): Lightning then counts the
        batch processed but not completed, and a resume from that state counts it completed, as for a
        checkpoint saved in ``on_train_batch_end``.
        """
        if trainer.global_step == self._boundary_step:
            return True
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        return progress.processed == progress.completed + 1

    def _save_after_failure(self, trainer: Trainer, exception: BaseException) -> None:
        """A SIGTERM, then an error (the signal also stopped the engine): save if the state is a batch boundary."""
        consistent = self._at_batch_boundary(trainer) and trainer.global_step > 0
        if self.saved_path is not None or not consistent or trainer.world_size > 1:
            why = (
                "already saved" if self.saved_path is not None
                else "several ranks" if trainer.world_size > 1
                else "not at a batch boundary"
            )  # fmt: skip
            log.warning(
                "%s, then %s: %s; no preemption checkpoint written (%s). Resume from the last checkpoint.",
                self.cause, type(exception).__name__, exception, why,
            )  # fmt: skip
            return
        if isinstance(exception, KeyboardInterrupt):
            log.warning("Ctrl-C again: stopping now. Saving the state of the last completed batch.")
        else:
            log.warning(
                "%s, then %s (the signal reached the engine too): %s Saving the state of the last completed batch.",
                self.cause,
                type(exception).__name__,
                str(exception).rstrip(".") + ".",
            )
        self._save(trainer)

    def _save_on_exception(self, trainer: Trainer, exception: BaseException) -> None:
        """Any other exception: save the state of the last completed batch, if that is the state."""
        if isinstance(exception, CheckpointSaveError) or trainer.global_step == 0:
            return  # the disk that just refused a checkpoint would refuse this one; nothing trained yet
        name = type(exception).__name__
        if trainer.world_size > 1 or not self._at_batch_boundary(trainer):
            why = (
                "several ranks: the other ranks may never reach the save"
                if trainer.world_size > 1
                else f"it stopped inside a batch, {trainer.global_step - (self._boundary_step or 0)} optimizer step(s) "
                "into it: the weights are no batch's"
            )
            log.warning(
                "%s at step %d: no on-exception checkpoint written (%s). Resume with --ckpt_path last "
                "(the last periodic checkpoint).",
                name, trainer.global_step, why,
            )  # fmt: skip
            return
        path = self.checkpoint_path(trainer, self.exception_filename)
        if self._write(trainer, path):
            log.warning(
                "%s: saved %s at step %d (the last completed batch). Resume with --ckpt_path last.",
                name, path, trainer.global_step,
            )  # fmt: skip

    def _write(self, trainer: Trainer, path: str) -> bool:
        """Save to ``path`` on every rank; a failed write is recorded in ``save_error`` and logged, not raised.

        Raising here would skip Lightning's teardown (the engine's and the producer's shutdown) and the other
        callbacks' ``on_exception``.
        """
        # Every save here is on the way out of the fit: its loop state may be set as a resume needs it.
        _forget_unstarted_batch(trainer)  # a batch stopped before it started (its rollout failed or was cut)
        self._uncount_the_last_batch = _resume_replays_the_batch_end(trainer)
        try:
            # Every rank calls it (a collective under sharded strategies).
            error = save_on_every_rank(trainer, functools.partial(trainer.save_checkpoint, path), path)
        finally:
            self._uncount_the_last_batch = False
        if error is None:
            self.saved_path = path
            return True
        self.save_error = error
        if trainer.is_global_zero:
            if isinstance(error, CheckpointSaveError):
                log.error("%s", error)  # names the cause, the path and the free space
            else:
                log.error("Checkpoint not saved: %s writing %s: %s", type(error).__name__, path, error)
        return False

    def _save(self, trainer: Trainer) -> None:
        path = self.checkpoint_path(trainer)
        if not self._write(trainer, path):
            if trainer.is_global_zero:
                log.error(
                    "%s: no checkpoint saved at step %d; exiting with status %d (not %d: there is nothing new "
                    "to resume from). Resume from the last checkpoint that was saved: --ckpt_path last.",
                    self.cause, trainer.global_step, self.status, self.exit_code,
                )  # fmt: skip
            return
        if trainer.is_global_zero:
            log.warning(
                "%s: saved %s at step %d; exiting with status %d. Resume with --ckpt_path last "
                "(or --ckpt_path %s; Python: trainer.fit(..., ckpt_path=...)).",
                self.cause,
                path,
                trainer.global_step,
                self.status,
                path,
            )


def _checkpoint_directory_of_the_run(trainer: Trainer) -> str:
    """Where a ``ModelCheckpoint`` without ``dirpath`` writes in this run: ``<save_dir>/<name>/<version>/checkpoints``
    of the first logger (a directory of this run's own), or ``<default_root_dir>/checkpoints`` without a logger."""
    if not trainer.loggers:
        return os.path.join(trainer.default_root_dir, "checkpoints")
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name), version, "checkpoints")
