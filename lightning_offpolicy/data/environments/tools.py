"""Tools as plain Python functions: an environment that runs the model's tool calls.

The functions are shown to the model by the tokenizer's chat template (``apply_chat_template(
tools=...)`` builds each one's JSON schema from its type hints and Google-style docstring, as TRL's
``GRPOTrainer(tools=...)`` does); the model's reply is parsed for calls in the template's own format
(:mod:`~lightning_offpolicy.data.environments.tool_calls`); each call runs, under a time limit, and
its result becomes a ``{"role": "tool"}`` message. A reply without a call is the final answer and
ends the episode. A call that fails in any way (the tool raises or runs too long, the call is
malformed, names no known tool or passes wrong arguments) becomes an error text in the tool's
message, as in TRL, never an exception out of ``step``, whatever the reply holds. docs/tools.md says
how to write tools and name them in YAML.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_offpolicy.data.environments.base import Message, StepResult
from lightning_offpolicy.data.environments.tool_calls import MalformedToolCall, ToolCall, call_parser, load_json

__all__ = ["ToolEnvironment", "Tools"]

log = logging.getLogger(__name__)

# The code points UTF-8 cannot encode: surrogates, which a str holds when a tool returns one or the
# model writes a "\ud800" escape in its arguments. A tokenizer raises on them.
_SURROGATE = re.compile("[\ud800-\udfff]")


class _ToolTimeout(BaseException):
    """Raised into a tool's worker thread at its deadline.

    A ``BaseException``, so that a tool's own ``except Exception`` lets it pass.
    """


class Tools:
    """An environment factory whose episodes run the model's calls to ``tools``.

    Example YAML (docs/tools.md)::

        rollout:
          episodes:
            tools: [my_pkg.tools.multiply, my_pkg.tools.lookup]

    Args:
        tools: The tools: callables, or import paths to them (``"pkg.module.function"`` or
            ``"pkg.module:function"``). Each needs type hints on its arguments and a Google-style
            docstring describing each of them: the chat template shows the model the JSON schema
            ``transformers.utils.get_json_schema`` builds from them. A tool is called by its
            function name, so names must be unique. ``async def`` tools are run with ``asyncio.run``.
        timeout_s: Seconds one call may run; a call past it is answered with a timeout error and
            left behind in its daemon thread (``None``: no limit).
        call_format: How the chat template renders a tool call, hence how replies are parsed; a
            name in ``tool_calls.CALL_FORMATS`` (``"hermes"``: Qwen2.5 / Qwen3 / Hermes templates).
        max_calls_per_turn: Most calls run for one reply; further calls of that reply are answered
            with an error and not run.

    Raises:
        ValueError: a tool cannot be imported or has no usable schema (the message names it and
            what to fix), two tools share a name, or another argument is out of range.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | str],
        timeout_s: float | None = 10.0,
        call_format: str = "hermes",
        max_calls_per_turn: int = 8,
    ) -> None:
        if isinstance(timeout_s, bool) or not (
            timeout_s is None or (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0)
        ):
            raise ValueError(f"`timeout_s`={timeout_s!r}: give a positive number of seconds, or None for no limit.")
        if isinstance(max_calls_per_turn, bool) or not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ValueError(f"`max_calls_per_turn`={max_calls_per_turn!r}: give an int >= 1.")
        call_parser(call_format)  # validates the name now, not at the first reply
        if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or not tools:
            raise ValueError(
                f"`tools`={tools!r}: give a non-empty list of functions or import paths, "
                "e.g. ['my_pkg.tools.multiply']."
            )
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.call_format = call_format
        self.max_calls_per_turn = max_calls_per_turn
        #: The tools' callables, for ``apply_chat_template(tools=...)``.
        self.tools: list[Callable[..., Any]] = []
        #: The tools' JSON schemas, in the order of :attr:`tools`.
        self.schemas: list[dict[str, Any]] = []
        origins: dict[str, str] = {}
        for index, tool in enumerate(tools):
            label = f"`tools[{index}]`={tool!r}" if isinstance(tool, str) else f"`tools[{index}]` ({tool!r})"
            fn = _resolve(tool, index, label)
            schema = _schema(fn, label)
            name = schema["function"]["name"]
            if name in origins:
                raise ValueError(
                    f"{label} is named {name!r}, as {origins[name]} is: the model calls tools by name, so give "
                    "each tool a distinct function name."
                )
            origins[name] = label
            self.tools.append(fn)
            self.schemas.append(schema)

    def __call__(self) -> ToolEnvironment:
        """A fresh :class:`ToolEnvironment` for one episode."""
        return ToolEnvironment(
            {schema["function"]["name"]: fn for fn, schema in zip(self.tools, self.schemas, strict=True)},
            {schema["function"]["name"]: schema for schema in self.schemas},
            timeout_s=self.timeout_s,
            call_format=self.call_format,
            max_calls_per_turn=self.max_calls_per_turn,
        )

    def __repr__(self) -> str:
        names = [schema["function"]["name"] for schema in self.schemas]
        return f"Tools({names}, timeout_s={self.timeout_s}, call_format={self.call_format!r})"


