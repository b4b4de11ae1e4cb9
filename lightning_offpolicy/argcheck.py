"""Type checks shared by the eager argument validation of every public class.

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds; a flag passed where a
count belongs (``samples_per_prompt=True``) is a mistake these checks refuse.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["is_int", "is_number", "is_real"]


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (int or float, Python or numpy), not a ``bool``; may be nan or inf."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number, not a ``bool``."""
    return is_real(value) and math.isfinite(value)
