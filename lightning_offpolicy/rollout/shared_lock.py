"""A lock that many holders share or one holds alone: sampling calls side by side, a weight sync alone.

An engine that serves several ``generate`` calls at once (a vLLM server batches them continuously)
must still never sample while its weights change: :class:`SharedLock` lets any number of calls hold
it :meth:`~SharedLock.shared`, and a sync take it exclusively (``with lock:``, ``acquire``,
``release``, as a ``threading.Lock``). A waiting exclusive holder goes first: no shared holder
starts while one waits, so a stream of sampling calls cannot starve a sync.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["SharedLock"]


class SharedLock:
    """Shared holders side by side, or one exclusive holder (which waits for the shared ones to leave)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock beside other shared holders, once no exclusive holder holds it or waits for it."""
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock alone, once every shared holder has left; ``threading.Lock.acquire``'s arguments."""
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._shared:
                    if not blocking:
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._exclusive = True
                return True
            finally:
                self._exclusive_waiting -= 1
                if not self._exclusive:  # gave up: shared holders it held back may start
                    self._cond.notify_all()

    def release(self) -> None:
        """Give back the lock taken alone."""
        with self._cond:
            if not self._exclusive:
                raise RuntimeError("SharedLock.release: the lock is not held alone.")
            self._exclusive = False
            self._cond.notify_all()

    def __enter__(self) -> SharedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
