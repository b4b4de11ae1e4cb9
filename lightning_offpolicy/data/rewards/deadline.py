"""Time limits that work on any thread: an exception raised into a thread when its deadline passes.

``signal.alarm`` (math-verify's own timeout) only works on the main thread. Here a timer thread
asks the interpreter to raise an exception in the thread that runs the guarded code
(``PyThreadState_SetAsyncExc``). The exception arrives between two Python bytecodes, exactly
where a ``SIGALRM`` handler would run on the main thread: pure-Python work (sympy, a Python loop,
a retry loop) is cut short, while a single long call into C that holds the GIL (a catastrophic
regular expression, a huge integer power) is not, by either mechanism.
"""

from __future__ import annotations

import ctypes
import threading
from types import TracebackType

__all__ = ["Deadline", "raise_in_thread"]


def raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> bool:
    """Raise ``exc_type`` in the thread ``thread_id`` at its next bytecode; ``None`` cancels a pending one.

    Returns whether the thread exists (and so got the request).
    """
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    changed = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)
    if changed > 1:  # cannot happen with a valid id; undo, as the C API documents
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
        return False
    return changed == 1


class Deadline:
    """Raise ``exc_type`` in the current thread when the ``with`` block runs longer than ``seconds``.

    ``seconds=None``: no limit. After the block, :attr:`expired` says whether the deadline passed
    (the exception was then delivered inside the block, or cancelled when the block had ended
    first). Catch ``exc_type`` around the ``with`` statement: it may also arrive while the block is
    being left.

    >>> import time
    >>> class TooSlow(BaseException): ...
    >>> try:
    ...     with Deadline(0.05, TooSlow):
    ...         while True:
    ...             time.sleep(0.001)
    ... except TooSlow:
    ...     print("cut short")
    cut short
    """

    def __init__(self, seconds: float | None, exc_type: type[BaseException]) -> None:
        self.seconds = seconds
        self.exc_type = exc_type
        self.expired = False
        self._lock = threading.Lock()
        self._done = False
        self._thread_id = 0
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Deadline:
        if self.seconds is None:
            return self
        self._thread_id = threading.get_ident()
        self._timer = threading.Timer(self.seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _expire(self) -> None:
        with self._lock:
            if not self._done:
                self.expired = raise_in_thread(self._thread_id, self.exc_type)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is None:
            return
        self._timer.cancel()
        with self._lock:
            self._done = True
            if self.expired:  # requested but perhaps not delivered yet: the block is over, drop it
                raise_in_thread(self._thread_id, None)
