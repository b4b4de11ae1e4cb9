"""A small tool-calling episode loop on ``model.generate``, to measure a checkpoint's tool-use success.

It plays episodes the way the rollout's multi-turn runner does (docs/multi_turn.md), batched and
without an engine: the prompt rendered by the chat template with the tools; each model turn
sampled until its stop token; a ``<tool_call>{json}</tool_call>`` in the turn executed and its
result appended as a ``tool`` message rendered by the template; a turn without a call ends the
episode. It is what the demo builder uses to report a warm-up's greedy and sampled success.

    >>> episodes = play_tool_episodes(model, tokenizer, ["What is 48213 * 7261?"], tools=[multiply])  # doctest: +SKIP
    >>> episodes[0].turns, episodes[0].truncated                                                      # doctest: +SKIP
    (['<tool_call>\\n{"name": "multiply", ...}\\n</tool_call>', '48213 * 7261 = 350074593.'], False)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Episode", "parse_tool_calls", "play_tool_episodes", "tool_message"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class Episode:
    """One played episode.

    Attributes:
        turns: the decoded text of each model turn, its stop token left out.
        truncated: whether a limit ended it (``max_turns``, or a turn that hit ``max_new_tokens``).
        tool_calls: the tool calls it made.
        tool_errors: of those, how many failed (malformed, unknown tool, raised).
    """

    turns: list[str] = field(default_factory=list)
    truncated: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


def parse_tool_calls(text: str) -> list[Any]:
    """The JSON bodies of the ``<tool_call>...</tool_call>`` blocks of ``text`` (a body that is not JSON: ``None``)."""
    calls: list[Any] = []
    for body in _CALL.findall(text):
        try:
            calls.append(json.loads(body))
        except ValueError:
            calls.append(None)
    return calls


def tool_message(call: Any, tools: Sequence[Callable]) -> tuple[dict[str, Any], bool]:
    """Run one parsed call; returns the ``tool`` message with its result (or the error's text) and whether it failed."""
    by_name = {tool.__name__: tool for tool in tools}
    name = call.get("name") if isinstance(call, dict) else None
    arguments = call.get("arguments") if isinstance(call, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return {"role": "tool", "name": str(name), "content": "Error: malformed tool call."}, True
    if name not in by_name:
        return {"role": "tool", "name": name, "content": f"Error: unknown tool {name!r}."}, True
    try:
        return {"role": "tool", "name": name, "content": str(by_name[name](**arguments))}, False
    except Exception as error:  # a tool's failure is the model's to read, as at rollout time
        return {"role": "tool", "name": name, "content": f"Error: {type(error).__name__}: {error}"}, True


def _glue_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[Callable]) -> list[int]:
    """Ids of the text the template puts between the end of an assistant turn (its ``eos_token``) and
    the next generation prompt, for environment ``messages`` (rendered after a placeholder turn)."""
    head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    base = tokenizer.apply_chat_template(head, tools=list(tools), tokenize=False)
    full = tokenizer.apply_chat_template(head + messages, tools=list(tools), add_generation_prompt=True, tokenize=False)
    cut = base.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)
    return tokenizer(full[cut:], add_special_tokens=False).input_ids


@torch.no_grad()
def _generate(
    model: torch.nn.Module, contexts: list[list[int]], max_new_tokens: int, greedy: bool, pad: int, stops: list[int]
) -> list[tuple[list[int], int | None]]:
    """One turn for each context (left-padded batch); returns each turn's ids up to its stop token
    (left out) and that stop token (``None``: the turn hit ``max_new_tokens``)."""
    length = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), length), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(contexts):
        input_ids[row, length - len(ids) :] = torch.tensor(ids)
        attention_mask[row, length - len(ids) :] = 1
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=stops,
        **sampling,
    )[:, length:]
    turns = []
    for row in out.tolist():
        stop = next((i for i, token in enumerate(row) if token in stops), None)
        turns.append((row, None) if stop is None else (row[:stop], row[stop]))
    return turns


def play_tool_episodes(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    tools: Sequence[Callable],
    greedy: bool = True,
    max_turns: int = 3,
    max_new_tokens: int = 48,
    batch_size: int = 100,
    seed: int = 0,
) -> list[Episode]:
    """Play one tool-calling episode per prompt.

    Args:
        model: a causal LM whose tokenizer has a chat template with a tool branch (Qwen2.5's).
        tokenizer: its tokenizer; ``eos_token`` ends a turn (``<|im_end|>``), ``pad_token`` pads.
        prompts: the user questions.
        tools: the tool functions, shown to the model and run on its calls.
        greedy: greedy decoding; False samples at temperature 1 with no top-k / top-p cut.
        max_turns: model turns at most; an episode still calling tools after them is truncated.
        max_new_tokens: tokens of one turn at most; a turn that hits it truncates its episode.
        batch_size: episodes generated together.
        seed: seed of the sampling (the global RNG state is left untouched).

    Returns:
        One :class:`Episode` per prompt, in order.
    """
    stops = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    episodes = [Episode() for _ in prompts]
    contexts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tools=list(tools), add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    ids = [tokenizer(text, add_special_tokens=False).input_ids for text in contexts]
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            active = list(range(len(prompts)))
            for turn in range(max_turns):
                next_active = []
                for begin in range(0, len(active), batch_size):
                    chunk = active[begin : begin + batch_size]
                    results = _generate(model, [ids[i] for i in chunk], max_new_tokens, greedy, pad, stops)
                    for i, (turn_ids, stop) in zip(chunk, results, strict=True):
                        episode = episodes[i]
                        text = tokenizer.decode(turn_ids, skip_special_tokens=False)
                        episode.turns.append(text)
                        calls = parse_tool_calls(text)
                        if stop is None:
                            episode.truncated = True
                        elif calls and turn + 1 == max_turns:
                            episode.truncated = True
                        elif calls:
                            messages = []
                            for call in calls:
                                message, failed = tool_message(call, tools)
                                messages.append(message)
                                episode.tool_calls += 1
                                episode.tool_errors += int(failed)
                            ids[i] = ids[i] + turn_ids + [stop] + _glue_ids(tokenizer, messages, tools)
                            next_active.append(i)
                active = next_active
                if not active:
                    break
    finally:
        model.train(was_training)
    return episodes
