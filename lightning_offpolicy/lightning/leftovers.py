"""The temporary files of atomic saves, and the ones a killed writer left behind.

An atomic save writes ``.<name>.<host>-<pid>-<token>.tmp`` beside its target and renames it onto the target
(:mod:`lightning_offpolicy.lightning.checkpointing`). A writer killed in between (SIGKILL, the OOM killer)
leaves that hidden file, as large as a checkpoint, for good. Its name says which process wrote it, so a later
run can tell a dead writer's file from one still being written, and remove it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import uuid

from lightning_offpolicy.rollout.vllm.watchdog import pid_alive

__all__ = ["remove_orphaned_temporaries", "temporary_name"]

log = logging.getLogger(__name__)

_TEMPORARY = re.compile(r"^\..+\.(?P<host>[^/]+)-(?P<pid>\d+)-[0-9a-f]{12}\.tmp$")


def temporary_name(path: str) -> str:
    """A hidden name beside ``path`` (same directory, hence same filesystem) that names its writer process."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def remove_orphaned_temporaries(directory: str) -> list[str]:
    """Remove the temporary files in ``directory`` whose writer, a process on this host, has ended.

    Files of writers on other hosts (a shared filesystem) and of live processes are left alone.

    Args:
        directory: A checkpoint directory.

    Returns:
        The paths removed.
    """
    removed = []
    host = socket.gethostname()
    for entry in os.scandir(directory):
        match = _TEMPORARY.match(entry.name)
        if match is None or match["host"] != host or pid_alive(int(match["pid"])) or not entry.is_file():
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
        log.warning("Removed %s: a save its writer (pid %s) did not finish.", entry.path, match["pid"])
    return removed
