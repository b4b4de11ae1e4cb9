"""The environment contract of a multi-turn episode: the model's reply in, an observation out.

An episode starts from a prompt; the model replies (a turn sampled by the rollout engine), the
environment answers with messages (a tool's result, a game's feedback, a user's next question)
that are appended to the context as token ids the model does not train on, and so on until the
environment says the episode is done or a limit ends it. Why and how: docs/multi_turn.md.

The interface is the one the peers share (TRL's ``environment_factory``, SkyRL-Gym, textarena):
``reset`` once per episode, then ``step`` once per model turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Environment", "EnvironmentFactory", "Message", "StepResult", "environment_tools"]

#: A chat message as ``apply_chat_template`` takes it: ``{"role": "tool" | "user" | ..., "content": str, ...}``.
Message = dict[str, Any]


@dataclass
class StepResult:
    """What an environment answers to one model reply.

    Attributes:
        messages: The messages appended after the reply (``role`` ``"tool"`` for a tool's result,
            ``"user"`` for feedback); ignored when ``done``.
        reward: Reward of this step; an episode's environment reward is the sum over its steps.
        done: Whether the episode ends with this reply.
        tool_calls: Tool calls the reply made (counted in the metrics).
        tool_errors: Of those, how many failed (raised, timed out, malformed, unknown name).
        tool_seconds: Seconds spent running tools in this step.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: ``reset`` once, then ``step`` after each model reply.

    An environment may also have a ``tools`` attribute: the functions the chat template shows the
    model (``apply_chat_template(tools=...)``). ``reset`` and ``step`` may be ``async def``: the runner
    awaits them, side by side with the other episodes' (:mod:`~lightning_offpolicy.rollout.env_steps`).
    """

    def reset(self, prompt: Any, metadata: Mapping[str, Any]) -> None:
        """Start an episode for ``prompt`` (a text or chat messages) and its dataset row's ``metadata``."""
        ...

    def step(self, reply: str) -> StepResult:
        """Answer the model's ``reply`` (the decoded text of its turn, the stop token left out)."""
        ...


#: Makes one :class:`Environment` per episode: an environment class, or any callable without
#: arguments (in YAML: ``class_path`` of the environment and its ``init_args``).
EnvironmentFactory = Callable[[], Environment]


def environment_tools(factory: EnvironmentFactory) -> list[Callable[..., Any]]:
    """The tools the environments of ``factory`` show the model: its ``tools`` attribute, else that of
    one environment it makes (``[]`` if none)."""
    tools = getattr(factory, "tools", None)
    if tools is None:
        tools = getattr(factory(), "tools", None)
    return list(tools or [])
