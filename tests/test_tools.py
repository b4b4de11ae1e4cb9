"""Tool calling: parsing replies (tool_calls.py), running calls (tools.py), and the chat template round trip."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.utils import get_json_schema

from lightning_offpolicy.data.environments import (
    CALL_FORMATS,
    Environment,
    MalformedToolCall,
    StepResult,
    ToolCall,
    ToolEnvironment,
    Tools,
    environment_tools,
    parse_tool_calls,
)
from tests import tool_fixtures
from tests.tool_fixtures import multiply


def call(name: str, arguments: object) -> str:
    """A Hermes call block as the Qwen2.5 template renders one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# ---------------------------------------------------------------- parsing


def test_parse_one_call():
    assert parse_tool_calls(call("multiply", {"a": 3, "b": 4})) == [ToolCall("multiply", {"a": 3, "b": 4})]


def test_parse_several_calls_in_order_whitespace_tolerant():
    reply = (
        "Let me compute.\n"
        + call("multiply", {"a": 3, "b": 4})
        + ' and then <tool_call>{"name":"add","arguments":{"x":[1,2]}}</tool_call>'
        + '\n<tool_call>  \n\t {"arguments": {"q": "a b"}, "name": " lookup "}\n\n</tool_call>\n'
    )
    assert parse_tool_calls(reply) == [
        ToolCall("multiply", {"a": 3, "b": 4}),
        ToolCall("add", {"x": [1, 2]}),
        ToolCall("lookup", {"q": "a b"}),
    ]


@pytest.mark.parametrize("reply", ["", "The answer is 12.", 'I would use tool_call here: {"name": "x"}'])
def test_parse_no_call(reply):
    assert parse_tool_calls(reply) == []


def test_parse_string_and_missing_arguments():
    as_string = '<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("multiply", {"a": 3, "b": 4})]
    # No arguments, null or an empty string: a call without arguments (TRL normalizes missing ones to {}).
    for body in ('{"name": "now"}', '{"name": "now", "arguments": null}', '{"name": "now", "arguments": ""}'):
        assert parse_tool_calls(f"<tool_call>{body}</tool_call>") == [ToolCall("now", {})]


@pytest.mark.parametrize(
    ("body", "error", "name"),
    [
        ('{"name": "multiply", "arguments": {"a": 3,}}', "not valid JSON", None),
        ('["multiply", 3, 4]', "JSON array, not an object", None),
        ('{"arguments": {"a": 3}}', 'no "name"', None),
        ('{"name": 7, "arguments": {}}', 'no "name"', None),
        ('{"name": "  ", "arguments": {}}', 'no "name"', None),
        ('{"name": "multiply", "arguments": [3, 4]}', '"arguments" is a JSON array', "multiply"),
        ('{"name": "multiply", "arguments": 3}', '"arguments" is a JSON number', "multiply"),
        ('{"name": "multiply", "arguments": "[3, 4]"}', '"arguments" is a JSON array', "multiply"),
        ('{"name": "multiply", "arguments": "a=3"}', "is a string that is not valid JSON", "multiply"),
    ],
)
def test_parse_malformed_body(body, error, name):
    text = f"<tool_call>\n{body}\n</tool_call>"
    (parsed,) = parse_tool_calls(f"before {text} after")
    assert isinstance(parsed, MalformedToolCall)
    assert parsed.text == text and error in parsed.error and parsed.name == name
    assert '{"name": "<tool name>", "arguments": {...}}' in parsed.error  # says what to write


def test_parse_unclosed_call():
    (unclosed,) = parse_tool_calls('ok <tool_call>\n{"name": "multiply", "arguments": {"a": 3')
    assert unclosed == MalformedToolCall(
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3', "<tool_call> is never closed by </tool_call>"
    )
    # An unclosed block followed by a good one: the first is malformed, the second still parses.
    first, second = parse_tool_calls('<tool_call>{"name": "a"' + call("multiply", {"a": 1, "b": 2}))
    assert isinstance(first, MalformedToolCall) and first.text == '<tool_call>{"name": "a"'
    assert second == ToolCall("multiply", {"a": 1, "b": 2})


def test_parse_skips_calls_inside_the_reasoning():
    reply = "<think>\nI could " + call("lookup", {"q": "x"}) + "\n</think>\n\n" + call("multiply", {"a": 2, "b": 5})
    assert parse_tool_calls(reply) == [ToolCall("multiply", {"a": 2, "b": 5})]
    # A template that opens <think> in the generation prompt: the reply only holds the closing tag.
    assert parse_tool_calls("hmm " + call("lookup", {}) + "</think>done") == []


