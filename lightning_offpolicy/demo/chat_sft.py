"""Supervised warm-up on whole conversations: loss on the assistant's turns only.

A multi-turn task (a tool call, the tool's result, a final answer; a guess, the environment's
feedback, the next guess) is warmed up on solved episodes written as chat messages. The
conversation is tokenized the way an episode is built at rollout time (docs/multi_turn.md): the
chat template renders it, and it is cut into segments at the start and end of each assistant turn;
each segment is tokenized on its own. Each assistant turn's tokens, from the first token after the
generation prompt (``<|im_start|>assistant\\n``) up to and including the turn's ``<|im_end|>``, carry
loss; everything else (system and user turns, tool results, the template's glue such as the newline
after ``<|im_end|>``) carries none, as in RL, where those tokens are the environment's.

    >>> ids, mask = conversation_ids(tokenizer, messages, tools=[multiply])      # doctest: +SKIP
    >>> sft_on_conversations(model, tokenizer, conversations, steps=300, tools=[multiply])  # doctest: +SKIP
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lightning_offpolicy.argcheck import is_int

__all__ = ["conversation_ids", "masked_sft_step", "play_held_out", "sft_on_conversations"]


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[Callable] | None, prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, add_generation_prompt=prompt, tokenize=False
    )


def conversation_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[Callable] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (1 on the assistant's tokens, 0 elsewhere).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template that ends each turn in its
            ``eos_token`` (ChatML: ``<|im_end|>``) and renders a prefix of a conversation as a prefix of
            the whole (appending a message does not change how earlier ones render).
        messages: the conversation, as ``apply_chat_template`` takes it; it must not start with an
            assistant turn (there would be no prompt to condition on).
        tools: tool functions shown to the model (``apply_chat_template(..., tools=tools)``).

    Returns:
        ``(ids, mask)`` of equal length. The trailing glue after the last assistant turn is left out.

    Raises:
        ValueError: The conversation starts with an assistant turn, the template is not prefix-preserving
            for it, or an assistant turn does not end in the tokenizer's ``eos_token``.
    """
    eos = tokenizer.eos_token
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the rendered text already turned into ids
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if index == 0:
            raise ValueError(
                "conversation_ids: the conversation starts with an assistant turn; start it with the prompt (a "
                "user turn, after an optional system turn)."
            )
        before = _render(tokenizer, messages[:index], tools, prompt=True)
        after = _render(tokenizer, messages[: index + 1], tools, prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            raise ValueError(
                f"conversation_ids: the chat template renders message {index} so that an earlier part of the "
                "conversation changes; it must be prefix-preserving (each message appended after the rendering "
                "of those before it, the assistant's after the generation prompt)."
            )
        turn = after[len(before) :]
        end = turn.find(eos)
        if end < 0:
            raise ValueError(
                f"conversation_ids: assistant message {index} renders as {turn!r}, which does not hold the "
                f"tokenizer's eos_token {eos!r}; set `tokenizer.eos_token` to the template's end-of-turn token."
            )
        turn = turn[: end + len(eos)]
        for text, trained in ((before[len(done) :], 0), (turn, 1)):
            piece = tokenizer(text, add_special_tokens=False).input_ids if text else []
            ids.extend(piece)
            mask.extend([trained] * len(piece))
        done = before + turn
    return ids, mask


def _shared_prefix(rows: Sequence[tuple[list[int], list[int]]]) -> int:
    """Length of the longest prefix of ids every row shares and no row trains on, keeping each row's
    last untrained token out of it (its logits predict the first trained token)."""
    limit = min((mask.index(1) if 1 in mask else len(ids)) for ids, mask in rows) - 1
    first = rows[0][0]
    length = 0
    while length < limit and all(ids[length] == first[length] for ids, _ in rows):
        length += 1
    return length


def masked_sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[tuple[list[int], list[int]]],
    pad_token_id: int,
) -> float:
    """One teacher-forced cross-entropy step on ``(ids, mask)`` rows, right-padded; loss where mask is 1.

    The loss is the mean over all masked tokens of the batch. The prefix all rows share (a chat
    template's system turn with its tool list) runs once, and its keys and values are repeated for
    every row: the same loss and gradients as running each row whole, several times faster when the
    shared prefix is most of the sequence. Returns the step's loss.
    """
    device = next(model.parameters()).device
    shared = _shared_prefix(rows)
    past = None
    if shared:
        past = model(input_ids=torch.tensor([rows[0][0][:shared]], device=device), use_cache=True).past_key_values
        past.batch_repeat_interleave(len(rows))
    length = max(len(ids) for ids, _ in rows) - shared
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), shared + length), dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, mask) in enumerate(rows):
        sequence = torch.tensor(ids[shared:])
        input_ids[row, : len(sequence)] = sequence
        attention_mask[row, : len(ids)] = 1
        trained = torch.tensor(mask[shared:], dtype=torch.bool)
        labels[row, : len(sequence)] = torch.where(trained, sequence, -100)
    input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past).logits
    if logits.element_size() < 4:  # half precision: the softmax in float32
        logits = logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def sft_on_conversations(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Sequence[Sequence[dict[str, Any]]],
    steps: int,
    tools: Sequence[Callable] | None = None,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    lr_schedule: Literal["constant", "cosine"] = "constant",
) -> list[float]:
    """Supervised warm-up on whole conversations, loss on the assistant's tokens only (:func:`conversation_ids`).

    Args:
        model: a causal LM; trained in place and left in eval mode.
        tokenizer: its tokenizer, with a chat template (see :func:`conversation_ids`).
        conversations: solved episodes as chat messages, each with at least one assistant turn.
        steps: optimizer steps (0: none).
        tools: tool functions rendered into each conversation's system turn.
        batch_size: conversations per step, drawn with replacement (seeded).
        lr: AdamW learning rate (no weight decay).
        seed: seed of the batch draws.
        lr_schedule: ``"constant"``, or ``"cosine"``: from ``lr`` down to 0 over ``steps`` (half a cosine).

    Returns:
        The loss of every step.

    Raises:
        ValueError: ``steps`` or ``batch_size`` is not a valid int, ``conversations`` is empty while
            ``steps > 0``, or a conversation has no assistant turn.
    """
    if not is_int(steps) or steps < 0:
        raise ValueError(f"sft_on_conversations: steps={steps!r} must be an int >= 0.")
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"sft_on_conversations: batch_size={batch_size!r} must be an int >= 1.")
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"sft_on_conversations: lr_schedule={lr_schedule!r}; allowed: 'constant', 'cosine'.")
    if steps and not conversations:
        raise ValueError("sft_on_conversations: `conversations` is empty; give solved episodes to train on.")
    encoded = [conversation_ids(tokenizer, messages, tools) for messages in conversations]
    for index, (_, mask) in enumerate(encoded):
        if not any(mask):
            raise ValueError(f"sft_on_conversations: conversation {index} has no assistant turn to train on.")
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        if lr_schedule == "cosine":
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        losses.append(masked_sft_step(model, optimizer, [rng.choice(encoded) for _ in range(batch_size)], pad))
    model.eval()
    return losses


