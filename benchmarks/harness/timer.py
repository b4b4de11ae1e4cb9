"""Wall and CPU time of each call of some methods, per phase name."""

from __future__ import annotations

import statistics
import time


class PhaseTimer:
    """Wraps methods to record the wall time and the calling thread's CPU time of each call, per phase.

    ``cpu / wall`` below 1 is time the thread was ready but did not run: waiting for the GIL or for a
    core (with two busy threads on two idle cores, the GIL).
    """

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self._taken: dict[str, int] = {}
        self._originals: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, method: str, phase: str) -> None:
        """Time every call of ``owner.method`` under ``phase`` from now on (until :meth:`unwrap`)."""
        original = getattr(owner, method)
        self._originals.append((owner, method, original))

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall.setdefault(phase, []).append(time.perf_counter() - wall)
                self.cpu.setdefault(phase, []).append(time.thread_time() - cpu)

        setattr(owner, method, timed)

    def unwrap(self) -> None:
        """Put every wrapped method back."""
        while self._originals:
            owner, method, original = self._originals.pop()
            setattr(owner, method, original)

    def mean(self, phase: str, skip: int) -> float:
        """Mean wall seconds per call of ``phase``, the first ``skip`` calls left out (0.0 without calls)."""
        values = self.wall.get(phase, [])[skip:]
        return statistics.mean(values) if values else 0.0

    def cpu_share(self, phase: str, skip: int) -> float:
        """CPU over wall time of ``phase``'s calls, the first ``skip`` left out (NaN without calls)."""
        wall, cpu = self.wall.get(phase, [])[skip:], self.cpu.get(phase, [])[skip:]
        return sum(cpu) / sum(wall) if wall and sum(wall) > 0 else float("nan")

    def take(self, phase: str) -> float:
        """Wall seconds of ``phase``'s calls since the last ``take`` of it."""
        values = self.wall.get(phase, [])
        since, self._taken[phase] = self._taken.get(phase, 0), len(values)
        return sum(values[since:])
