"""The cache of built demo checkpoints: each built once into a temporary sibling directory, a marker file
written last, renamed into place under a file lock (concurrent builders share one build; an interrupted
build is redone). :func:`~lightning_offpolicy.demo.tiny.prepare_tiny_checkpoint` and the chat
checkpoints (:mod:`~lightning_offpolicy.demo.tool_use`, :mod:`~lightning_offpolicy.demo.guess_number`)
build through it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_int

__all__ = ["CACHE_ENV", "MARKER_FILE", "cached_build", "chat_checkpoint_target", "default_cache_dir", "save_model"]

#: Environment variable naming the cache root (default ``~/.cache/lightning_offpolicy``).
CACHE_ENV = "LIGHTNING_OFFPOLICY_CACHE"
#: Written last into a finished checkpoint directory; holds the spec it was built from.
MARKER_FILE = "tiny_checkpoint.json"


def default_cache_dir() -> Path:
    """``$LIGHTNING_OFFPOLICY_CACHE`` or ``~/.cache/lightning_offpolicy``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lightning_offpolicy"


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_complete(directory: Path, spec: dict[str, Any]) -> bool:
    marker = _read_marker(directory)
    # The weights too: a build on a DDP rank other than 0 used to leave the marker without them.
    return marker is not None and marker.get("spec") == spec and _has_weights(directory)


def _has_weights(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def save_model(model: Any, directory: Path) -> None:
    """``model.save_pretrained(directory)`` on whichever process builds the cache.

    transformers writes a model only on rank 0 once ``torch.distributed`` is initialized; the cache is
    built by the first rank to take its lock, any rank.

    Raises:
        RuntimeError: The weights were not written.
    """
    model.should_save_on_this_rank = lambda is_main_process: True  # this instance only
    try:
        model.save_pretrained(directory)  # safetensors: the only format transformers 5 writes
    finally:
        del model.should_save_on_this_rank
    if not _has_weights(directory):
        raise RuntimeError(
            f"prepare_tiny_checkpoint: transformers wrote no config.json or *.safetensors to {directory}; build the "
            "tiny checkpoint in one process first (a run of the same `tiny:` model on one device builds it)."
        )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """Exclusive advisory lock (POSIX; released by the OS if the process dies). Yields whether it
    locked; elsewhere it is a no-op and the atomic rename alone keeps concurrent builds safe."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield False
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _install(tmp: Path, directory: Path, spec: dict[str, Any]) -> None:
    """Move the finished ``tmp`` to ``directory`` atomically; replace only an empty dir or a stale build."""
    try:
        os.rename(tmp, directory)
        return
    except OSError:
        if not directory.exists():
            raise
    if _is_complete(directory, spec):  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if any(directory.iterdir()) and _read_marker(directory) is None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(
            f"prepare_tiny_checkpoint: {directory} exists and is not a tiny checkpoint; refusing to overwrite it."
        )
    trash = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
    os.rename(directory, trash / directory.name)
    os.rename(tmp, directory)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads."""
    # A tiny model gains nothing from more, and on a busy machine a thread that waits for a core
    # slows every op down (docs/troubleshooting.md, OMP_NUM_THREADS).
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def chat_checkpoint_target(
    who: str,
    name: str,
    seed: int,
    directory: str | os.PathLike | None,
    defaults: dict[str, Any],
    settings: dict[str, Any],
) -> tuple[dict[str, Any], Path]:
    """The settings (``defaults`` overridden by ``settings``) and the directory of a cached chat checkpoint.

    The default directory is ``<cache>/{name}-seed{seed}``, with ``-{hash}`` of the settings appended when
    they differ from ``defaults``.

    Raises:
        ValueError: A setting is not one of ``defaults`` (named with ``who``), or ``seed`` is not an int.
    """
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        raise ValueError(f"{who}: unknown settings {unknown}; allowed: {', '.join(defaults)}.")
    if not is_int(seed):
        raise ValueError(f"{who}: `seed` must be an int, got {seed!r}.")
    chosen = {**defaults, **settings}
    if directory is not None:
        return chosen, Path(directory).expanduser().absolute()
    folder = f"{name}-seed{seed}"
    if chosen != defaults:
        folder += "-" + hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:10]
    return chosen, (default_cache_dir() / folder).absolute()


def cached_build(target: Path, spec: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Path:
    """``target`` built by ``build(directory)`` unless its marker file records ``spec``; returns ``target``.

    The build happens in a temporary sibling directory under one torch thread, the marker (``spec``,
    what ``build`` returned, the build's seconds) is written last and the directory is renamed into
    place under a file lock: an interrupted build is redone, and concurrent callers share one build
    and never see a partial one.
    """
    if _is_complete(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock") as locked:
        if _is_complete(target, spec):  # built by another process while we waited
            return target
        if locked:  # nobody else is building: temp dirs left by killed builds can go
            for stale in target.parent.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            start = time.perf_counter()
            with _torch_threads(1):
                built = build(tmp)
            marker = {"spec": spec, **built, "build_seconds": round(time.perf_counter() - start, 2)}
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")  # last
            _install(tmp, target, spec)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