def test_unknown_call_format_lists_the_known_ones():
    assert list(CALL_FORMATS) == ["hermes"]
    with pytest.raises(ValueError, match=r"`call_format`='json'.*'hermes'"):
        parse_tool_calls("x", call_format="json")
    with pytest.raises(ValueError, match=r"`call_format`='json'.*'hermes'"):
        Tools([multiply], call_format="json")


# ---------------------------------------------------------------- construction


def no_docstring(a: int) -> int:
    return a


def undocumented_argument(a: int, b: int) -> int:
    """Add.

    Args:
        a: The first term.
    """
    return a + b


def untyped(a):
    """Echo.

    Args:
        a: Anything.
    """
    return a


def test_tools_resolve_callables_and_import_paths():
    tools = Tools([multiply, "tests.tool_fixtures:add_later"])
    assert tools.tools == [multiply, tool_fixtures.add_later]
    assert tools.schemas == [get_json_schema(multiply), get_json_schema(tool_fixtures.add_later)]
    assert callable(tools) and environment_tools(tools) == tools.tools
    env = tools()
    assert isinstance(env, ToolEnvironment) and isinstance(env, Environment) and env is not tools()
    env.reset("Compute 6 * 7.", {})
    result = env.step(call("multiply", {"a": 6, "b": 7}) + call("add_later", {"a": 6, "b": 7}))
    assert [m["content"] for m in result.messages] == ["42", "13"]
    assert Tools(["tests.tool_fixtures.multiply"]).tools == [multiply]


@pytest.mark.parametrize(
    ("tool", "match"),
    [
        (no_docstring, r"`tools\[0\]` \(<function no_docstring.*no docstring.*Google-style docstring"),
        (undocumented_argument, r"undocumented_argument.*no description for the argument 'b'.*'Args:'"),
        (untyped, r"untyped.*missing a type hint.*type hint"),
        ("tests.tool_fixtures.no_such_tool", r"`tools\[0\]`='tests.tool_fixtures.no_such_tool'.*no attribute"),
        ("tests.tool_fixtures", r"`tools\[0\]`='tests.tool_fixtures' is not a function"),
        (42, r"`tools\[0\]` \(42\) is not a function"),
        (ToolCall, r"is not a function"),
    ],
)
def test_tools_without_a_usable_schema_are_refused(tool, match):
    with pytest.raises(ValueError, match=match):
        Tools([tool])


def test_tools_argument_errors():
    def multiply(x: int) -> int:  # the same name as tool_fixtures.multiply
        """Double.

        Args:
            x: The number.
        """
        return 2 * x

    with pytest.raises(ValueError, match=r"`tools\[1\]`.*named 'multiply', as `tools\[0\]`='tests.tool_fixtures"):
        Tools(["tests.tool_fixtures.multiply", multiply])
    with pytest.raises(ValueError, match="non-empty list"):
        Tools("tests.tool_fixtures.multiply")
    with pytest.raises(ValueError, match="non-empty list"):
        Tools([])
    for timeout_s in (0, -1.0, float("inf"), True, "10"):
        with pytest.raises(ValueError, match="`timeout_s`"):
            Tools([tool_fixtures.multiply], timeout_s=timeout_s)
    for limit in (0, 1.5, True):
        with pytest.raises(ValueError, match="`max_calls_per_turn`"):
            Tools([tool_fixtures.multiply], max_calls_per_turn=limit)


# ---------------------------------------------------------------- steps


def boom(x: int) -> int:
    """Divide by zero.

    Args:
        x: The numerator.
    """
    return x // 0


def sleep_forever(x: int) -> int:
    """Block in C for a very long time.

    Args:
        x: Ignored.
    """
    time.sleep(1e6)
    return x


SPINNING: list[threading.Thread] = []


def spin_forever(x: int) -> int:
    """Loop in Python forever, swallowing every Exception.

    Args:
        x: Ignored.
    """
    SPINNING.append(threading.current_thread())
    n = x
    while True:
        try:
            n += 1
        except Exception:
            pass


def describe(name: str, count: int, scale: float | None = None) -> object:
    """Return values of several kinds.

    Args:
        name: Which kind of value to return.
        count: A count.
        scale: An optional scale.
    """
    values = {"text": "plain text", "dict": {"count": count, "scale": scale}, "object": object.__new__(Opaque)}
    return values[name]


