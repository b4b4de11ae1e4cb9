"""The token ids of an episode's context, rendered by the tokenizer's own chat template.

The model's turns are never rendered here: they stay the ids the engine sampled. What is rendered
is the prompt (with the tools the template shows the model) and, after each model turn, the
environment's messages together with the template's glue: the text the template puts between the
end of an assistant message and the next generation prompt. That glue is found as the difference
of two renderings, so it follows any template that renders a conversation as a prefix of its
continuation (docs/multi_turn.md, "Token in, token out").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_offpolicy.data.prompts import ChatMessages, Prompt, checked_messages, encode_prompt, ids_to_list

__all__ = ["ChatRenderer", "PlainRenderer", "renderer_for"]

#: Stand-ins for a user message and an assistant reply, to find where the template closes a reply.
_USER, _REPLY = "\u2063user\u2063", "\u2063reply\u2063"


class ChatRenderer:
    """Render prompts and environment messages of episodes with a tokenizer's chat template.

    Args:
        tokenizer: A ``transformers`` tokenizer with a chat template, or the kit's
            :class:`~lightning_offpolicy.data.tokenizers.HFTokenizer` (its ``system_prompt`` is put
            first in every prompt).
        tools: Functions the template shows the model (``apply_chat_template(tools=...)``).

    Raises:
        ValueError: The tokenizer has no chat template, or its template does not render a
            conversation as a prefix of the same conversation continued (the glue between turns
            cannot be told apart).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Callable[..., Any]] = ()) -> None:
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.system_prompt: str | None = getattr(tokenizer, "system_prompt", None)
        self.tools = list(tools)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"Multi-turn episodes render their turns with the tokenizer's chat template, and "
                f"{type(self.tokenizer).__name__} has none: give it one (tokenizer.chat_template = '...'; "
                "save_pretrained), or train single-turn (no rollout.episodes)."
            )
        self._closing = self._reply_closing()

    def _render(self, messages: ChatMessages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _with_system(self, messages: ChatMessages) -> ChatMessages:
        if self.system_prompt is None or messages[0]["role"] == "system":
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def _base(self) -> ChatMessages:
        return self._with_system([{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY}])

    def _reply_closing(self) -> str:
        """The text the template writes right after an assistant reply's content."""
        rendered = self._render(self._base(), add_generation_prompt=False)
        at = rendered.rfind(_REPLY)
        if at < 0:
            raise ValueError(
                "The chat template does not write an assistant message's content as given, so the episode's "
                "turns cannot be joined to what it renders; use a template that does."
            )
        return rendered[at + len(_REPLY) :]

    def encode(self, text: str) -> list[int]:
        """``text``'s ids without special tokens added (the template's own are in the text)."""
        return ids_to_list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written out (a reply as the model wrote it)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids the first turn is generated from: the prompt (a text is one user message) with the
        tools, and the generation prompt."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages = self._with_system(checked_messages(messages, "ChatRenderer.prompt_ids"))
        return self.encode(self._render(messages, add_generation_prompt=True))

    def observation_ids(self, messages: ChatMessages, stop_text: str) -> list[int]:
        """The ids that follow a model turn that ended with ``stop_text``: the rest of the template's
        closing of the reply, ``messages``, and the next generation prompt.

        Args:
            messages: The environment's messages (``role`` ``"tool"``, ``"user"``, ...).
            stop_text: The text of the stop token the turn ended with (``""``: none). When the
                template's closing starts with it (Qwen's ``<|im_end|>``), the rest follows it;
                otherwise the whole closing does.

        Raises:
            ValueError: The template renders the conversation continued by ``messages`` with a
                different beginning than the conversation itself.
        """
        base = self._base()
        before = self._render(base, add_generation_prompt=False)
        after = self._render(base + checked_messages(messages, "ChatRenderer.observation_ids"), True)
        if not after.startswith(before):
            raise ValueError(
                "The chat template renders a conversation differently once more messages follow it (it is not "
                "prefix-preserving), so what the environment appends cannot be rendered without re-rendering the "
                "model's own turns; use a template that renders each message independently of the ones after it."
            )
        closing = self._closing
        if stop_text and closing.startswith(stop_text):
            closing = closing[len(stop_text) :]
        return self.encode(closing + after[len(before) :])


class PlainRenderer:
    """Episodes without a chat template: a base model, or the kit's character tokenizer.

    The prompt is encoded by the tokenizer's own rule
    (:func:`~lightning_offpolicy.data.prompts.encode_prompt`); after a model turn, each message's
    content follows on a line of its own (``"\n" + content + "\n"``), with no role markers; a
    tokenizer that cannot encode a line break (the character tokenizer) separates by a space.

    Args:
        tokenizer: Anything :func:`~lightning_offpolicy.data.prompts.encode_prompt` takes, with
            ``decode`` (the kit's tokenizers, a ``transformers`` tokenizer).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tools: list[Callable[..., Any]] = []
        try:
            self.separator = "\n" if self.encode("\n") else " "
        except ValueError:  # the character tokenizer has no line break
            self.separator = " "

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, no bos or other special token added."""
        if hasattr(self.tokenizer, "apply_chat_template") or hasattr(self.tokenizer, "tokenizer"):
            raw = getattr(self.tokenizer, "tokenizer", self.tokenizer)
            return ids_to_list(raw(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer.encode(text, add_bos=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's ids by the tokenizer's own rule."""
        return encode_prompt(self.tokenizer, prompt)

    def observation_ids(self, messages: ChatMessages, stop_text: str) -> list[int]:
        """Each message's content on a line of its own (``stop_text`` is not needed here)."""
        return self.encode("".join(self.separator + message["content"] + self.separator for message in messages))


def renderer_for(tokenizer: Any, tools: Sequence[Callable[..., Any]] = ()) -> ChatRenderer | PlainRenderer:
    """The renderer of ``tokenizer``'s episodes: its chat template when it has one, else plain text.

    Raises:
        ValueError: ``tools`` are given and the tokenizer has no chat template (tools are shown to
            the model by the template).
    """
    raw = getattr(tokenizer, "tokenizer", tokenizer)
    if getattr(raw, "chat_template", None):
        return ChatRenderer(tokenizer, tools)
    if tools:
        raise ValueError(
            f"Tools are shown to the model by its tokenizer's chat template, and {type(raw).__name__} has none: "
            "use a model whose tokenizer has one (e.g. a Qwen2.5 instruct checkpoint), or an environment without "
            "tools (rollout.episodes.environment)."
        )
    return PlainRenderer(tokenizer)
