"""Keep an engine's processes watched so nothing hangs.

``vllm.LLM`` runs its engine core and workers in child processes. vLLM 0.32 blocks
``LLM.generate`` (and utility calls such as ``collective_rpc``) forever when the engine-core
process dies mid-call, and a hung engine blocks its caller just the same. The pieces here make
every engine call fail loudly instead:

* :class:`WatchedCall` runs the call in a daemon thread while the caller polls the engine's
  liveness and a deadline; :class:`EngineGone` says why the call was abandoned.
* :func:`unblock` wakes a thread still blocked inside vLLM once the engine is given up.
* :func:`descendants` / :func:`new_engine_procs` find the processes an engine start created,
  :func:`is_alive` / :func:`dead_reason` watch them, :func:`shutdown` and :func:`reap` stop them
  (a worker whose engine core was killed is otherwise left running).

Nothing here imports vLLM: it works on the ``vllm.LLM`` object it is handed, through
``getattr`` with defaults, so a changed vLLM layout degrades to process watching only.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = [
    "POLL_S",
    "EngineGone",
    "WatchedCall",
    "dead_reason",
    "descendants",
    "environ",
    "is_alive",
    "new_engine_procs",
    "reap",
    "shutdown",
    "unblock",
]

_T = TypeVar("_T")

#: Seconds between two liveness checks while an engine call runs.
POLL_S = 0.1


class EngineGone(Exception):
    """The engine died, hung or was closed during a watched call (the message says which)."""


class WatchedCall(Generic[_T]):
    """One engine call run in a daemon thread, waited for with liveness checks and a deadline.

    The call runs in its own thread because a call into a dead vLLM engine never returns: the
    waiting thread must stay free to notice the death and give up.

    Args:
        fn: The engine call.
        name: The thread's name (shows in stack dumps of a hung process).
    """

    def __init__(self, fn: Callable[[], _T], name: str) -> None:
        self._fn = fn
        self._result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._target, name=name, daemon=True)

    def _target(self) -> None:
        try:
            self._result["value"] = self._fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the waiting thread
            self._result["error"] = err

    @property
    def running(self) -> bool:
        """Whether the call is still in flight."""
        return self.thread.is_alive()

    def run(self, what: str, timeout_s: float, why_dead: Callable[[], str | None]) -> _T:
        """Start the call and wait for it; return its value or re-raise its exception.

        Args:
            what: The call's name in messages (e.g. ``"generate"``).
            timeout_s: Longest the call may take.
            why_dead: Returns why the engine is unusable (``None``: it is fine); polled every
                :data:`POLL_S` seconds while the call runs and again if it raised.

        Raises:
            EngineGone: The engine died or the call exceeded ``timeout_s`` (the call's own
                exception, if any, is the ``__cause__``). The call may still be running: the caller
                shuts the engine down, which wakes it.
        """
        deadline = time.monotonic() + timeout_s
        self.thread.start()
        while self.thread.is_alive():
            self.thread.join(POLL_S)
            if not self.thread.is_alive():
                break
            reason = why_dead()
            if reason is None and time.monotonic() > deadline:
                reason = (
                    f"{what} did not finish within request_timeout_s={timeout_s:g} s "
                    "(raise it if the work is legitimately that long)"
                )
            if reason is not None:
                raise EngineGone(reason)
        if "error" in self._result:
            error = self._result["error"]
            reason = why_dead()
            # vLLM raises its own EngineDeadError when the core died between two polls.
            if reason is None and type(error).__name__ == "EngineDeadError":
                reason = "the vLLM engine died"
            if reason is not None:
                raise EngineGone(reason) from error
            raise error
        return self._result["value"]


def engine_core(llm: Any) -> Any:
    """The engine-core client of a ``vllm.LLM`` (``None`` if there is none or the layout differs)."""
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def dead_reason(llm: Any, procs: list[Any]) -> str | None:
    """Why the engine of ``llm`` with processes ``procs`` is dead (``None``: it looks alive)."""
    if getattr(getattr(engine_core(llm), "resources", None), "engine_dead", False):
        return "the vLLM engine core reported itself dead"
    for p in procs:
        if not is_alive(p):
            return f"the engine process {getattr(p, 'vllm_name', '?')} (pid {p.pid}) exited"
    return None


def unblock(llm: Any, reason: str) -> None:
    """Wake a thread blocked on the engine's output queue or on a utility call (best effort).

    Needed because vLLM's client waits on these without a timeout: a dead engine core never
    answers, so the waiting thread would outlive the engine.
    """
    core = engine_core(llm)
    dead = RuntimeError(reason)
    queue = getattr(core, "outputs_queue", None)
    if queue is not None:
        with contextlib.suppress(Exception):
            queue.put_nowait(dead)
    for future in list(getattr(core, "utility_results", {}).values()):
        with contextlib.suppress(Exception):
            future.set_exception(dead)


def shutdown(llm: Any, procs: list[Any], graceful: bool = True) -> None:
    """Stop an engine: signal its processes (SIGTERM, or SIGKILL when not graceful), then reap them.

    The workers are signalled together with the engine core and get one second to exit before
    they are killed: vLLM's own shutdown waits for its workers to notice the core's exit (seconds)
    for processes that hold no state worth saving.
    """
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate() if graceful else p.kill()
    if llm is not None:
        core = engine_core(llm)
        with contextlib.suppress(Exception):
            if core is not None:
                core.shutdown(timeout=1.0 if graceful else 0.0)
        del core
    reap(procs, timeout=2.0)


def reap(procs: list[Any], timeout: float = 2.0) -> None:
    """Wait for the processes to exit (terminate, then kill the stragglers) and reap them.

    A zombie counts as exited (a worker whose engine core died is re-parented: not ours to reap).
    """
    if not procs:
        return
    import psutil

    def wait(deadline: float) -> list[Any]:
        alive = [p for p in procs if is_alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if is_alive(p)]
        return alive

    for p in [p for p in procs if is_alive(p)]:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    for p in wait(time.monotonic() + timeout / 2):
        with contextlib.suppress(psutil.Error):
            p.kill()
    wait(time.monotonic() + timeout / 2)
    for p in procs:  # reap the zombies of our own children
        with contextlib.suppress(Exception):
            p.wait(timeout=0)


def descendants() -> set[int]:
    """Process ids of every descendant of this process (taken before an engine start)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a vLLM dependency
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def new_engine_procs(before: set[int]) -> list[Any]:
    """The processes started since ``before`` (the multiprocessing helpers excluded).

    Each gets a ``vllm_name`` attribute (e.g. ``"VLLM::EngineCore"``), read while it is alive so
    that messages about its death can still name it.
    """
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    procs = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in before:
            continue
        try:
            cmdline = " ".join(p.cmdline())
            name = p.name()
        except psutil.Error:
            continue
        # Shared by every user of multiprocessing in this process: not the engine's to stop.
        if "resource_tracker" in cmdline or "forkserver" in cmdline:
            continue
        p.vllm_name = name
        procs.append(p)
    return procs


def is_alive(proc: Any) -> bool:
    """Whether a ``psutil.Process`` runs (a zombie does not)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for an engine start (its processes inherit them), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
