"""Environments of multi-turn episodes: the contract (base.py), tools (tools.py) and games.

docs/multi_turn.md says how an episode runs and which tokens train.
"""

from lightning_offpolicy.data.environments.base import (
    Environment,
    EnvironmentFactory,
    Message,
    StepResult,
    environment_tools,
)

__all__ = ["Environment", "EnvironmentFactory", "Message", "StepResult", "environment_tools"]
