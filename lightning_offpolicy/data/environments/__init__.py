"""Environments of multi-turn episodes: the contract (base.py), tools (tools.py) and games.

docs/multi_turn.md says how an episode runs and which tokens train.
"""

from lightning_offpolicy.data.environments.base import Environment, EnvironmentFactory, Message, StepResult
from lightning_offpolicy.data.environments.guess_number import GuessNumber, GuessNumberEnvironment, bisection_dialogue
from lightning_offpolicy.data.environments.textarena import TextArenaEnvironment, TextArenaGame

__all__ = ["Environment", "EnvironmentFactory", "Message", "StepResult"]
# Games (guess_number.py; textarena.py imports TextArena only when a game is made).
__all__ += ["GuessNumber", "GuessNumberEnvironment", "TextArenaEnvironment", "TextArenaGame", "bisection_dialogue"]