def play_held_out(
    model: torch.nn.Module,
    tokenizer: Any,
    episodes: Any,
    samples: Sequence[tuple[Any, dict[str, Any]]],
    max_new_tokens: int,
    greedy: bool,
    seed: int,
) -> list[Any]:
    """One episode per ``(prompt, metadata)`` sample, played by the kit's runner on an :class:`HFEngine`
    holding ``model`` (a ChatML model: turns end at ``<|im_end|>`` or ``<|endoftext|>``).

    Args:
        model: the checkpoint's model.
        tokenizer: its tokenizer, with a chat template.
        episodes: the :class:`~lightning_offpolicy.rollout.multi_turn.EpisodeSettings` of the task.
        samples: the held-out prompts and their metadata.
        max_new_tokens: most tokens per turn.
        greedy: greedy decoding; False samples at temperature 1, seeded with ``seed``.
        seed: seed of the sampling.

    Returns:
        The episodes, in the order of ``samples``.
    """
    from lightning_offpolicy.rollout.engine import SamplingConfig
    from lightning_offpolicy.rollout.hf.engine import HFEngine
    from lightning_offpolicy.rollout.multi_turn import EpisodeRunner

    end_of_turn, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    engine = HFEngine(
        dtype="float32", pad_token_id=end_of_text, eos_token_id=end_of_turn, stop_token_ids=[end_of_turn, end_of_text]
    )
    engine.update_weights(model, 0)
    try:
        runner = EpisodeRunner(episodes, tokenizer, engine.stop_ids)
        prompts, metadata = [p for p, _ in samples], [m for _, m in samples]
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, samples_per_prompt=1, greedy=greedy)
        return runner.run(prompts, metadata, runner.prompt_ids(prompts), sampling, engine.generate, seed, 0)
    finally:
        engine.close()
