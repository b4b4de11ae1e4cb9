"""vLLM processes the kit starts die with the trainer process that started them, however it dies.

``vllm.LLM`` runs its engine core in a child process of the trainer, and the engine core its workers;
``vllm serve`` (:func:`~lightning_offpolicy.rollout.vllm.server.launch_local_server`) adds an API
server above them. Nothing in vLLM 0.32 watches the trainer: after a SIGKILL or an OOM kill of the
trainer the engine core and its workers run on, holding their memory and their shared-memory
segments, until someone kills them by hand.

The kit therefore starts every engine and server with :data:`TRAINER_ENV` naming the trainer
(:func:`trainer_env`: its pid and start time, inherited by every process vLLM spawns), and ships a
vLLM *general plugin* (:func:`arm`, the entry point ``lightning_offpolicy_watchdog`` of the group
``vllm.general_plugins``), which vLLM loads in its API server, engine-core and worker processes.
In a process whose environment names a trainer it starts a daemon thread that polls the trainer
every :data:`POLL_S` seconds; once the trainer is gone the thread removes the trainer's weight
bucket if one is left and SIGKILLs its own process (vLLM's shared-memory segments are then unlinked
by the multiprocessing resource tracker, which exits once the last process of the run has). A
process that leads its own process group (a server the kit started in a session of its own) first
SIGTERMs its whole group.

Why a polling thread and not ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the *thread*
that forked the child exits, not the process, and the kit starts engines from background threads
(asynchronous rollouts); and it only reaches direct children, not the workers below the engine core.

What the plugin never does: anything in a process without :data:`TRAINER_ENV` (a server started by
hand), in the trainer itself, or in a process that does not descend from the trainer it names (a
program detached from it); a trainer still alive is never mistaken for a dead one (a pid reused by
another process does not match the start time). The variable is set in the trainer's environment
only while ``vllm.LLM`` starts (vLLM spawns its engine core from that environment); a process that
another thread of the trainer starts in that window inherits it, and acts on it only if it is a
vLLM process itself, which descends from the trainer and then goes with it too.

Imports only the standard library: vLLM loads the plugin in every one of its processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

__all__ = [
    "PLUGIN_NAME",
    "POLL_S",
    "TRAINER_ENV",
    "TrainerToken",
    "arm",
    "pid_alive",
    "plugin_registered",
    "proc_stat",
    "trainer_env",
]

log = logging.getLogger(__name__)

#: The environment variable naming the trainer process: ``"<pid>:<start time>"`` (clock ticks since
#: boot, field 22 of ``/proc/<pid>/stat``; empty where there is no ``/proc``).
TRAINER_ENV = "LIGHTNING_OFFPOLICY_TRAINER"
#: The entry point's name in ``vllm.general_plugins`` (what ``VLLM_PLUGINS`` must list when it is set).
PLUGIN_NAME = "lightning_offpolicy_watchdog"
#: Seconds between two looks at the trainer.
POLL_S = 0.2

_armed: threading.Thread | None = None


@dataclass(frozen=True)
class TrainerToken:
    """A process named so that a reused pid does not pass for it.

    Attributes:
        pid: Its process id.
        start: Its start time as ``/proc/<pid>/stat`` gives it (``""``: unknown, the pid alone counts).
    """

    pid: int
    start: str = ""

    @classmethod
    def of(cls, pid: int) -> TrainerToken:
        """The token of the running process ``pid`` (its start time read now).

        Raises:
            ProcessLookupError: No process ``pid`` runs.
        """
        stat = proc_stat(pid)
        if stat is None:
            if os.path.isdir("/proc"):
                raise ProcessLookupError(pid)
            return cls(pid)
        return cls(pid, stat[2])

    @classmethod
    def parse(cls, value: str | None) -> TrainerToken | None:
        """The token :meth:`__str__` wrote (``None``: no value, or one that is not a token)."""
        pid, sep, start = (value or "").partition(":")
        if not pid.isdigit() or not sep or (start and not start.isdigit()) or int(pid) <= 1:
            return None
        return cls(int(pid), start)

    def __str__(self) -> str:
        return f"{self.pid}:{self.start}"

    def alive(self) -> bool:
        """Whether the process still runs (a zombie, or another process under the same pid, does not)."""
        stat = proc_stat(self.pid)
        if stat is None:
            if os.path.isdir("/proc"):
                return False
            return pid_alive(self.pid)
        state, _, start = stat
        # An unreadable start time (another user's process) cannot disprove that it is the trainer.
        return state not in ("Z", "X", "x") and (not self.start or not start or start == self.start)


def proc_stat(pid: int) -> tuple[str, int, str] | None:
    """``(state, parent pid, start time)`` of ``pid`` from ``/proc/<pid>/stat``.

    Args:
        pid: The process.

    Returns:
        ``None`` where there is no such process (or no ``/proc``). A process whose ``stat`` cannot be
        read for lack of permission comes back as running with an unknown start time (``""``): the
        watchdog must never take a live trainer for a dead one.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except PermissionError:
        return ("S", 0, "")
    # The command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
    fields = data[data.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    return fields[0], int(fields[1]), fields[19]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie does; another user's process does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _descends_from(pid: int) -> bool:
    """Whether this process is a descendant of ``pid`` (``True`` where ``/proc`` cannot tell)."""
    current = os.getpid()
    for _ in range(128):  # a cycle cannot happen; a bound costs nothing
        stat = proc_stat(current)
        if stat is None:
            return not os.path.isdir("/proc")
        parent = stat[1]
        if parent == pid:
            return True
        if parent <= 1:
            return False
        current = parent
    return False


def trainer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables to start an engine or server with, so that it dies with this process.

    Args:
        base: The environment the processes are started with (``None``: this process's).

    Returns:
        :data:`TRAINER_ENV` naming this process, and, when ``VLLM_PLUGINS`` (vLLM's allow-list of
        plugins) is set without the kit's, ``VLLM_PLUGINS`` with :data:`PLUGIN_NAME` added.
    """
    base = os.environ if base is None else base
    env = {TRAINER_ENV: str(TrainerToken.of(os.getpid()))}
    allowed = base.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        env["VLLM_PLUGINS"] = f"{allowed},{PLUGIN_NAME}" if allowed else PLUGIN_NAME
    return env


def plugin_registered() -> bool:
    """Whether the installed kit registers :func:`arm` with vLLM (an install that predates it does not)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group="vllm.general_plugins"))


