"""Environments of multi-turn episodes: the contract (base.py), tools (tools.py) and games.

docs/multi_turn.md says how an episode runs and which tokens train; docs/tools.md how tools are
written, named and called.
"""

from lightning_offpolicy.data.environments.base import (
    Environment,
    EnvironmentFactory,
    Message,
    StepResult,
    environment_tools,
)
from lightning_offpolicy.data.environments.tool_calls import (
    CALL_FORMATS,
    MalformedToolCall,
    ToolCall,
    parse_tool_calls,
)
from lightning_offpolicy.data.environments.tools import ToolEnvironment, Tools

__all__ = [
    "CALL_FORMATS",
    "Environment",
    "EnvironmentFactory",
    "MalformedToolCall",
    "Message",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "Tools",
    "environment_tools",
    "parse_tool_calls",
]
