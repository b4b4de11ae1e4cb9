"""Tools that tests name by import path (tests.tool_fixtures.<name>)."""

from __future__ import annotations

import asyncio


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


async def add_later(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: The first term.
        b: The second term.
    """
    await asyncio.sleep(0)
    return a + b
