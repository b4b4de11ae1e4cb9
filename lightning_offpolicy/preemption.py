"""``PreemptionCheckpoint``: on SIGTERM, save a checkpoint at a batch boundary and exit non-zero.

A scheduler (SLURM, Kubernetes, a cloud spot instance) stops a job with SIGTERM and, a grace period
later, SIGKILL. Lightning 2.6 on its own notes the signal, raises
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` at the end of the current batch
and the process exits with status **0**: the scheduler reads success, and nothing is saved unless an
``OnExceptionCheckpoint`` is added. This callback:

* takes SIGTERM over from Lightning's handler once training starts, and only records it (Lightning's
  handler runs a ``broadcast`` inside the signal handler, which under DDP can interleave with the
  step's own collectives);
* at the end of every training batch, agrees across ranks whether any rank was signalled (one
  ``all_reduce`` of one number) and, if so, sets Lightning's own SIGTERM flag on every rank: Lightning
  then raises its ``SIGTERMException`` on all ranks once that batch is complete (logged, counted;
  during the last batch: at the end of the epoch, so the checkpoint is the finished run);
* on that exception saves ``<dirpath>/<filename>.ckpt`` (a full checkpoint: weights, optimizer,
  ``policy_version``, the rollout callback's state) and gives the exception the code ``exit_code``: the
  rollout producer and the engine are shut down by the usual exception path, and the process exits
  with ``exit_code`` (143 = 128 + SIGTERM, what a shell reports for a process killed by SIGTERM).

A scheduler that signals the whole process group (``scancel``, a container stop) also stops the
engine's processes (vLLM's ``EngineCore``): the batch being generated then fails with the engine's
error before Lightning's flag is seen. When that error follows a SIGTERM and no optimizer step ran
since the last completed batch (single process: under several ranks a save from the exception path
could wait on a rank that never comes), the checkpoint is saved all the same, and
``lightning-offpolicy fit`` exits with ``exit_code`` instead of 1 (:attr:`PreemptionCheckpoint.signalled`).

Resume with ``lightning-offpolicy fit ... --ckpt_path <dirpath>/preempted.ckpt`` (or
``trainer.fit(..., ckpt_path=...)``). ``lightning-offpolicy fit`` always adds it (``--preemption.*``);
add it yourself to a Python ``Trainer``. A SIGTERM that arrives before training starts (model
loading, engine start) still ends the run through Lightning's or Python's own handling.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

#: The status a shell reports for a process ended by SIGTERM (128 + 15).
SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)


class PreemptionCheckpoint(Callback):
    """On SIGTERM: save a checkpoint at the next batch boundary, then exit with a non-zero status.

    Args:
        dirpath: Directory of the checkpoint; ``None``: the ``ModelCheckpoint`` callback's directory,
            else ``<trainer.default_root_dir>/checkpoints``.
        filename: Checkpoint file name without the ``.ckpt`` extension.
        exit_code: Exit status of the process after the checkpoint (143 = 128 + SIGTERM; must be
            1-255, non-zero so that a scheduler sees the job did not finish).
    """

    def __init__(self, dirpath: str | None = None, filename: str = "preempted", exit_code: int = SIGTERM_EXIT_CODE):
        if not filename or os.sep in filename:
            raise ValueError(
                f"PreemptionCheckpoint.filename={filename!r} must be a non-empty file name (no '{os.sep}')."
            )
        if not is_int(exit_code) or not 1 <= exit_code <= 255:
            raise ValueError(
                f"PreemptionCheckpoint.exit_code={exit_code!r} must be an int in 1..255: 0 would tell the scheduler "
                "the job finished."
            )
        self.dirpath = dirpath
        self.filename = filename
        self.exit_code = exit_code
        #: Path of the checkpoint written on SIGTERM (``None`` until then).
        self.saved_path: str | None = None
        self._signalled = False
        self._previous_handler: Any = None
        self._installed = False
        # global_step at the last batch boundary: a save from the exception path is consistent only there.
        self._boundary_step: int | None = None

    @property
    def signalled(self) -> bool:
        """Whether this process received SIGTERM during training."""
        return self._signalled

    def checkpoint_path(self, trainer: Trainer) -> str:
        """Where the checkpoint goes (see ``dirpath``)."""
        directory = self.dirpath
        if directory is None:
            callback = trainer.checkpoint_callback
            directory = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(directory, f"{self.filename}.ckpt")

    # ------------------------------------------------------------------------------ signal
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag here: no I/O and no collective inside a signal handler.
        self._signalled = True

    def _install(self) -> None:
        # Signal handlers can only be set from the main thread (a Trainer run from another thread keeps Lightning's).
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _restore(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            previous = self._previous_handler
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        self._installed = False

    # ------------------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._signalled = False
        self.saved_path = None
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
        raise SIGTERMException(self.exit_code)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()
        if not isinstance(exception, SIGTERMException):
            if self._signalled:
                self._save_after_failure(trainer, exception)
            return
        if self.saved_path is None and trainer.global_step > 0:
            # Lightning raises it between two batches (every rank at the same one), after the batch's logging.
            self._save(trainer)
        if not exception.code:
            exception.code = self.exit_code  # Lightning raises it with no code: the process would exit 0

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    # ------------------------------------------------------------------------------ helpers
    def _any_rank_signalled(self, trainer: Trainer) -> bool:
        local = self._signalled or bool(trainer.received_sigterm)
        if trainer.world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=trainer.strategy.root_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _save_after_failure(self, trainer: Trainer, exception: BaseException) -> None:
        """A SIGTERM, then an error (the signal also stopped the engine): save if the state is a batch boundary."""
        consistent = trainer.global_step == self._boundary_step and trainer.global_step > 0
        if self.saved_path is not None or not consistent or trainer.world_size > 1:
            why = (
                "already saved" if self.saved_path is not None
                else "several ranks" if trainer.world_size > 1
                else "not at a batch boundary"
            )  # fmt: skip
            log.warning(
                "SIGTERM, then %s: %s; no preemption checkpoint written (%s). Resume from the last checkpoint.",
                type(exception).__name__, exception, why,
            )  # fmt: skip
            return
        log.warning(
            "SIGTERM, then %s (the signal reached the engine too): %s Saving the state of the last completed batch.",
            type(exception).__name__,
            str(exception).rstrip(".") + ".",
        )
        self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)  # every rank calls it (a collective under sharded strategies)
        self.saved_path = path
        if trainer.is_global_zero:
            log.warning(
                "SIGTERM: saved %s at step %d; exiting with status %d. Resume with --ckpt_path %s "
                "(Python: trainer.fit(..., ckpt_path=...)).",
                path,
                trainer.global_step,
                self.exit_code,
                path,
            )
