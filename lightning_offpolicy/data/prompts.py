"""What a prompt is (a text or a chat ``messages`` list), and its ids under any tokenizer-like object.

:func:`encode_prompt` follows the tokenizer's own rule, as TRL and vLLM do: its ``encode_prompt``
where it has one (:class:`~lightning_offpolicy.data.tokenizers.CharTokenizer`,
:class:`~lightning_offpolicy.data.tokenizers.HFTokenizer`); for a raw ``transformers`` tokenizer,
``tokenizer(text)`` for a text and ``apply_chat_template(messages, add_generation_prompt=True)`` for
a chat prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatMessages", "Prompt", "chat_ids", "checked_messages", "encode_prompt", "encode_prompts", "ids_to_list"]

#: A chat prompt: ``[{"role": "system" | "user" | "assistant", "content": ...}, ...]``.
ChatMessages = list[dict[str, Any]]


#: What a prompt may be: a text, or a chat ``messages`` list (rendered by the tokenizer's chat template).
Prompt = str | ChatMessages


def ids_to_list(ids: Any) -> list[int]:
    """Accept a list / tuple / 1-D tensor / numpy array of ids."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def checked_messages(prompt: Any, who: str) -> ChatMessages:
    """``prompt`` as a chat ``messages`` list; ``TypeError`` / ``ValueError`` naming ``who`` and the bad entry."""
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(
            f"{who}: a prompt must be a text or a list of chat messages ({{'role': ..., 'content': ...}}), "
            f"got {type(prompt).__name__}."
        )
    if not prompt:
        raise ValueError(f"{who}: the chat prompt is an empty list of messages.")
    for index, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(
                f"{who}: message {index} of the chat prompt is {message!r}; every message needs a 'role' (str) and "
                "a 'content'."
            )
    return [dict(m) for m in prompt]


def chat_ids(tokenizer: Any, messages: ChatMessages) -> list[int]:
    """``apply_chat_template(messages, add_generation_prompt=True)``'s ids (a list in transformers 4, a dict in 5)."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(rendered, Mapping):
        rendered = rendered["input_ids"]
    return ids_to_list(rendered)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Ids of ``prompt`` with any tokenizer-like object, by that tokenizer's own rule.

    Uses its ``encode_prompt`` when it has one (:class:`CharTokenizer`, :class:`HFTokenizer`); a raw
    ``transformers`` tokenizer encodes a text as ``tokenizer(text)`` and a ``messages`` list with
    ``apply_chat_template(..., add_generation_prompt=True)``; anything else as ``tokenizer.encode(text)``.
    """
    if hasattr(tokenizer, "encode_prompt"):
        return list(tokenizer.encode_prompt(prompt))
    is_hf = hasattr(tokenizer, "apply_chat_template")
    if not isinstance(prompt, str):
        if not is_hf:
            raise TypeError(
                f"encode_prompt: {type(tokenizer).__name__} cannot render a chat prompt (messages); use "
                "lightning_offpolicy.data.tokenizers.HFTokenizer or a transformers tokenizer with a chat template."
            )
        return chat_ids(tokenizer, checked_messages(prompt, "encode_prompt"))
    if is_hf:
        return ids_to_list(tokenizer(prompt)["input_ids"])
    return list(tokenizer.encode(prompt))


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """:func:`encode_prompt` of each prompt, batched where the tokenizer can (one call for many texts).

    The ids are those :func:`encode_prompt` gives one prompt at a time.
    """
    batched = getattr(tokenizer, "encode_prompts", None)
    if callable(batched):
        return [list(ids) for ids in batched(prompts)]
    prompts = list(prompts)
    if prompts and hasattr(tokenizer, "apply_chat_template") and all(isinstance(p, str) for p in prompts):
        batch = tokenizer(prompts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return [ids_to_list(ids) for ids in batch]
    return [encode_prompt(tokenizer, p) for p in prompts]