class Opaque:
    def __str__(self) -> str:
        return "<opaque>"


def test_a_reply_without_a_call_ends_the_episode():
    assert Tools([multiply])().step("The product is 42.") == StepResult(done=True)


def test_a_raising_tool_answers_trls_error_text():
    result = Tools([boom, multiply])().step(call("boom", {"x": 1}) + call("multiply", {"a": 2, "b": 3}))
    # TRL answers a raising tool with str({"error": str(exception)}).
    assert result.messages == [
        {"role": "tool", "name": "boom", "content": "{'error': 'integer division or modulo by zero'}"},
        {"role": "tool", "name": "multiply", "content": "6"},
    ]
    assert (result.done, result.tool_calls, result.tool_errors) == (False, 2, 1)


def test_a_tool_that_exits_or_raises_without_a_message_is_an_error():
    def leave(code: int) -> int:
        """Exit the process.

        Args:
            code: The exit status.
        """
        raise SystemExit(code)

    def bare(x: int) -> int:
        """Raise an exception without a message.

        Args:
            x: Ignored.
        """
        raise KeyError

    result = Tools([leave, bare])().step(call("leave", {"code": 3}) + call("bare", {"x": 1}))
    assert [m["content"] for m in result.messages] == ["{'error': '3'}", "{'error': 'KeyError'}"]
    assert result.tool_errors == 2


def test_a_tool_hanging_in_c_times_out():
    env = Tools([sleep_forever, multiply], timeout_s=0.2)()
    start = time.perf_counter()
    result = env.step(call("sleep_forever", {"x": 1}) + call("multiply", {"a": 2, "b": 3}))
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert 0.19 <= result.tool_seconds <= elapsed
    assert [m["content"] for m in result.messages] == [
        "{'error': 'Tool sleep_forever timed out after 0.2 s.'}",
        "6",
    ]
    assert (result.tool_calls, result.tool_errors) == (2, 1)


def test_a_tool_looping_in_python_is_stopped_at_its_deadline():
    result = Tools([spin_forever], timeout_s=0.2)().step(call("spin_forever", {"x": 0}))
    assert result.messages[0]["content"] == "{'error': 'Tool spin_forever timed out after 0.2 s.'}"
    (thread,) = SPINNING
    assert thread is not threading.current_thread()
    thread.join(timeout=30)  # the timeout is raised into the thread, past the tool's `except Exception`
    assert not thread.is_alive()


def test_malformed_unknown_and_wrong_argument_calls_become_error_messages():
    reply = (
        '<tool_call>{"name": "multiply", "arguments": [2, 3]}</tool_call>'
        + call("divide", {"a": 1})
        + call("multiply", {"a": 2, "c": 3})
        + call("multiply", {"a": 2})
        + '<tool_call>{"name": "multiply"'
    )
    result = Tools([multiply, boom])().step(reply)
    names = [m["name"] for m in result.messages]
    contents = [m["content"] for m in result.messages]
    assert names == ["multiply", "divide", "multiply", "multiply", "unknown"]
    assert contents[0].startswith("{'error': 'Malformed tool call: \"arguments\" is a JSON array, not an object")
    assert contents[1] == "{'error': 'Tool divide not found. Known tools: multiply, boom.'}"
    assert contents[2] == str({"error": "multiply() got an unexpected keyword argument 'c'"})
    assert contents[3] == str({"error": "multiply() missing 1 required positional argument: 'b'"})
    assert contents[4] == "{'error': 'Malformed tool call: <tool_call> is never closed by </tool_call>'}"
    assert (result.done, result.tool_calls, result.tool_errors) == (False, 5, 5)


def test_calls_past_the_limit_are_answered_and_not_run():
    runs = []

    def record(x: int) -> int:
        """Record a call.

        Args:
            x: The value to record.
        """
        runs.append(x)
        return x

    result = Tools([record], max_calls_per_turn=2)().step("".join(call("record", {"x": i}) for i in range(4)))
    assert runs == [0, 1]
    assert [m["content"] for m in result.messages[:2]] == ["0", "1"]
    limit = "{'error': 'This reply made 4 tool calls; at most 2 run per reply, so this one was not run.'}"
    assert [m["content"] for m in result.messages[2:]] == [limit, limit]
    assert (result.tool_calls, result.tool_errors) == (4, 2)


