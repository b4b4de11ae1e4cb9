"""The base classes of the metrics: a ratio of two running float64 sums, and a running extreme.

Every state is a sum, max or min reduced across ranks (``dist_reduce_fx``), never a mean of
means: two ranks on half batches report exactly what one rank reports on the whole batch.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torchmetrics import Metric

from lightning_offpolicy.correction.correction import CorrectionStats
from lightning_offpolicy.metrics.sums import F64, extreme_value


class FromSums:
    """``update`` of a metric whose batch contribution is :meth:`sums` of its stats, added by ``_accumulate``."""

    def update(self, stats: Any = None, sums: tuple[torch.Tensor, ...] | None = None) -> None:
        """Add one batch: from its ``stats`` (or ``info``), or from ``sums``, this metric's
        :meth:`sums` of a batch computed elsewhere (the fused step of
        :mod:`~lightning_offpolicy.correction.fused` computes them inside its compiled graph)."""
        self._accumulate(*(sums if sums is not None else self.sums(stats)))

    def sums(self, stats: Any) -> tuple[torch.Tensor, ...]:
        """The sums one update with ``stats`` adds."""
        raise NotImplementedError

    def _accumulate(self, *sums: torch.Tensor) -> None:
        raise NotImplementedError


class RatioOfSums(FromSums, Metric):
    """``numerator / denominator`` of running float64 sums (0 when nothing was accumulated)."""

    full_state_update = False
    higher_is_better = None
    is_differentiable = False
    empty_value = 0.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("numerator", default=torch.tensor(0.0, dtype=F64), dist_reduce_fx="sum")
        self.add_state("denominator", default=torch.tensor(0.0, dtype=F64), dist_reduce_fx="sum")

    def _accumulate(self, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
        self.numerator += numerator.to(self.numerator.device, F64)
        self.denominator += denominator.to(self.denominator.device, F64)

    def compute(self) -> torch.Tensor:
        if self.denominator <= 0:
            return torch.tensor(self.empty_value, dtype=F64, device=self.denominator.device)
        return self.numerator / self.denominator


class Extreme(FromSums, Metric):
    """Running max or min (``dist_reduce_fx`` max / min) with a neutral value when empty."""

    full_state_update = False
    higher_is_better = None
    is_differentiable = False
    reduce: Literal["max", "min"] = "max"
    empty_value = 0.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        start = float("-inf") if self.reduce == "max" else float("inf")
        self.add_state("value", default=torch.tensor(start, dtype=F64), dist_reduce_fx=self.reduce)

    def _values(self, stats: CorrectionStats) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidate values and where they count."""
        raise NotImplementedError

    def _accumulate(self, extreme: torch.Tensor) -> None:
        combine = torch.maximum if self.reduce == "max" else torch.minimum
        self.value = combine(self.value, extreme.to(self.value.device, F64))

    def sums(self, stats: CorrectionStats) -> tuple[torch.Tensor, ...]:
        """``(extreme,)`` of this batch."""
        return (extreme_value(*self._values(stats), self.reduce),)

    def compute(self) -> torch.Tensor:
        if torch.isinf(self.value):
            return torch.tensor(self.empty_value, dtype=F64, device=self.value.device)
        return self.value
