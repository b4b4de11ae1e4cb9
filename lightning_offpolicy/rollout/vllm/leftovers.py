"""What a killed run left on this host: found when an engine or server starts, the kit's own cleared.

A training process killed with SIGKILL (or by the OOM killer) runs no clean-up, and before the
watchdog (:mod:`~lightning_offpolicy.rollout.vllm.watchdog`) its vLLM processes outlived it. What
can be left, and what :func:`sweep` does with it:

* **The kit's weight bucket** (``<shm>/lightning_offpolicy_weights_<host>-<pid>-<token>``, or in the
  temporary directory where ``/dev/shm`` is too small), left when the kill lands during a weight
  sync: its name says which process wrote it, so the bucket of a writer on this host that has
  ended is removed, in one log line with the bytes freed.
* **vLLM processes of a dead kit run** (their environment names a trainer, ``watchdog.TRAINER_ENV``,
  that has ended; the watchdog normally stops them within seconds, this catches a process it could
  not run in): stopped (SIGTERM, then SIGKILL), in one log line.
* **vLLM processes nobody can be sure of** (``VLLM::...``, re-parented to init, naming no trainer) and
  **shared-memory segments no process uses** (``/dev/shm/psm_*``: vLLM's message queues among them,
  ~400 MiB per killed engine): reported with the command that clears them, never removed here (a process
  outside the kit may own them); ``LocalVLLMServer.close`` removes those its own killed server left.

``python -m lightning_offpolicy.rollout.vllm.leftovers [--clear]`` prints the report (``--clear``: and
removes the unused segments).

Imports only the standard library (the watchdog imports it inside vLLM's processes). The kit's modules
import it where they use it, not at their top: ``python -m`` would otherwise find it imported by the
package before running it (a second copy, and a warning).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_offpolicy.rollout.vllm.watchdog import (
    PLUGIN_NAME,
    TRAINER_ENV,
    TrainerToken,
    plugin_registered,
    proc_stat,
    trainer_env,
)

__all__ = [
    "BUCKET_PREFIX",
    "EngineProcess",
    "Leftovers",
    "ShmFile",
    "bucket_prefix",
    "engine_processes",
    "looks_like_vllm",
    "mapped_segments",
    "prepare_start",
    "remove_buckets_of",
    "remove_dead_buckets",
    "remove_unused_segments",
    "sweep",
    "unused_segments",
]

log = logging.getLogger(__name__)

#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"
#: The start of the kit's weight-bucket names; :func:`bucket_prefix` adds the writer.
BUCKET_PREFIX = "lightning_offpolicy_weights_"
_BUCKET = re.compile(rf"^{BUCKET_PREFIX}(?P<host>.+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")
#: vLLM's API server module (its single server process carries no ``VLLM::`` title).
_SERVER = "vllm.entrypoints."
#: Python's multiprocessing shared-memory segments (vLLM's message queues are some of them).
_SEGMENT = re.compile(r"^psm_[0-9a-f]+$")
#: A segment younger than this is not reported: its creator may not have mapped it yet.
MIN_AGE_S = 60.0
#: Seconds an orphan gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 2.0
#: The command that clears what the report lists.
CLEAR_COMMAND = "python -m lightning_offpolicy.rollout.vllm.leftovers --clear"
_LISTED = 6  # names per kind in a log line; the rest are counted

_reported: set[str] = set()  # what this process already warned about (every engine start sweeps)
_warned_plugin = False


def bucket_prefix(pid: int | None = None) -> str:
    """The name prefix of a weight bucket written by process ``pid`` on this host (default: this process); host and
    pid say who may remove it."""
    return f"{BUCKET_PREFIX}{socket.gethostname()}-{os.getpid() if pid is None else pid}-"


def bucket_dirs() -> list[str]:
    """Where buckets are written: ``/dev/shm``, and the temporary directory (when ``/dev/shm`` is too small)."""
    dirs = [SHM_DIR, tempfile.gettempdir()]
    return [d for i, d in enumerate(dirs) if os.path.isdir(d) and d not in dirs[:i]]


class ShmFile(NamedTuple):
    """A file in shared memory (or in the temporary directory).

    Attributes:
        path: Where it is.
        size: Its apparent size in bytes (what its creator asked for).
        held: The bytes of memory (or disk) it holds: its allocated pages, which may be far fewer.
    """

    path: str
    size: int
    held: int

    @classmethod
    def of(cls, path: str) -> ShmFile:
        """The file at ``path`` (sizes 0 when it is gone)."""
        try:
            stat = os.stat(path)
        except OSError:
            return cls(path, 0, 0)
        return cls(path, stat.st_size, getattr(stat, "st_blocks", 0) * 512)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _names(items: list[str]) -> str:
    return ", ".join(items[:_LISTED]) + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def _remove_buckets(match: Callable[[int], bool], dirs: list[str] | None) -> list[ShmFile]:
    host = socket.gethostname()
    removed = []
    for directory in bucket_dirs() if dirs is None else dirs:
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                found = _BUCKET.match(entry.name)
                if found is None or found["host"] != host or not match(int(found["pid"])):
                    continue
                found_file = ShmFile.of(entry.path)
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(found_file)
    return removed


def remove_buckets_of(pid: int, dirs: list[str] | None = None) -> list[ShmFile]:
    """Remove the weight buckets that process ``pid`` of this host wrote (it has died).

    Args:
        pid: The writer, a trainer that has ended.
        dirs: Directories to look in (``None``: :func:`bucket_dirs`).

    Returns:
        Each bucket removed.
    """
    return _remove_buckets(lambda writer: writer == pid, dirs)


def remove_dead_buckets(dirs: list[str] | None = None) -> list[ShmFile]:
    """Remove the weight buckets whose writer, a process of this host, has ended.

    A bucket of a live process, or one written on another host (a temporary directory on a shared
    filesystem), is kept.

    Args:
        dirs: Directories to look in (``None``: :func:`bucket_dirs`).

    Returns:
        Each bucket removed.
    """
    return _remove_buckets(lambda writer: not TrainerToken(writer).alive(), dirs)


@dataclass
class EngineProcess:
    """A vLLM process found in ``/proc``.

    Attributes:
        pid: Its process id.
        ppid: Its parent's (1: re-parented to init, its parent is gone).
        title: Its command line (vLLM's title, e.g. ``VLLM::EngineCore``), cut to 100 characters.
        start: Its start time (``/proc/<pid>/stat``), to tell it from a later process with its pid.
        trainer: The trainer its environment names (``None``: none, or the environment is unreadable).
        leads_group: Whether it leads its process group (a server the kit started in its own session).
    """

    pid: int
    ppid: int
    title: str
    start: str
    trainer: TrainerToken | None = None
    leads_group: bool = False

    def __str__(self) -> str:
        owner = f", trainer pid {self.trainer.pid}" if self.trainer is not None else ""
        return f"pid {self.pid} {self.title} (parent {self.ppid}{owner})"


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def looks_like_vllm(cmdline: str) -> bool:
    """Whether a command line is a vLLM process: one vLLM titled (``VLLM::EngineCore``, ``VLLM::Worker_0``)
    or its server. Not the resource tracker, which unlinks the run's segments once the last of them exited,
    nor a program that merely has ``vllm`` in its name (a user's script, started with the trainer's environment).
    """
    return "VLLM::" in cmdline or _SERVER in cmdline


def engine_processes(proc: str = "/proc") -> list[EngineProcess]:
    """Every vLLM process of this host that ``/proc`` shows, this one excepted.

    Args:
        proc: The ``/proc`` directory.

    Returns:
        The processes, with the trainer each names where its environment is readable.
    """
    found = []
    me = os.getpid()
    with contextlib.suppress(OSError), os.scandir(proc) as entries:
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            pid = int(entry.name)
            raw = _read(f"{proc}/{pid}/cmdline")
            cmdline = (raw or b"").replace(b"\0", b" ").decode(errors="replace").strip()
            if not looks_like_vllm(cmdline):
                continue
            stat = proc_stat(pid)
            if stat is None or stat[0] in ("Z", "X", "x"):
                continue
            trainer = None
            for item in (_read(f"{proc}/{pid}/environ") or b"").split(b"\0"):
                if item.startswith(TRAINER_ENV.encode() + b"="):
                    trainer = TrainerToken.parse(item.split(b"=", 1)[1].decode(errors="replace"))
            try:
                leads = os.getpgid(pid) == pid
            except OSError:
                leads = False
            found.append(EngineProcess(pid, stat[1], cmdline[:100], stat[2], trainer, leads))
    return found


def _same_process(proc: EngineProcess) -> bool:
    stat = proc_stat(proc.pid)
    return stat is not None and stat[0] not in ("Z", "X", "x") and stat[2] == proc.start


def stop(procs: list[EngineProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each process (its process group if it leads one), SIGKILL what is left after ``grace_s``.

    A pid that now belongs to another process (its start time differs) is left alone.

    Args:
        procs: The processes to stop.
        grace_s: Seconds they get for their own shutdown.
    """

    def send(sig: signal.Signals) -> None:
        for proc in procs:
            if not _same_process(proc):
                continue
            with contextlib.suppress(OSError):
                if proc.leads_group:
                    os.killpg(proc.pid, sig)
                else:
                    os.kill(proc.pid, sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_same_process(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    send(signal.SIGKILL)


def _used_shm(proc: str = "/proc") -> set[str]:
    """The ``/dev/shm`` files some process maps or holds open (the processes this user may inspect)."""
    used: set[str] = set()
    marker = SHM_DIR + "/"
    with contextlib.suppress(OSError), os.scandir(proc) as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            used |= _mapped_shm(f"{proc}/{entry.name}")
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"{proc}/{entry.name}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"{proc}/{entry.name}/fd/{fd}")
                        if target.startswith(marker):
                            used.add(target)
    return used


def _mapped_shm(process_dir: str) -> set[str]:
    """The ``/dev/shm`` files the process of ``process_dir`` (``/proc/PID``) maps."""
    lines = (_read(f"{process_dir}/maps") or b"").decode(errors="replace").splitlines()
    return {line[line.find(SHM_DIR + "/") :].removesuffix(" (deleted)") for line in lines if SHM_DIR + "/" in line}


def mapped_segments(pids: list[int], proc: str = "/proc") -> set[str]:
    """The ``psm_*`` segments in ``/dev/shm`` that the processes ``pids`` map now."""
    mapped = set().union(*(_mapped_shm(f"{proc}/{pid}") for pid in pids))
    return {path for path in mapped if _SEGMENT.match(os.path.basename(path))}


def remove_unused_segments(paths: set[str]) -> list[ShmFile]:
    """Remove those of ``paths`` that exist and that no process maps or holds open (checked now); the removed.

    A killed vLLM process leaves its segments behind; whoever started it knows their names from when it
    ran (:func:`mapped_segments`), as ``LocalVLLMServer.close`` does.
    """
    present = {path for path in paths if os.path.exists(path)}
    removed = [ShmFile.of(path) for path in sorted(present - _used_shm())] if present else []
    for segment in removed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path)
    return removed


def unused_segments(shm_dir: str = SHM_DIR, min_age_s: float = MIN_AGE_S) -> list[ShmFile]:
    """``psm_*`` segments of this user in ``shm_dir`` that no process maps or holds open, older than ``min_age_s``.

    Args:
        shm_dir: The shared-memory directory.
        min_age_s: Younger segments are skipped (a process may be creating one right now).

    Returns:
        Each of them, oldest first.
    """
    now = time.time()
    candidates = []
    with contextlib.suppress(OSError), os.scandir(shm_dir) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                stat = entry.stat(follow_symlinks=False)
                if _SEGMENT.match(entry.name) and entry.is_file(follow_symlinks=False) and stat.st_uid == os.getuid():
                    if now - stat.st_mtime >= min_age_s:
                        candidates.append((stat.st_mtime, entry.path))
    if not candidates:
        return []
    used = _used_shm()
    return [ShmFile.of(path) for _, path in sorted(candidates) if path not in used]


@dataclass
class Leftovers:
    """What :func:`sweep` found.

    Attributes:
        removed_buckets: The kit's weight buckets of dead writers, removed.
        stopped: vLLM processes whose kit trainer had ended, stopped.
        strays: vLLM processes re-parented to init that name no trainer: reported only.
        unused_segments: ``psm_*`` segments no process uses: reported (removed by ``clear``).
    """

    removed_buckets: list[ShmFile] = field(default_factory=list)
    stopped: list[EngineProcess] = field(default_factory=list)
    strays: list[EngineProcess] = field(default_factory=list)
    unused_segments: list[ShmFile] = field(default_factory=list)


def sweep(clear: bool = False, shm_dir: str = SHM_DIR, report_all: bool = False) -> Leftovers:
    """Clear what dead kit runs of this host left, and report what earlier vLLM runs left besides.

    Removes the kit's weight buckets whose writer has ended and stops vLLM processes whose kit trainer
    has ended (one log line each); then warns once about ``psm_*`` segments no process uses and
    vLLM processes re-parented to init that name no trainer, with the command that clears them.

    Args:
        clear: Also remove the unused ``psm_*`` segments (what :data:`CLEAR_COMMAND` does).
        shm_dir: The shared-memory directory.
        report_all: Warn about everything found, not only what this process has not warned about yet.

    Returns:
        What was found and done.
    """
    found = Leftovers(removed_buckets=remove_dead_buckets())
    if found.removed_buckets:
        log.warning(
            "Removed %d weight bucket(s) that a killed training process left in shared memory: %s; %s freed.",
            len(found.removed_buckets),
            _names([f.path for f in found.removed_buckets]),
            _mib(sum(f.held for f in found.removed_buckets)),
        )
    ancestors = _ancestors()
    for proc in engine_processes():
        if proc.pid in ancestors:
            continue
        if proc.trainer is not None and proc.trainer.pid != proc.pid:
            if not proc.trainer.alive():
                found.stopped.append(proc)
        elif proc.trainer is None and proc.ppid == 1 and "VLLM::" in proc.title:
            found.strays.append(proc)
    if found.stopped:
        stop(found.stopped)
        log.warning(
            "Stopped %d vLLM process(es) whose training process had ended: %s.",
            len(found.stopped),
            "; ".join(map(str, found.stopped)),
        )
    found.unused_segments = unused_segments(shm_dir)
    if clear:
        found.unused_segments = remove_unused_segments({segment.path for segment in found.unused_segments})
    _report(found, clear, report_all)
    return found


def _ancestors() -> set[int]:
    """This process and its ancestors (a trainer started under a vLLM process is not that process's orphan)."""
    out, current = set(), os.getpid()
    while current > 1 and current not in out:
        out.add(current)
        stat = proc_stat(current)
        current = stat[1] if stat is not None else 0
    return out


def _report(found: Leftovers, cleared: bool, report_all: bool) -> None:
    segments = [f for f in found.unused_segments if report_all or f.path not in _reported]
    strays = [p for p in found.strays if report_all or f"pid:{p.pid}:{p.start}" not in _reported]
    _reported.update(f.path for f in segments)
    _reported.update(f"pid:{p.pid}:{p.start}" for p in strays)
    parts, commands = [], []
    if segments:
        size, held = sum(f.size for f in segments), sum(f.held for f in segments)
        state = "removed" if cleared else "that no process maps or holds open"
        parts.append(
            f"{len(segments)} shared-memory segment(s) {state} ({_mib(size)}, {_mib(held)} of it in memory): "
            f"{_names([f.path for f in segments])}"
        )
        if not cleared:
            commands.append(f"`{CLEAR_COMMAND}` removes the segments (it checks again that nothing uses them)")
    if strays:
        parts.append(
            f"{len(strays)} vLLM process(es) whose parent has ended and that name no training process of the kit "
            f"(started by hand, or by an older kit): {'; '.join(map(str, strays))}"
        )
        commands.append(f"`kill {' '.join(str(p.pid) for p in strays)}` stops the processes if they are not in use")
    if parts:
        tail = f" Most likely left by killed vLLM runs: {'; '.join(commands)}." if commands else ""
        log.warning("Found on this host: %s.%s", "; ".join(parts), tail)


def prepare_start(base: dict[str, str] | None = None) -> dict[str, str]:
    """What the kit does before it starts a vLLM engine or server: :func:`sweep`, and a warning when the
    watchdog plugin is not installed.

    The sweep never fails the start: an error in it is logged and passed over.

    Args:
        base: The environment the engine's processes start with (``None``: this process's).

    Returns:
        The environment variables to add to it (:func:`~lightning_offpolicy.rollout.vllm.watchdog.trainer_env`).
    """
    try:
        sweep()
    except Exception as err:  # noqa: BLE001 - a clean-up must not stop a run
        log.debug("the sweep for what killed runs left failed: %r", err)
    global _warned_plugin
    if not _warned_plugin and not plugin_registered():
        _warned_plugin = True
        log.warning(
            "The kit's vLLM plugin %r is not installed (an install older than it): vLLM processes will outlive a "
            "killed training process. Reinstall the kit (pip install -e . in a checkout).",
            PLUGIN_NAME,
        )
    return trainer_env(base)


def main(argv: list[str] | None = None) -> int:
    """Print what earlier runs left on this host; ``--clear`` also removes the unused segments.

    ``argv``: the command-line arguments (``None``: ``sys.argv``); returns the exit status, 0.
    """
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    parser.add_argument("--clear", action="store_true", help="remove the psm_* segments that no process uses")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    found = sweep(clear=args.clear, report_all=True)
    if not (found.removed_buckets or found.stopped or found.strays or found.unused_segments):
        print("Nothing left by earlier runs on this host.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