def test_results_become_text_and_string_arguments_take_the_schema_types():
    env = Tools([describe])()
    contents = [
        m["content"]
        for m in env.step(
            call("describe", {"name": "text", "count": 1})
            + call("describe", {"name": "dict", "count": "3", "scale": "0.5"})
            + call("describe", {"name": "dict", "count": 3, "scale": "null"})
            + call("describe", {"name": "object", "count": 1})
            + call("describe", {"name": "dict", "count": "three"})
        ).messages
    ]
    # str as is; JSON for a JSON value (the "3" / "0.5" / "null" strings became 3, 0.5, None); str() otherwise;
    # a string that does not read as the declared type is passed as it is.
    assert contents == [
        "plain text",
        '{"count": 3, "scale": 0.5}',
        '{"count": 3, "scale": null}',
        "<opaque>",
        '{"count": "three", "scale": null}',
    ]


def test_an_async_tool_runs():
    async def fetch(key: str, delay: float) -> dict:
        """Look a key up, asynchronously.

        Args:
            key: The key.
            delay: Seconds to wait first.
        """
        await asyncio.sleep(delay)
        return {"key": key, "loop_running": asyncio.get_running_loop().is_running()}

    result = Tools([fetch])().step(call("fetch", {"key": "k", "delay": 0.01}))
    assert result.messages == [{"role": "tool", "name": "fetch", "content": '{"key": "k", "loop_running": true}'}]
    assert (result.tool_calls, result.tool_errors) == (1, 0)


def test_an_async_tool_that_raises_or_hangs_is_an_error():
    async def fail(x: int) -> int:
        """Fail.

        Args:
            x: Ignored.
        """
        raise RuntimeError(f"no luck with {x}")

    async def wait(x: int) -> int:
        """Wait a very long time.

        Args:
            x: Ignored.
        """
        await asyncio.sleep(1e6)
        return x

    result = Tools([fail, wait], timeout_s=0.2)().step(call("fail", {"x": 7}) + call("wait", {"x": 1}))
    assert [m["content"] for m in result.messages] == [
        "{'error': 'no luck with 7'}",
        "{'error': 'Tool wait timed out after 0.2 s.'}",
    ]
    assert result.tool_errors == 2


# ---------------------------------------------------------------- replies and results that once broke a step

EXPECTED = 'write {"name": "<tool name>", "arguments": {...}}'


def echo(text: str) -> object:
    """Return the text as it came.

    Args:
        text: Anything.
    """
    return text


def tally(count: int, items: list | None = None) -> object:
    """Return the count and the items.

    Args:
        count: A count.
        items: Some items.
    """
    return [count, items]


def power_of_ten(digits: int) -> int:
    """Return 10 ** digits (digits at most 6000: the fuzz test may pass any integer).

    Args:
        digits: The exponent.
    """
    return 10 ** min(digits, 6000)


def test_a_call_nested_1000_levels_deep_is_malformed():
    too_deep = f"Malformed tool call: the call nests deeper than 100 levels; {EXPECTED}"
    bare = "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>"
    in_arguments = '<tool_call>{"name": "tally", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1001 + "</tool_call>"
    # Arguments as a JSON string (that some models write) nesting as deep: the name is still known.
    in_a_string = '<tool_call>{"name": "tally", "arguments": "' + "[" * 1000 + "]" * 1000 + '"}</tool_call>'
    assert parse_tool_calls(bare) == [MalformedToolCall(bare, too_deep.removeprefix("Malformed tool call: "))]
    result = Tools([tally])().step(bare + in_arguments + in_a_string)
    assert result.messages == [
        {"role": "tool", "name": "unknown", "content": str({"error": too_deep})},
        {"role": "tool", "name": "unknown", "content": str({"error": too_deep})},
        {
            "role": "tool",
            "name": "tally",
            "content": str(
                {"error": f'Malformed tool call: "arguments" is a string that nests deeper than 100 levels; {EXPECTED}'}
            ),
        },
    ]
    assert (result.tool_calls, result.tool_errors) == (3, 3)
    # 100 levels (the call's object, its arguments and 98 lists) still run; a list argument given as
    # a string that nests too deep does not read as a list and is passed on as the string.
    nested = json.loads("[" * 98 + "]" * 98)
    ok = Tools([tally])().step(
        call("tally", {"count": 1, "items": nested}) + call("tally", {"count": 2, "items": "[" * 200})
    )
    assert [m["content"] for m in ok.messages] == [json.dumps([1, nested]), json.dumps([2, "[" * 200])]


