"""Checkpoints that a full disk cannot corrupt, and the newest checkpoint of a run for ``--ckpt_path last``.

Lightning's :class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO` serializes a checkpoint
into memory, then writes it through an fsspec transaction: to a file made by ``tempfile.mkstemp()`` in
the *system* temporary directory, moved onto the final name when the transaction commits. When that
directory is on another filesystem than the checkpoint (a tmpfs ``/tmp``, a container's overlay), the
move is a copy onto the final name: the previous checkpoint of that name is truncated first, and a
full disk during the copy leaves a truncated file under the final name. Nothing is fsync'ed either,
so a power loss can leave a file of zeros.

:class:`AtomicCheckpointIO` writes every checkpoint to a temporary name *in the checkpoint's own
directory*, flushes and fsyncs it, ``os.replace``-s it onto the final name (atomic on POSIX within a
filesystem) and fsyncs the directory. A failed write removes the temporary file and raises
:class:`CheckpointSaveError`, which names the error (``ENOSPC``), the path and the free space: the
previous checkpoint under that name is untouched. ``lightning-offpolicy fit`` installs it; a Python
``Trainer`` takes it as ``plugins=[AtomicCheckpointIO()]``. It covers every save that goes through the
strategy's ``CheckpointIO``: ``ModelCheckpoint``'s (``save_last: true`` writes ``last.ckpt`` as a copy,
so through it too), the preemption and on-exception saves of
:class:`~lightning_offpolicy.lightning.preemption.PreemptionCheckpoint`, ``trainer.save_checkpoint``. Not
covered: ``ModelCheckpoint(save_last="link")``'s symlink (Lightning removes, then re-creates it;
:class:`PeriodicCheckpoint` replaces it in one rename). A ``ModelParallelStrategy``'s distributed checkpoint
(a directory written by ``torch.distributed.checkpoint``, every rank its shard) bypasses the ``CheckpointIO``:
:func:`make_sharded_saves_atomic` (which :func:`install_atomic_checkpoint_io` calls) writes it to a hidden
staging directory and renames it onto the final name once every rank has written its shard.

:func:`find_last_checkpoint` is what ``--ckpt_path last`` resolves to in ``lightning-offpolicy fit``:
the newest ``last*.ckpt``, ``preempted.ckpt`` or ``on_exception.ckpt`` in the checkpoint directories of
every earlier version of the run (Lightning's own ``"last"`` looks only in the new run's version
directory, which is empty, and does not know the preemption checkpoint).
"""

from __future__ import annotations

import errno
import functools
import glob
import io
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_offpolicy.lightning.leftovers import remove_orphaned_temporaries, temporary_name

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointSaveError",
    "PeriodicCheckpoint",
    "atomic_write",
    "find_last_checkpoint",
    "install_atomic_checkpoint_io",
    "make_sharded_saves_atomic",
    "save_on_every_rank",
]

log = logging.getLogger(__name__)

