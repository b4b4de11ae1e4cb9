"""What every peer's translation shares: its result, its warning and error, and the number checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class PeerNameWarning(UserWarning):
    """A peer's setting name was accepted and mapped to the kit's (the message names both)."""


class PeerNameError(ValueError):
    """A peer's setting whose meaning differs from the kit's; the message says how to express it."""


@dataclass
class Translation:
    """The kit's fields for a set of peer fields, and one message per peer key."""

    settings: dict[str, Any] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


def positive(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PeerNameError(f"{what}={value!r} is not a number.") from None
    if not math.isfinite(number) or number <= 0:
        raise PeerNameError(f"{what}={value!r} must be a positive finite number.")
    return number


def non_negative(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PeerNameError(f"{what}={value!r} is not a number.") from None
    if not math.isfinite(number) or number < 0:
        raise PeerNameError(f"{what}={value!r} must be a finite number >= 0.")
    return number