def test_an_integer_of_4301_digits_in_the_arguments_is_malformed():
    big = "1" * 4301
    literal = '<tool_call>{"name": "multiply", "arguments": {"a": ' + big + ', "b": 2}}</tool_call>'
    as_string = call("multiply", {"a": big, "b": 2})  # a string the schema's integer type would convert
    result = Tools([multiply])().step(literal + as_string + call("multiply", {"a": int("7" * 4300), "b": 1}))
    assert result.messages[:2] == [
        {
            "role": "tool",
            "name": "unknown",
            "content": str(
                {"error": f"Malformed tool call: the call holds an integer with more than 4300 digits; {EXPECTED}"}
            ),
        },
        {
            "role": "tool",
            "name": "multiply",
            "content": "{'error': \"Malformed tool call: argument 'a' is an integer with more than 4300 digits\"}",
        },
    ]
    assert result.messages[2]["content"] == "7" * 4300  # at the limit, it runs
    assert (result.tool_calls, result.tool_errors) == (3, 2)


def test_a_lone_surrogate_from_a_tool_or_the_arguments_becomes_the_replacement_character():
    def lone_surrogate(x: int) -> str:
        """Return text holding a lone surrogate.

        Args:
            x: Ignored.
        """
        return "a\ud800b"

    # The model writes the escape \ud800 in its JSON; the tool echoes the decoded surrogate back.
    reply = (
        call("lone_surrogate", {"x": 1}) + '<tool_call>{"name": "echo", "arguments": {"text": "\\udfff!"}}</tool_call>'
    )
    result = Tools([lone_surrogate, echo])().step(reply)
    assert result.messages == [
        {"role": "tool", "name": "lone_surrogate", "content": "a\ufffdb"},
        {"role": "tool", "name": "echo", "content": "\ufffd!"},
    ]
    assert (result.tool_calls, result.tool_errors) == (2, 0)


def test_a_tool_returning_an_integer_of_5000_digits_is_an_error():
    result = Tools([power_of_ten])().step(call("power_of_ten", {"digits": 4999}))
    assert result.messages == [
        {
            "role": "tool",
            "name": "power_of_ten",
            "content": str(
                {"error": "The result holds an integer with more than 4300 digits, too long to turn into text."}
            ),
        }
    ]
    assert (result.tool_calls, result.tool_errors) == (1, 1)


FRAGMENTS = (
    "<tool_call>",
    "</tool_call>",
    "</think>",
    "<think>",
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    "\\",
    '"name"',
    '"arguments"',
    '"echo"',
    '"tally"',
    '"items"',
    "null",
    "\\ud800",
    "\ud800",
    "\n",
)

#: Any text, lone surrogates included (hypothesis leaves them out of text() unless asked).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=8)


def raw_values() -> st.SearchStrategy[str]:
    """JSON text of an argument's value as a model might write it: any JSON, escaped or lone surrogates,
    integers of up to 5000 digits, brackets 1200 deep, closed or not."""
    # Lengths at the limits and past them, as well as any: hypothesis draws mostly small integers.
    digits = st.sampled_from([4300, 4301, 5000]) | st.integers(1, 5000)
    depth = st.sampled_from([98, 99, 100, 1000]) | st.integers(1, 1200)
    return st.one_of(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT,
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
            max_leaves=10,
        ).map(json.dumps),
        st.sampled_from(['"\\ud800"', '"a\\udfffb"', '"\ud800"']),
        digits.map(lambda n: "9" * n),
        digits.map(lambda n: '"' + "9" * n + '"'),  # for the schema's integer type to convert
        depth.map(lambda n: "[" * n + "]" * n),
        depth.map(lambda n: '"' + "[" * n + "]" * n + '"'),  # for the schema's array type
        depth.map(lambda n: "{" * n),
    )


def json_calls() -> st.SearchStrategy[str]:
    """A call block naming a tool (mostly a known one) with arguments written as in :func:`raw_values`."""
    names = (st.sampled_from(["echo", "tally", "power_of_ten"]) | ANY_TEXT).map(json.dumps)
    keys = st.sampled_from(["text", "count", "items", "digits"]) | ANY_TEXT
    arguments = st.lists(st.tuples(keys.map(json.dumps), raw_values()), max_size=3).map(
        lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    )
    as_string = st.booleans()  # arguments as a JSON string holding the object, as some models write them
    return st.builds(
        lambda name, args, quoted: (
            f'<tool_call>{{"name": {name}, "arguments": {json.dumps(args) if quoted else args}}}</tool_call>'
        ),
        names,
        arguments,
        as_string,
    )