# Written in pieces so that a failure reports how far it got, and a huge checkpoint is not one syscall.
_CHUNK_BYTES = 64 << 20


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the file under its final name (if any) is the previous one, unchanged.

    An :class:`OSError` with the ``errno`` of the failure (``errno.ENOSPC`` for a full disk), so code that
    catches ``OSError`` keeps working.

    Attributes:
        path: The checkpoint's final path.
        written: Bytes written to the temporary file before the failure.
        free: Free bytes on the checkpoint's filesystem after the failure (``None`` if unknown).
    """

    def __init__(self, path: str, cause: OSError, written: int, size: int) -> None:
        self.path = path
        self.written = written
        self.free = _free_bytes(os.path.dirname(path))
        code = cause.errno
        name = errno.errorcode.get(code, "unknown error") if code is not None else type(cause).__name__
        reason = cause.strerror or str(cause)
        free = "unknown" if self.free is None else _size(self.free)
        message = (
            f"Checkpoint not saved: {reason} ({name}) writing {path} after {_size(written)} of {_size(size)}; "
            f"{free} free on {os.path.dirname(path) or '.'}. The previous file under that name, if any, is "
            "unchanged and no partial file is left."
        )
        if code in (errno.ENOSPC, errno.EDQUOT):
            message += " Free disk space, or save elsewhere (ModelCheckpoint dirpath, --preemption.dirpath)."
        super().__init__(code, message)
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[1])


def atomic_write(data: bytes | memoryview, path: str, write: Callable[[int, memoryview], int] = os.write) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its previous content or all of ``data``.

    Args:
        data: The bytes to write.
        path: A local file path; its directory must exist.
        write: Writes a chunk to a file descriptor and returns the bytes written (``os.write``).

    Raises:
        CheckpointSaveError: The write, flush, fsync or rename failed (the temporary file is removed).
    """
    directory = os.path.dirname(os.path.abspath(path))
    # Same directory, hence same filesystem: os.replace is then a rename, never a copy. A dot name so
    # that globs for checkpoints (Lightning's "last*.ckpt" search included) never pick it up.
    temporary = temporary_name(path)
    view = memoryview(data).cast("B")
    written = 0
    try:
        # 0o666 through the umask, as an ordinary new file (mkstemp would make it 0600).
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            while written < len(view):
                written += write(fd, view[written : written + _CHUNK_BYTES])
            os.fsync(fd)  # the bytes are on disk before the name points at them
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as err:
        try:
            written = os.path.getsize(temporary)  # what reached the file, a failed write's part included
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise CheckpointSaveError(path, err, written, len(view)) from err
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    # The rename is durable only once the directory entry is: without this a power loss can bring back
    # the old name. Some filesystems refuse fsync on a directory; the file itself is already synced.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic: temporary name in the same directory, fsync, rename.

    Remote paths (``s3://``, ...) are written by Lightning's own transaction, unchanged.

    Example::

        trainer = L.Trainer(plugins=[AtomicCheckpointIO()], ...)
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Serialize ``checkpoint`` with ``torch.save`` and write it atomically to ``path``.

        Args:
            checkpoint: The state to save (Lightning's checkpoint dict).
            path: The checkpoint's final path.
            storage_options: Not supported (as in ``TorchCheckpointIO``).

        Raises:
            TypeError: ``storage_options`` was given.
            CheckpointSaveError: The write failed; the previous file at ``path`` is unchanged.
        """
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # In memory first (as Lightning does): an error while pickling then never reaches the disk.
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write(buffer.getbuffer(), path, write=self._write)
        log.debug("Saved checkpoint %s", path)

    def _write(self, fd: int, chunk: memoryview) -> int:
        """Write one chunk to ``fd`` (``os.write``); the one place where the bytes reach the filesystem."""
        return os.write(fd, chunk)


def install_atomic_checkpoint_io(trainer: Trainer) -> bool:
    """Give ``trainer`` an :class:`AtomicCheckpointIO` unless it was configured with another ``CheckpointIO``.

    Args:
        trainer: A Trainer before ``fit``.

    Returns:
        Whether the plugin was installed (``False``: the user's own ``CheckpointIO`` is kept).
    """
    strategy = trainer.strategy
    make_sharded_saves_atomic(strategy)
    current = strategy.checkpoint_io
    if type(current) is not TorchCheckpointIO:  # noqa: E721 (a subclass is the user's own choice)
        return isinstance(current, AtomicCheckpointIO)
    strategy.checkpoint_io = AtomicCheckpointIO()
    return True


def make_sharded_saves_atomic(strategy: Any) -> bool:
    """Make a ``ModelParallelStrategy``'s sharded (distributed) checkpoints replace the previous one atomically.

    Lightning writes a distributed checkpoint into the directory of its final name, over the previous one,
    shard file by shard file: a save that fails on any rank (a full disk) leaves that directory a mix of both
    saves. Here every rank writes into a hidden staging directory beside it; once every shard is written
    (and fsynced), rank 0 moves the previous directory aside, renames the staging directory onto the final
    name and removes the previous one. A failed save removes the staging directory and leaves the previous
    checkpoint whole. Single-file saves (``save_distributed_checkpoint=False``) go through the
    ``CheckpointIO`` (:class:`AtomicCheckpointIO`).

    Args:
        strategy: The Trainer's strategy; anything but a ``ModelParallelStrategy`` is left as it is.

    Returns:
        Whether its saves are atomic now.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy):
        return False
    if "save_checkpoint" not in vars(strategy):  # not twice
        strategy.save_checkpoint = functools.partial(_save_sharded_atomically, strategy, strategy.save_checkpoint)
    return True


def _save_sharded_atomically(
    strategy: Any, save: Callable[..., None], checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
) -> None:
    if not strategy._save_distributed_checkpoint or not _is_local_file_protocol(filepath):
        save(checkpoint, filepath, storage_options)
        return
    final = os.path.abspath(strategy.broadcast(os.fspath(filepath)))
    token = strategy.broadcast(uuid.uuid4().hex[:12])  # one staging directory for every rank
    staging = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{token}.tmp")
    try:
        save(checkpoint, staging, storage_options)  # a collective: an error on one rank is raised on every rank
        if strategy.global_rank == 0:
            _fsync_tree(staging)
        strategy.barrier("atomic sharded save")
        if strategy.global_rank == 0:
            _replace_directory(staging, final, token)
    except BaseException as err:
        if strategy.global_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException: per rank
        if not isinstance(failures, dict) or not failures:
            raise
        causes = {rank: cause[0] if isinstance(cause, tuple) else cause for rank, cause in failures.items()}
        code = next((c.errno for c in causes.values() if isinstance(c, OSError) and c.errno), None)
        named = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(causes.items()))
        raise OSError(
            code,
            f"Checkpoint not saved: writing the sharded checkpoint {final} failed ({named}). The previous checkpoint "
            "under that name is unchanged and no partial directory is left.",
        ) from err
    strategy.barrier("atomic sharded save")


def _fsync_tree(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_directory(root)


def _replace_directory(new: str, final: str, token: str) -> None:
    """Rename ``new`` onto ``final``; a previous ``final`` (directory or file) is moved aside, then removed."""
    previous = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{token}.old")
    had_previous = os.path.lexists(final)
    if had_previous:
        os.replace(final, previous)
    os.replace(new, final)
    _fsync_directory(os.path.dirname(final))
    if had_previous:
        if os.path.isdir(previous) and not os.path.islink(previous):
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.unlink(previous)


def restore_interrupted_replacements(directory: str) -> list[str]:
    """Finish what a crash between the two renames of an atomic sharded save left in ``directory``.

    :func:`_replace_directory` moves the previous checkpoint aside to ``.<name>.<token>.old`` before it renames
    the new one onto ``<name>``. A crash in between leaves no ``<name>``: the hidden previous checkpoint is whole,
    so it is renamed back. A crash after both renames leaves ``<name>`` and the hidden copy: the copy is removed.

    Args:
        directory: A checkpoint directory.

    Returns:
        The paths restored under their final name.
    """
    restored = []
    for entry in os.scandir(directory):
        name, _, token = entry.name[1 : -len(".old")].rpartition(".")
        if not (entry.name.startswith(".") and entry.name.endswith(".old") and name and token):
            continue
        final = os.path.join(directory, name)
        try:
            if os.path.lexists(final):
                shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
            else:
                os.replace(entry.path, final)
                _fsync_directory(directory)
                restored.append(final)
        except FileNotFoundError:  # another rank of the same run got there first
            continue
    return restored


def checkpoint_directories(trainer: Trainer, extra: Iterable[str | None] = ()) -> list[str]:
    """The directories where this run's earlier versions wrote checkpoints, as Lightning lays them out.

    A ``ModelCheckpoint`` without ``dirpath`` writes to ``<logger save_dir>/<name>/<version>/checkpoints``
    (a new version per run), or ``<default_root_dir>/checkpoints`` without a logger.

    Args:
        trainer: The Trainer of the new run, before ``fit``.
        extra: More directories to search (e.g. ``PreemptionCheckpoint.dirpath``); ``None`` entries are skipped.

    Returns:
        Existing directories, without duplicates.
    """
    candidates: list[str] = [d for d in extra if d]
    candidates += [cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir or trainer.default_root_dir
        root = os.path.join(save_dir, str(logger.name))  # as ModelCheckpoint resolves it: the first logger's
        candidates += sorted(glob.glob(os.path.join(glob.escape(root), "*", "checkpoints")))
    candidates.append(os.path.join(trainer.default_root_dir, "checkpoints"))
    seen: dict[str, None] = {}
    for directory in candidates:
        if os.path.isdir(directory):
            seen.setdefault(os.path.normpath(directory), None)
    return list(seen)


def find_last_checkpoint(
    trainer: Trainer,
    names: Iterable[str] = ("preempted", "on_exception"),
    extra_directories: Iterable[str | None] = (),
) -> str | None:
    """The newest checkpoint a run of this configuration wrote: what ``--ckpt_path last`` resumes from.

    Searches :func:`checkpoint_directories` for every ``*.ckpt`` (``last*.ckpt``, Lightning's ``epoch=N-step=M.ckpt``,
    the preemption and on-exception ``<name>.ckpt`` of ``names``) and picks the one written last (modification time).
    Temporary files are never candidates, and those of a writer that died are removed (:mod:`.leftovers`); a
    checkpoint an atomic sharded save moved aside when cut short is restored (:func:`restore_interrupted_replacements`).

    Args:
        trainer: The Trainer of the new run, before ``fit``.
        names: File names (without ``.ckpt``) of the kit's own checkpoints.
        extra_directories: More directories to search.

    Returns:
        The newest checkpoint's path, or ``None`` when there is none.
    """
    wanted = {f"{name}.ckpt" for name in names}
    found: list[tuple[int, str]] = []
    for directory in checkpoint_directories(trainer, extra_directories):
        restore_interrupted_replacements(directory)
        remove_orphaned_temporaries(directory)
        for entry in os.scandir(directory):
            # Not an atomic save's hidden temporary; a directory counts (a sharded strategy's checkpoint is one).
            is_checkpoint = entry.name.endswith(".ckpt") and not entry.name.startswith(".")
            if (is_checkpoint or entry.name in wanted) and (entry.is_file() or entry.is_dir()):
                found.append((entry.stat().st_mtime_ns, entry.path))
    return max(found)[1] if found else None


def save_on_every_rank(trainer: Trainer, save: Callable[[], None], path: str) -> OSError | None:
    """Run ``save`` (a ``trainer.save_checkpoint`` call) on every rank; a failed write, on any rank, is returned
    on every rank.

    Under DDP, ``trainer.save_checkpoint`` writes on rank 0 and then waits at a barrier on every rank: a rank 0
    whose write raises skips that barrier, and the other ranks would wait at it for good. Here the failing rank
    joins the barrier, and then every rank learns whether any rank failed.

    Args:
        trainer: The Trainer saving.
        save: The save, called once on each rank.
        path: The checkpoint's path, for the error of the ranks whose own save did not fail.

    Returns:
        The ``OSError`` of this rank's save, an ``OSError`` naming ``path`` when only another rank failed, or
        ``None`` when the checkpoint was saved.
    """
    error: OSError | None = None
    try:
        save()
    except OSError as err:
        error = err
        if trainer.world_size > 1:
            trainer.strategy.barrier("Trainer.save_checkpoint")  # where the other ranks wait
    if trainer.world_size > 1 and trainer.strategy.reduce_boolean_decision(error is not None, all=False):
        error = error or OSError(f"the checkpoint {path} could not be saved on another rank (see its log)")
    return error


def _free_bytes(directory: str) -> int | None:
    try:
        return shutil.disk_usage(directory or ".").free
    except OSError:
        return None


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


class PeriodicCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is also written at the end of training and replaced atomically.

    Takes ``ModelCheckpoint``'s arguments; the shipped configs use ``every_n_train_steps: N`` (optimizer steps
    under manual optimization), ``save_last: true`` and ``save_top_k: 0`` (only ``last.ckpt``: one write per
    save). Two differences from ``ModelCheckpoint``:

    * ``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` saves at multiples of ``N`` only: a run
      whose ``max_steps`` is not a multiple of ``N`` ends with a ``last.ckpt`` up to ``N - 1`` steps old.
      Here ``last.ckpt`` is saved when training ends, unless it already holds the final step.
    * ``save_last="link"``: Lightning removes ``last.ckpt`` and then creates the symlink, leaving a moment
      with no ``last.ckpt`` (what ``--ckpt_path last`` looks for); here the new link replaces the old one
      in one rename.
    """

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with warnings.catch_warnings():
            # Lightning warns that under manual optimization the checkpoint holds the weights after the
            # optimizer step: here that is the point, the state that global_step and policy_version describe.
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and trainer.global_step > 0 and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        error = save_on_every_rank(trainer, functools.partial(super()._save_checkpoint, trainer, filepath), filepath)
        if error is not None:
            raise error

    @staticmethod
    def _link_checkpoint(trainer: Trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                shutil.rmtree(linkpath)
            directory = os.path.dirname(os.path.abspath(linkpath))
            temporary = temporary_name(linkpath)
            try:
                os.symlink(os.path.relpath(filepath, directory), temporary)
                os.replace(temporary, linkpath)
            except OSError:
                if os.path.lexists(temporary):
                    os.unlink(temporary)
                # No symlinks here (Windows without the privilege): a copy, written atomically as well.
                with open(filepath, "rb") as source:
                    atomic_write(source.read(), linkpath)
            else:
                _fsync_directory(directory)
        trainer.strategy.barrier()