def arm() -> threading.Thread | None:
    """vLLM's general-plugin entry: watch the trainer :data:`TRAINER_ENV` names, if it names one.

    Called by vLLM in each of its processes (more than once is harmless). Returns the watchdog
    thread, or ``None`` where nothing is watched: no or malformed :data:`TRAINER_ENV`, this process
    is the trainer, or it does not descend from the trainer (the variable leaked into it).
    """
    global _armed
    if _armed is not None:
        return _armed
    raw = os.environ.get(TRAINER_ENV)
    token = TrainerToken.parse(raw)
    if token is None:
        if raw:
            log.warning("%s=%r is not '<pid>:<start>': this vLLM process does not watch its trainer.", TRAINER_ENV, raw)
        return None
    if token.pid == os.getpid():
        return None
    # A trainer already dead has orphaned this process (it was killed during the engine start): the
    # descent can no longer be checked, and the process must go all the same.
    if token.alive() and not _descends_from(token.pid):
        return None
    _armed = threading.Thread(target=_watch, args=(token,), name="lightning-offpolicy-watchdog", daemon=True)
    _armed.start()
    return _armed


def _watch(token: TrainerToken) -> None:
    while token.alive():
        time.sleep(POLL_S)
    _leave(token)


def _leave(token: TrainerToken) -> None:
    """Stop this process and its descendants at once, its trainer ``token`` being gone."""
    pid = os.getpid()
    leads_group = os.getpgid(0) == pid
    log.warning(
        "lightning_offpolicy: the trainer process %d that started this vLLM process (pid %d) is gone: stopping it.",
        token.pid,
        pid,
    )
    # The dead trainer's weight bucket, if it died mid-sync: this process may be the only one left that knows.
    with contextlib.suppress(Exception):
        from lightning_offpolicy.rollout.vllm.leftovers import remove_buckets_of

        remove_buckets_of(token.pid)
    if leads_group:
        # A server the kit started in a session of its own: SIGTERM reaches a process of it that is no longer
        # a descendant; the resource tracker ignores it (it must live on to unlink the run's segments).
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)
    # SIGKILL, not SIGTERM and a grace period: vLLM's graceful shutdown waits for its workers and then for
    # the interpreter to finalize, and a daemon thread is frozen once finalization starts, so this one could
    # not follow up on a shutdown that hangs (measured: 3.5 s for a CPU engine). The descendants go first
    # (a worker busy in a kernel that holds the GIL polls late); the segments the processes created are
    # unlinked by the resource tracker once the last process of the run has exited.
    for child in _descendants(pid):
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The descendants of ``pid`` (from ``/proc``; empty without it), the multiprocessing resource tracker left out."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError), os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                stat = proc_stat(int(entry.name))
                if stat is not None:
                    children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as handle:
                tracker = b"resource_tracker" in handle.read()
        except OSError:
            continue
        if not tracker:
            found.append(child)
            todo.extend(children.get(child, []))
    return found
