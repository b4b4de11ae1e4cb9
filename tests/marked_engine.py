"""An HFEngine for tests of a real CLI fit that must know when a generation is under way.

Its ``generate`` prints ``MarkedHFEngine: rank R generation N started`` and, when it returns,
``MarkedHFEngine: rank R generation N ended <finish reasons>`` (the fit's log carries them), and from
generation ``slow_from`` on it takes ``step_delay_s`` per decoding step unless interrupted: a signal sent
once the start line is logged surely lands inside that generation.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from lightning_offpolicy.rollout import HFEngine
from lightning_offpolicy.rollout.engine import Completion, SamplingConfig


class _SlowInterrupt(threading.Event):
    """The engine's interrupt event: each check of it (one per decoding step) waits up to ``delay_s`` for it."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def is_set(self) -> bool:
        return self.wait(self.delay_s)


class MarkedHFEngine(HFEngine):
    """:class:`HFEngine` that logs each generation's start and end, slow from generation ``slow_from`` on.

    Args:
        slow_from: The first generation (1-based) that takes ``step_delay_s`` per decoding step.
        step_delay_s: Seconds per decoding step of the slow generations.
        **kwargs: :class:`HFEngine`'s.
    """

    def __init__(self, slow_from: int = 2, step_delay_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_from = slow_from
        self.step_delay_s = step_delay_s
        self.calls = 0

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        self.calls += 1
        rank = os.environ.get("LOCAL_RANK", "0")
        if self.calls == self.slow_from:
            interrupted = self._interrupt.is_set()
            self._interrupt = _SlowInterrupt(self.step_delay_s)
            if interrupted:
                self._interrupt.set()
        print(f"MarkedHFEngine: rank {rank} generation {self.calls} started", flush=True)
        completions = super().generate(prompt_ids, sampling, seed)
        reasons = sorted({c.finish_reason for c in completions})
        print(f"MarkedHFEngine: rank {rank} generation {self.calls} ended {reasons}", flush=True)
        return completions
