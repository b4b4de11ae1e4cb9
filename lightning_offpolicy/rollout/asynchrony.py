"""How far generation may run ahead of training: the staleness bound, weight pushes, partial rollouts.

The admission rule and the partial rollouts are explained in docs/async.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_offpolicy.argcheck import is_int

__all__ = ["AsyncSettings"]


@dataclass(frozen=True)
class AsyncSettings:
    """Background generation with bounded staleness (docs/async.md; off by default: synchronous rollouts).

    Args:
        max_staleness: Most policy versions between the weights that generate a token and the step
            that trains it; 0: synchronous, ``k > 0``: a background thread generates ahead.
        sync_every: Push the weights every this many optimizer steps (``<= max_staleness + 1``).
        partial_rollouts: A weight push interrupts the request in flight; its completions continue
            under the new weights (needs ``max_staleness >= 1``).

    Raises:
        ValueError: A setting is out of range; the message names it and what to change.
    """

    max_staleness: int = 0
    sync_every: int = 1
    partial_rollouts: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.max_staleness) or self.max_staleness < 0:
            raise ValueError(
                f"AsyncSettings.max_staleness={self.max_staleness!r} must be an int >= 0 (0: synchronous rollouts)."
            )
        if not is_int(self.sync_every) or self.sync_every < 1:
            raise ValueError(f"AsyncSettings.sync_every={self.sync_every!r} must be an int >= 1.")
        if self.max_staleness < self.sync_every - 1:
            raise ValueError(
                f"AsyncSettings.sync_every={self.sync_every} needs max_staleness >= sync_every - 1 = "
                f"{self.sync_every - 1} (got max_staleness={self.max_staleness}): between two pushes the engine "
                "falls up to sync_every - 1 versions behind, so no batch could be admitted. Raise max_staleness "
                "or lower sync_every."
            )
        if not isinstance(self.partial_rollouts, bool):
            raise ValueError(f"AsyncSettings.partial_rollouts={self.partial_rollouts!r} must be True or False.")
        if self.partial_rollouts and self.max_staleness < 1:
            raise ValueError(
                "AsyncSettings.partial_rollouts=True needs max_staleness >= 1: synchronous rollouts never push "
                "weights while a request is in flight, so there is nothing to interrupt."
            )

    @property
    def background(self) -> bool:
        """Whether a background thread generates (``max_staleness > 0``)."""
        return self.max_staleness > 0

    def check_engine(self, engine: Any) -> None:
        """Check that ``engine`` (``None``: the default ``HFEngine``) supports these settings.

        Raises:
            ValueError: Background generation with an engine that shares the trainer's weights, or
                partial rollouts with an engine that cannot be interrupted.
        """
        if self.background and (engine is None or getattr(engine, "share_weights", False)):
            raise ValueError(
                f"RolloutCallback(asynchrony.max_staleness={self.max_staleness}) generates in the background "
                "while the trainer updates the weights, so the engine needs its own copy of them: use "
                "HFProcessEngine (generation in its own process, the fastest on a CPU with a core to spare), "
                "VLLMEngine, or HFEngine(dtype='float32' / 'bfloat16') instead of an HFEngine that shares the "
                "module's weights."
            )
        if self.partial_rollouts and not callable(getattr(engine, "interrupt", None)):
            raise ValueError(
                "RolloutCallback.asynchrony.partial_rollouts=True needs an engine that can be interrupted (an "
                f"`interrupt()` method); {type(engine).__name__} has none. Use HFProcessEngine, HFEngine(dtype=...), "
                "VLLMEngine or RemoteVLLMEngine, or set asynchrony.partial_rollouts=False."
            )
