"""Suite-wide set-up: tiny checkpoints are built once per test session into a private cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def tiny_checkpoint_cache(tmp_path_factory):
    """Point ``tiny:<task>`` checkpoints at one cache for the session (never the user's home)."""
    if "LIGHTNING_OFFPOLICY_CACHE" in os.environ:
        yield os.environ["LIGHTNING_OFFPOLICY_CACHE"]
        return
    path = str(tmp_path_factory.mktemp("tiny_cache"))
    os.environ["LIGHTNING_OFFPOLICY_CACHE"] = path
    yield path
    os.environ.pop("LIGHTNING_OFFPOLICY_CACHE", None)
