"""A tool-use task: multiply numbers too large for a tiny model to multiply, with a calculator tool.

The prompt asks for a product (``"What is 4821 * 726?"``). A model cannot compute it itself, but
it can call :func:`multiply` (the call's arguments are digits copied from the question), read the
tool's result and state it in its final answer. The task is solved only through the tool, so the
success rate measures whether the model uses the tool well. How an episode runs: docs/multi_turn.md.

    >>> import random
    >>> task = MultiplyToolTask()
    >>> prompt, metadata = task.sample(random.Random(0))
    >>> task.reward(f"The product is {metadata['answer']}.", metadata)
    1.0

In a config, the tool is named by its import path (``lightning_offpolicy.data.tasks.tool_use.multiply``)
and the reward by ``lightning_offpolicy.data.tasks.tool_use.product_reward``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.data.tasks.base import Task

__all__ = ["TOOL_CALL_TAG", "MultiplyToolTask", "multiply", "product_reward", "stated_integers"]

#: Opens a tool call in the Qwen2.5 / Hermes format; a last turn that holds one gave no final answer.
TOOL_CALL_TAG = "<tool_call>"

# An integer not glued to other digits: plain (``350074593``) or with thousands commas (``350,074,593``).
_INTEGER = re.compile(r"(?<![\d,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|,\d)")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product of a and b.
    """
    return int(a) * int(b)


def stated_integers(text: str) -> list[int]:
    """The integers written in ``text``, in order; thousands commas are allowed (``"1,234"`` is 1234).

    >>> stated_integers("48213 * 7261 = 350,074,593.")
    [48213, 7261, 350074593]
    """
    return [int(match.replace(",", "")) for match in _INTEGER.findall(text)]


class MultiplyToolTask(Task):
    """Multiply an ``a_digits``-digit number by a ``b_digits``-digit number, with the :func:`multiply` tool.

    Prompt: ``"What is {a} * {b}?"``; metadata: ``{"a": a, "b": b, "answer": a * b}``.

    Reward (:meth:`reward`), 0 or 1, no partial credit: 1.0 when the completion (the text of the
    episode's last model turn) states the exact product as one of its integers, holds no tool call
    (a last turn that calls a tool gave no answer) and ``metadata["truncated"]`` is not True (an
    episode cut short by a limit earns nothing); 0.0 otherwise. Stating other numbers too costs
    nothing: the product cannot be guessed, only copied from the tool's result.

    Args:
        a_digits: number of digits of the first factor (at least 1).
        b_digits: number of digits of the second factor (at least 1).
        max_new_tokens: token budget of one model turn (a tool call or a final answer).
    """

    name = "multiply"

    def __init__(self, a_digits: int = 4, b_digits: int = 3, max_new_tokens: int = 48) -> None:
        for setting, value in (("a_digits", a_digits), ("b_digits", b_digits), ("max_new_tokens", max_new_tokens)):
            if not is_int(value) or value < 1:
                raise ValueError(f"MultiplyToolTask: `{setting}` must be an int >= 1, got {value!r}.")
        self.a_digits = a_digits
        self.b_digits = b_digits
        self.max_new_tokens = max_new_tokens
        #: The tools an episode of this task offers (``apply_chat_template(..., tools=task.tools)``).
        self.tools = [multiply]

    def sample(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        a = rng.randint(10 ** (self.a_digits - 1), 10**self.a_digits - 1)
        b = rng.randint(10 ** (self.b_digits - 1), 10**self.b_digits - 1)
        return f"What is {a} * {b}?", {"a": a, "b": b, "answer": multiply(a, b)}

    def reward(self, completion: str, metadata: dict[str, Any]) -> float:
        if metadata.get("truncated") is True or TOOL_CALL_TAG in completion:
            return 0.0
        return 1.0 if int(metadata["answer"]) in stated_integers(completion) else 0.0

    def reference_completion(self, metadata: dict[str, Any]) -> str:
        """The final answer of a solved episode: ``"The answer is {product}."``."""
        return f"The answer is {metadata['answer']}."

    def reference_conversation(self, prompt: str, metadata: dict[str, Any]) -> list[dict[str, Any]]:
        """A solved episode as chat messages: the question, the tool call, the tool's result, the answer.

        The shape ``apply_chat_template(messages, tools=task.tools)`` renders (what supervised warm-up
        trains on: :func:`lightning_offpolicy.demo.chat_sft.sft_on_conversations`).
        """
        arguments = {"a": int(metadata["a"]), "b": int(metadata["b"])}
        call = {"type": "function", "function": {"name": multiply.__name__, "arguments": arguments}}
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "name": multiply.__name__, "content": str(multiply(**arguments))},
            {"role": "assistant", "content": self.reference_completion(metadata)},
        ]


def product_reward(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """:meth:`MultiplyToolTask.reward` of each episode: 1.0 when its last turn states the exact product.

    A reward function by import path (``reward_fn: lightning_offpolicy.data.tasks.tool_use.product_reward``).

    Raises:
        ValueError: The three lists differ in length.
    """
    if not (len(prompts) == len(completions) == len(metadata)):
        raise ValueError(
            f"product_reward: {len(prompts)} prompts, {len(completions)} completions and {len(metadata)} "
            "metadata entries; they must match."
        )
    task = MultiplyToolTask()
    return [task.reward(c, m) for c, m in zip(completions, metadata, strict=True)]
