"""Suite-wide set-up: tiny checkpoints are built once per test session into a private cache."""

from __future__ import annotations

import os

import pytest

# The real-vLLM fixtures, registered here once for the whole suite: a session-scoped fixture
# imported into several test modules would be a separate fixture per module (one engine and one
# checkpoint each). Test modules import only the constants and markers of tests/vllm_fixtures.py.
from tests.vllm_fixtures import tiny_ckpt, trainer_model, vllm_engine, vllm_engine_holder  # noqa: F401


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
