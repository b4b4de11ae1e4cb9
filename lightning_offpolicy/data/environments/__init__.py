"""Environments of multi-turn episodes: the contract (base.py), tools (tools.py) and games.

docs/multi_turn.md says how an episode runs and which tokens train; docs/tools.md how tools are
written, named and called; docs/environments.md the games.
"""

from lightning_offpolicy.data.environments.base import (
    Environment,
    EnvironmentFactory,
    Message,
    StepResult,
    environment_tools,
)
from lightning_offpolicy.data.environments.guess_number import GuessNumber, bisection_dialogue
from lightning_offpolicy.data.environments.textarena import TextArenaGame  # imports TextArena when a game is made
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
    "GuessNumber",
    "MalformedToolCall",
    "Message",
    "StepResult",
    "TextArenaGame",
    "ToolCall",
    "ToolEnvironment",
    "Tools",
    "bisection_dialogue",
    "environment_tools",
    "parse_tool_calls",
]
