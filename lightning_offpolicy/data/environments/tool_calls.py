"""Tool calls parsed from a model's reply, in the format its chat template renders them.

A chat template that shows tools to the model (``apply_chat_template(tools=...)``) also says how
the model is to call them; the reply is parsed in that same format, so that a call the template
renders for an assistant message parses back to the same name and arguments. Formats are
registered by name in :data:`CALL_FORMATS`; docs/tools.md lists them.

``"hermes"`` (Qwen2.5, Qwen3, Hermes, NousResearch templates): each call is one block

.. code-block:: text

    <tool_call>
    {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    </tool_call>

in the reply's text; any number of blocks, anywhere after the reasoning (text up to the last
``</think>`` is reasoning and is not searched). As in TRL and transformers' ``parse_response``,
missing or ``null`` arguments mean ``{}``; arguments given as a JSON string that holds an object
(as some models emit) are decoded. A reply is the model's own text, so no reply makes the parser
raise: JSON nested deeper than :data:`MAX_JSON_DEPTH` levels (which would exhaust Python's
recursion) and integers longer than Python converts (``sys.get_int_max_str_digits()``) are
malformed calls like any other bad JSON.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CALL_FORMATS",
    "MAX_JSON_DEPTH",
    "MalformedToolCall",
    "ToolCall",
    "call_parser",
    "load_json",
    "parse_hermes",
    "parse_tool_calls",
]

#: Deepest nesting of arrays and objects a call's JSON may have. ``json.loads`` recurses once per
#: level and raises RecursionError near Python's recursion limit (1000 frames, shared with the
#: caller's stack); no tool's arguments come near this depth.
MAX_JSON_DEPTH = 100


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedToolCall:
    """A call that cannot run: its raw ``text``, what is wrong (``error``) and its ``name`` when that was readable."""

    text: str
    error: str
    name: str | None = None


#: A parser of one call format: the reply's text in, its calls in order out.
CallParser = Callable[[str], list[ToolCall | MalformedToolCall]]

_OPEN, _CLOSE, _THINK_END = "<tool_call>", "</tool_call>", "</think>"

# A JSON string (escapes kept inside it, possibly never closed) or one bracket: brackets inside
# strings do not nest. The string part is written unrolled, so a long string is one linear match.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def load_json(text: str) -> Any:
    """``json.loads(text)``, failing only with a ``ValueError`` whose message a model can act on.

    Args:
        text: JSON written by the model.

    Returns:
        The decoded value.

    Raises:
        ValueError: ``text`` is not valid JSON, nests arrays and objects deeper than
            :data:`MAX_JSON_DEPTH` levels, or holds an integer longer than Python converts; the
            message completes "the call ..." (``is not valid JSON (...)``, ``nests deeper than 100
            levels``, ``holds an integer with more than 4300 digits``).
    """
    too_deep = f"nests deeper than {MAX_JSON_DEPTH} levels"
    if _nesting_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(too_deep)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not valid JSON ({error})") from None
    except ValueError:
        # json's only other ValueError: int() refusing a literal past the digit limit (CVE-2020-10735).
        raise ValueError(f"holds an integer with more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        # Within MAX_JSON_DEPTH, still possible when the caller's own stack is already deep.
        raise ValueError(too_deep) from None


def _nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside JSON strings (stray closers are json's to report)."""
    depth = deepest = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in ("]", "}"):
            depth -= 1
    return deepest


def parse_hermes(text: str) -> list[ToolCall | MalformedToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text``, in order.

    Args:
        text: The model's reply, decoded with its special tokens kept.

    Returns:
        One :class:`ToolCall` per well-formed block and one :class:`MalformedToolCall` per block
        whose body is not valid JSON (or nests deeper than :data:`MAX_JSON_DEPTH` levels, or holds
        an integer longer than Python converts), is not an object, has no string ``name``, has
        ``arguments`` that are not an object, or that is never closed (no ``</tool_call>`` before
        the next ``<tool_call>`` or the end). Empty when the reply calls no tool; never raises.
    """
    think_end = text.rfind(_THINK_END)
    if think_end >= 0:
        text = text[think_end + len(_THINK_END) :]
    calls: list[ToolCall | MalformedToolCall] = []
    position = 0
    while (start := text.find(_OPEN, position)) >= 0:
        body_start = start + len(_OPEN)
        end = text.find(_CLOSE, body_start)
        next_open = text.find(_OPEN, body_start)
        if end < 0 or 0 <= next_open < end:
            stop = len(text) if next_open < 0 else next_open
            calls.append(MalformedToolCall(text[start:stop], f"{_OPEN} is never closed by {_CLOSE}"))
            position = stop
            continue
        position = end + len(_CLOSE)
        calls.append(_parse_hermes_body(text[start:position], text[body_start:end]))
    return calls


def _parse_hermes_body(raw: str, body: str) -> ToolCall | MalformedToolCall:
    expected = 'write {"name": "<tool name>", "arguments": {...}}'
    try:
        value = load_json(body)
    except ValueError as error:
        return MalformedToolCall(raw, f"the call {error}; {expected}")
    if not isinstance(value, dict):
        return MalformedToolCall(raw, f"the call is a JSON {_json_kind(value)}, not an object; {expected}")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return MalformedToolCall(raw, f'the call has no "name" string; {expected}')
    name = name.strip()
    arguments = value.get("arguments")
    if arguments is None:
        return ToolCall(name, {})
    if isinstance(arguments, str):
        if not arguments.strip():
            return ToolCall(name, {})
        try:
            arguments = load_json(arguments)
        except ValueError as error:
            return MalformedToolCall(raw, f'"arguments" is a string that {error}; {expected}', name)
    if not isinstance(arguments, dict):
        return MalformedToolCall(raw, f'"arguments" is a JSON {_json_kind(arguments)}, not an object; {expected}', name)
    return ToolCall(name, arguments)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    kinds = {list: "array", str: "string", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


#: The known call formats by name (read-only); ``Tools(call_format=...)`` takes one of these names.
CALL_FORMATS: Mapping[str, CallParser] = MappingProxyType({"hermes": parse_hermes})


def call_parser(call_format: str) -> CallParser:
    """The parser of ``call_format``.

    Raises:
        ValueError: ``call_format`` is not in :data:`CALL_FORMATS`; the message lists the known ones.
    """
    parser = CALL_FORMATS.get(call_format) if isinstance(call_format, str) else None
    if parser is None:
        known = ", ".join(repr(name) for name in CALL_FORMATS)
        raise ValueError(
            f"`call_format`={call_format!r} is not a known tool-call format; use one of {known} "
            "(the format the model's chat template renders tool calls in, docs/tools.md)."
        )
    return parser


def parse_tool_calls(text: str, call_format: str = "hermes") -> list[ToolCall | MalformedToolCall]:
    """The tool calls of a model's reply ``text`` in format ``call_format``, in order.

    Args:
        text: The model's reply, decoded with its special tokens kept.
        call_format: A name in :data:`CALL_FORMATS`.

    Returns:
        :class:`ToolCall` and :class:`MalformedToolCall` items in the order they appear; empty
        when the reply calls no tool.

    Raises:
        ValueError: ``call_format`` is unknown.

    >>> parse_tool_calls('<tool_call>\\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\\n</tool_call>')
    [ToolCall(name='multiply', arguments={'a': 3, 'b': 4})]
    """
    return call_parser(call_format)(text)
