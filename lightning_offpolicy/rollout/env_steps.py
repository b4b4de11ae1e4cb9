"""The environment steps of many episodes at once: tool calls and environment replies run concurrently.

A turn of a batch of episodes ends with one environment step per episode still going (a tool call, a
game's answer). Run one after another, a 0.25 s tool makes a 64-episode turn take 16 s of waiting;
:class:`ConcurrentSteps` runs them side by side, at most ``max_concurrent`` at a time, each in a
worker thread (a blocking tool, a subprocess, an HTTP call), or on one event loop shared by the
runner when the environment's method is a coroutine function (``async def step``), as verifiers-
and SkyRL-style environments are. A step that hangs costs its own timeout (the tool's
``tool_timeout_s``), not the batch's: the others go on.

The caller gets every outcome back in its own order and applies them itself, in the calling thread,
so what a batch records does not depend on which step finished first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_offpolicy.rollout.partial import check_not_stopped

__all__ = ["ConcurrentSteps", "StepOutcome"]


@dataclass
class StepOutcome:
    """What one call returned, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None


class ConcurrentSteps:
    """Runs calls side by side, at most ``max_concurrent`` at once; awaits the coroutines they return.

    Args:
        max_concurrent: The most calls running at once (``1``: one after another, in the calling
            thread, as before concurrency).
    """

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = int(max_concurrent)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Each stops its pool / loop once: at close(), else when the object is collected or at exit.
        self._stoppers: list[weakref.finalize] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.max_concurrent)  # bounds the calls of one()

    def run(
        self, calls: Sequence[Callable[[], Any]], stop: Callable[[], bool] | None = None, what: str = "steps"
    ) -> list[StepOutcome]:
        """Each call's outcome, in the order of ``calls``; returns once every call has ended.

        A call not yet started when ``stop`` returns ``True`` is not started.

        Raises:
            RolloutStopped: ``stop`` returned ``True`` before the calls began or by the time they ended
                (``what`` names them): some may not have run.
        """
        check_not_stopped(stop, what)
        if self.max_concurrent == 1 or len(calls) <= 1:
            outcomes = [self._one(call, stop) for call in calls]
        else:
            pool = self._executor()
            futures = [pool.submit(self._one, call, stop) for call in calls]
            outcomes = [future.result() for future in futures]
        check_not_stopped(stop, what)
        return outcomes

    def one(self, call: Callable[[], Any], stop: Callable[[], bool] | None = None, what: str = "step") -> StepOutcome:
        """One call's outcome, run in the calling thread once fewer than ``max_concurrent`` calls of this
        method are running (episodes played independently, each in its own thread, share the bound).

        Raises:
            RolloutStopped: ``stop`` returned ``True`` before the call started (``what`` names it).
        """
        with self._slots:
            check_not_stopped(stop, what)
            return self._called(call)

    def _one(self, call: Callable[[], Any], stop: Callable[[], bool] | None) -> StepOutcome | None:
        if stop is not None and stop():
            return None  # not started: run() raises RolloutStopped
        return self._called(call)

    def _called(self, call: Callable[[], Any]) -> StepOutcome:
        try:
            value = call()
            if inspect.isawaitable(value):
                # The worker waits; the coroutine runs on the shared loop beside the others.
                value = asyncio.run_coroutine_threadsafe(_awaited(value), self._event_loop()).result()
            return StepOutcome(value=value)
        except Exception as error:  # the caller names the environment and re-raises
            return StepOutcome(error=error)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="env-step")
                self._stoppers.append(weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True))
            return self._pool

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_serve, args=(loop,), name="env-step-loop", daemon=True).start()
                self._stoppers.append(weakref.finalize(self, _stop_when_idle, loop))
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stop the worker threads and the event loop (idle ones; a call still running finishes alone)."""
        with self._lock:
            stoppers, self._stoppers, self._pool, self._loop = self._stoppers, [], None, None
        for stop in stoppers:
            stop()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's thread: runs it until stopped, then closes it (a loop left open holds its file descriptors)."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def _stop_when_idle(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop`` once the steps it is running have ended: stopped under them, they would never end and
    their worker threads would wait on them forever."""

    async def drain() -> None:
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        await asyncio.gather(*running, return_exceptions=True)
        loop.stop()

    coroutine = drain()
    try:
        asyncio.run_coroutine_threadsafe(coroutine, loop)
    except RuntimeError:  # already closed
        coroutine.close()