def reply_parts() -> st.SearchStrategy[str]:
    """One piece of a reply: a call, a fragment of the call syntax, a raw value, or any text."""
    # A call of echo with any text: what the tool returns reaches the message as it is.
    echoes = (ANY_TEXT | st.just("a\ud800")).map(lambda text: call("echo", {"text": text}))
    return st.one_of(json_calls(), echoes, st.sampled_from(FRAGMENTS), raw_values(), ANY_TEXT)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(reply_parts(), max_size=12).map("".join))
def test_property_no_reply_breaks_the_parser_or_a_step(reply):
    calls = parse_tool_calls(reply)
    assert all(isinstance(c, (ToolCall, MalformedToolCall)) for c in calls)
    # What is wrong is said in a few words, never by quoting the body back.
    assert all(len(c.error) < 250 for c in calls if isinstance(c, MalformedToolCall))
    result = Tools([echo, tally, power_of_ten], timeout_s=5.0)().step(reply)
    assert isinstance(result, StepResult) and result.done == (not calls)
    assert result.tool_calls == len(calls) == len(result.messages)
    for message in result.messages:
        message["name"].encode("utf-8")
        message["content"].encode("utf-8")


# ---------------------------------------------------------------- the chat template


@pytest.fixture(scope="module")
def qwen_tokenizer():
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    from lightning_offpolicy.demo.tiny_bpe import train_bpe_tokenizer

    corpus = [f"Compute {a} * {b}." for a in range(10) for b in range(10)] + ['{"name": "multiply"}']
    return train_bpe_tokenizer(corpus, vocab_size=320, chat_template=chat_template_utils.qwen2_5_chat_template)


def test_the_chat_template_shows_the_tools_schemas(qwen_tokenizer):
    tools = Tools([multiply, tool_fixtures.add_later])
    rendered = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 6 * 7."}], tools=tools.tools, tokenize=False, add_generation_prompt=True
    )
    listed = rendered.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == [
        get_json_schema(multiply),
        get_json_schema(tool_fixtures.add_later),
    ]
    assert rendered.endswith("<|im_start|>user\nCompute 6 * 7.<|im_end|>\n<|im_start|>assistant\n")


def test_a_call_rendered_by_the_template_parses_back_and_its_result_renders(qwen_tokenizer):
    arguments = {"a": 6, "b": 7}
    tool_calls = [{"type": "function", "function": {"name": "multiply", "arguments": arguments}}]
    messages = [
        {"role": "user", "content": "Compute 6 * 7."},
        {"role": "assistant", "content": "", "tool_calls": tool_calls},
    ]
    tools = Tools([multiply])
    prompt = qwen_tokenizer.apply_chat_template(
        messages[:1], tools=tools.tools, tokenize=False, add_generation_prompt=True
    )
    rendered = qwen_tokenizer.apply_chat_template(messages, tools=tools.tools, tokenize=False)
    assert rendered.startswith(prompt)
    turn = rendered[len(prompt) :].removesuffix("\n").removesuffix("<|im_end|>")
    # What the runner hands to step: the sampled ids (stop token left out), decoded with special tokens kept.
    reply = qwen_tokenizer.decode(qwen_tokenizer(turn).input_ids, skip_special_tokens=False)
    assert reply == turn and "<tool_call>" in reply
    assert parse_tool_calls(reply) == [ToolCall("multiply", arguments)]
    result = tools().step(reply)
    assert result.messages == [{"role": "tool", "name": "multiply", "content": "42"}]
    with_result = qwen_tokenizer.apply_chat_template(messages + result.messages, tools=tools.tools, tokenize=False)
    assert with_result == rendered + "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"


def test_a_tool_result_holding_a_lone_surrogate_renders_through_the_template(qwen_tokenizer):
    def lone_surrogate(x: int) -> str:
        """Return text holding a lone surrogate.

        Args:
            x: Ignored.
        """
        return "a\ud800b"

    tools = Tools([lone_surrogate])
    result = tools().step(call("lone_surrogate", {"x": 1}))
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "ok"}, *result.messages]
    ids = qwen_tokenizer.apply_chat_template(messages, tools=tools.tools, tokenize=True)
    assert "<tool_response>\na\ufffdb\n</tool_response>" in qwen_tokenizer.decode(ids)