def _resolve(tool: Callable[..., Any] | str, index: int, label: str) -> Callable[..., Any]:
    if isinstance(tool, str):
        # Imported here: the rewards package may come to import environments (an environment's reward).
        from lightning_offpolicy.data.rewards.named import import_object

        try:
            tool = import_object(tool, setting=f"tools[{index}]")
        except ImportError as error:
            raise ValueError(str(error)) from error
    if not callable(tool) or inspect.isclass(tool):
        raise ValueError(f"{label} is not a function: give a function or the import path of one.")
    return tool


def _schema(fn: Callable[..., Any], label: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as error:
        raise ValueError(
            f"{label}: the chat template cannot show this tool to the model, because "
            f"transformers.utils.get_json_schema failed: {error} Give every argument a type hint and write a "
            "Google-style docstring: a one-line description, then 'Args:' with one 'name: description' line per "
            "argument (docs/tools.md)."
        ) from error
    return schema


class ToolEnvironment:
    """One episode's tool runner: each reply's tool calls run, their results are the next observation.

    Made by :class:`Tools`; the arguments are as there.

    Args:
        tools: The callables by the name the model calls them.
        schemas: Their JSON schemas by name; string arguments the schema types otherwise (an
            integer ``"7"``) are converted, as transformers' ``parse_response(tools=...)`` does.
        timeout_s: Seconds one call may run (``None``: no limit).
        call_format: A name in ``tool_calls.CALL_FORMATS``.
        max_calls_per_turn: Most calls run for one reply.
    """

    def __init__(
        self,
        tools: Mapping[str, Callable[..., Any]],
        schemas: Mapping[str, Mapping[str, Any]],
        timeout_s: float | None = 10.0,
        call_format: str = "hermes",
        max_calls_per_turn: int = 8,
    ) -> None:
        self.tools = dict(tools)
        self.properties = {
            name: dict(schema.get("function", {}).get("parameters", {}).get("properties", {}))
            for name, schema in schemas.items()
        }
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self._parse = call_parser(call_format)

    def reset(self, prompt: Any, metadata: Mapping[str, Any]) -> None:
        """Start an episode; tools keep no state between calls here, so there is nothing to do."""

    def step(self, reply: str) -> StepResult:
        """Run the tool calls of ``reply``.

        Args:
            reply: The model's turn, decoded with special tokens kept (stop token left out).

        Returns:
            ``done=True`` when the reply calls no tool (it is the final answer). Otherwise one
            ``{"role": "tool", "name": ..., "content": ...}`` message per call, in order, whose
            content is the tool's result as text (a ``str`` as is, another value as JSON, else
            ``str``) or, for a call that failed, ``{'error': '...'}`` as TRL writes it; with the
            counts of calls and failed calls, and the seconds spent. Names and contents encode as
            UTF-8 (a lone surrogate is replaced by U+FFFD), so that the tokenizer takes them.
        """
        calls = self._parse(reply)
        if not calls:
            return StepResult(done=True)
        start = time.perf_counter()
        messages: list[Message] = []
        errors = 0
        for index, call in enumerate(calls):
            name, content, failed = self._answer(call, index, len(calls))
            messages.append({"role": "tool", "name": _encodable(name), "content": _encodable(content)})
            errors += failed
        return StepResult(
            messages=messages, tool_calls=len(calls), tool_errors=errors, tool_seconds=time.perf_counter() - start
        )

    def _answer(self, call: ToolCall | MalformedToolCall, index: int, count: int) -> tuple[str, str, bool]:
        """The tool message's name and content for ``call``, and whether the call failed."""
        if index >= self.max_calls_per_turn:
            message = (
                f"This reply made {count} tool calls; at most {self.max_calls_per_turn} run per reply, "
                "so this one was not run."
            )
            return _failure(call.name or "unknown", message)
        if isinstance(call, MalformedToolCall):
            return _failure(call.name or "unknown", f"Malformed tool call: {call.error}")
        fn = self.tools.get(call.name)
        if fn is None:
            known = ", ".join(self.tools)
            return _failure(call.name, f"Tool {call.name} not found. Known tools: {known}.")
        try:
            arguments = _coerce_arguments(call.arguments, self.properties.get(call.name, {}))
        except _ArgumentError as error:
            return _failure(call.name, f"Malformed tool call: {error}")
        outcome = _run(fn, arguments, self.timeout_s, call.name)
        if outcome is None:
            return _failure(call.name, f"Tool {call.name} timed out after {self.timeout_s:g} s.")
        text, raised = outcome
        return _failure(call.name, text) if raised else (call.name, text, False)


def _failure(name: str, message: str) -> tuple[str, str, bool]:
    log.debug("tool call to %s failed: %s", name, message)
    # TRL answers a failed call with str({"error": str(exception)}); the same text here.
    return name, str({"error": message}), True


def _run(
    fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float | None, name: str
) -> tuple[str, bool] | None:
    """Call ``fn(**arguments)`` in a daemon thread: ``(result text or error message, raised)``, ``None`` on timeout.

    At the deadline the caller stops waiting and a :class:`_ToolTimeout` is raised into the thread,
    which ends a tool running Python code; a tool blocked in C (a sleep, a socket read) keeps its
    thread until the call returns, but nothing waits for it.
    """
    from lightning_offpolicy.data.rewards.deadline import raise_in_thread  # imported here as import_object is

    lock = threading.Lock()
    done = threading.Event()
    outcome: list[tuple[str, bool]] = []

    def work() -> None:
        try:
            try:
                value = fn(**arguments)
                if inspect.iscoroutine(value):
                    value = asyncio.run(value)
                result = (_as_text(value), False)
            except _ToolTimeout:
                return
            except BaseException as error:  # a tool's failure of any kind (even SystemExit) is its answer
                result = (_error_message(error), True)
            # Under the lock the caller cannot be raising the timeout into this thread: either it
            # gave up before (then the timeout arrives here, inside the outer try) or it sees `done`.
            with lock:
                outcome.append(result)
                done.set()
        except _ToolTimeout:
            pass

    thread = threading.Thread(target=work, name=f"tool:{name}", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        with lock:
            if not done.is_set():
                if thread.ident is not None:
                    raise_in_thread(thread.ident, _ToolTimeout)
                return None
    return outcome[0]


def _error_message(error: BaseException) -> str:
    try:
        return str(error) or type(error).__name__
    except Exception:  # an exception whose __str__ fails still has a type
        return type(error).__name__


def _as_text(value: Any) -> str:
    """A tool's result as text: a ``str`` as is, a JSON value as JSON, else ``str(value)``.

    Raises:
        ValueError: the result holds an integer longer than Python converts to text (the message
            says so, not how to lift Python's limit); whatever ``str(value)`` raises otherwise.
    """
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        pass
    try:
        return str(value)
    except ValueError as error:
        if "integer string conversion" not in str(error):  # int's message for its digit limit
            raise
        limit = sys.get_int_max_str_digits()
        raise ValueError(
            f"The result holds an integer with more than {limit} digits, too long to turn into text."
        ) from None


def _encodable(text: str) -> str:
    """``text`` with every code point UTF-8 cannot encode (a lone surrogate) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


class _ArgumentError(ValueError):
    """A string argument reads as its schema type but cannot be converted; the message says why."""


def _coerce_arguments(arguments: dict[str, Any], properties: Mapping[str, Any]) -> dict[str, Any]:
    """``arguments`` with each string value converted to its schema property's type, where it reads as one.

    Raises:
        _ArgumentError: a string is all digits, more than Python converts to an int, for an integer
            or number argument; the message names the argument.
    """
    coerced = {}
    for key, value in arguments.items():
        try:
            coerced[key] = _coerce(value, _schema_types(properties.get(key))) if isinstance(value, str) else value
        except _ArgumentError as error:
            raise _ArgumentError(f"argument {key!r} {error}") from None
    return coerced


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or () if isinstance(t, str)}
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or ():
            types |= _schema_types(choice)
    if schema.get("nullable"):  # how get_json_schema marks an Optional argument
        types.add("null")
    return types


def _coerce(raw: str, types: set[str]) -> Any:
    """``raw`` as the first of ``types`` it reads as, else ``raw`` itself.

    Raises:
        _ArgumentError: ``raw`` is all digits, more than Python converts to an int, for an
            integer or number type. (JSON for an object or array type that ``load_json`` refuses
            does not read as the type: ``raw`` is passed on, as any such string is.)
    """
    if not types or "string" in types:
        return raw
    text = raw.strip()
    digits = text[1:] if text[:1] in ("+", "-") else text
    limit = sys.get_int_max_str_digits()
    if types & {"integer", "number"} and 0 < limit < len(digits) and digits.isdecimal():
        # int() refuses it; passing the digits on as a string would only move the failure into the tool.
        raise _ArgumentError(f"is an integer with more than {limit} digits")
    for kind in ("integer", "number", "boolean", "null", "object", "array"):
        if kind not in types:
            continue
        try:
            if kind in ("integer", "number"):
                try:
                    return int(text)
                except ValueError:
                    if kind == "integer":
                        continue
                number = float(text)
                if math.isfinite(number):
                    return number
            elif kind == "boolean" and text.lower() in ("true", "false", "1", "0"):
                return text.lower() in ("true", "1")
            elif kind == "null" and text in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                decoded = load_json(text)
                if isinstance(decoded, dict if kind == "object" else list):
                    return decoded
        except ValueError:
            continue
    return raw
