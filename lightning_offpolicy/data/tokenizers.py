"""Tokenizers with one small API: a character-level one for the built-in tasks, an adapter for HF.

Both expose ``encode_prompt(prompt) -> list[int]`` (the ids a prompt is generated from: a text, or
for :class:`HFTokenizer` a chat ``messages`` list), ``encode(text, add_bos=...)``,
``decode(ids, skip_special_tokens=True)``, ``vocab_size``, ``pad_token_id`` / ``bos_token_id`` /
``eos_token_id``, ``save_pretrained(dir)`` and ``from_pretrained(dir)``; :func:`load_tokenizer`
picks the right one for a model directory, and :func:`encode_prompt` encodes a prompt with any
tokenizer-like object (these two, a raw ``transformers`` tokenizer, or one with only ``encode``).
:class:`CharTokenizer` lives in :mod:`~lightning_offpolicy.data.char_tokenizer` and prompt encoding in
:mod:`~lightning_offpolicy.data.prompts`; both are importable from here.

Prompt encoding follows the tokenizer, as TRL and vLLM do: :class:`HFTokenizer` encodes a text as
``tokenizer(text)`` (the tokenizer's own special-token rule: a bos only where that rule adds one),
and a chat prompt as ``apply_chat_template(messages, add_generation_prompt=True)``;
``HFTokenizer(add_bos=True / False)`` overrides the rule. :class:`CharTokenizer` always puts its
bos in front (the built-in tasks and their ``tiny:`` checkpoints are trained that way).

>>> tok = CharTokenizer()
>>> ids = tok.encode_prompt("12+34=")
>>> ids[0] == tok.bos_token_id
True
>>> tok.decode(ids + [tok.eos_token_id])
'12+34='
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from lightning_offpolicy.data.char_tokenizer import CHAR_TOKENIZER_FILE, DEFAULT_ALPHABET, UNKNOWN_CHAR, CharTokenizer
from lightning_offpolicy.data.prompts import (
    ChatMessages,
    Prompt,
    chat_ids,
    checked_messages,
    encode_prompt,
    encode_prompts,
    ids_to_list,
)

__all__ = [
    "DEFAULT_ALPHABET",
    "UNKNOWN_CHAR",
    "CHAR_TOKENIZER_FILE",
    "ChatMessages",
    "Prompt",
    "CharTokenizer",
    "HFTokenizer",
    "checked_messages",
    "encode_prompt",
    "encode_prompts",
    "load_tokenizer",
]


#: The files ``save_pretrained`` writes for a Hugging Face tokenizer's vocabulary (fast, BPE, WordPiece,
#: SentencePiece); a directory with none of them holds no vocabulary.
TOKENIZER_VOCAB_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
#: Every file a saved tokenizer may consist of (settings and special tokens included).
TOKENIZER_FILES: tuple[str, ...] = (
    *TOKENIZER_VOCAB_FILES,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
#: Encoded once at load: a tokenizer without a vocabulary encodes it to no ids at all.
_PROBE_TEXT = "Hello world 123"


class HFTokenizer:
    """The same API over ``transformers.AutoTokenizer`` (local paths; no download is forced here).

    Prompts are encoded by the tokenizer's own rule, as TRL and vLLM do: a text as ``tokenizer(text)``
    (``add_special_tokens=True``: a bos in front only when that rule adds one), a chat prompt
    (a ``messages`` list, or any text with ``chat_template=True``) as
    ``apply_chat_template(messages, add_generation_prompt=True)``. ``add_bos`` overrides the bos
    part of either. ``pad_token_id`` falls back to ``eos_token_id`` when the tokenizer has no pad
    token.

    Args:
        path: The tokenizer's directory (or a hub name ``AutoTokenizer.from_pretrained`` accepts).
            ``None``: the model's directory, loaded by ``OffPolicyRLModule`` when it loads the model
            (so a YAML config sets the options below without repeating the path).
        add_bos: ``"auto"``: the tokenizer's own rule decides; ``True``: exactly one bos in front of
            every prompt (never two); ``False``: no bos in front.
        chat_template: Render text prompts through the tokenizer's chat template too (as one user
            message); the tokenizer must define a template.
        system_prompt: System message put before every chat-rendered prompt (a ``messages`` prompt
            that has its own system message is an error). Needs chat prompts: ``messages`` lists
            or ``chat_template=True``.
        **kwargs: Passed on to ``AutoTokenizer.from_pretrained``.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        add_bos: bool | Literal["auto"] = "auto",
        chat_template: bool = False,
        system_prompt: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not (add_bos is True or add_bos is False or add_bos == "auto"):
            raise ValueError(
                f"HFTokenizer.add_bos={add_bos!r} is not allowed: use 'auto' (the tokenizer's own rule), true "
                "(exactly one bos in front) or false (none)."
            )
        if not isinstance(chat_template, bool):
            raise ValueError(f"HFTokenizer.chat_template={chat_template!r} must be true or false.")
        if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt):
            raise ValueError(f"HFTokenizer.system_prompt={system_prompt!r} must be a non-empty string or None.")
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.load_kwargs = kwargs
        self.path: str | None = None
        self._tokenizer: Any = None
        if path is not None:
            self.load(path)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> HFTokenizer:
        return cls(path, **kwargs)

    # ------------------------------------------------------------------------------ loading
    @property
    def loaded(self) -> bool:
        """Whether the tokenizer files are loaded (``path=None`` defers that to :meth:`load`)."""
        return self._tokenizer is not None

    def load(self, path: str | os.PathLike) -> HFTokenizer:
        """Load the tokenizer at ``path`` (``OffPolicyRLModule`` calls it with the model's directory)."""
        from transformers import AutoTokenizer

        if (Path(path) / CHAR_TOKENIZER_FILE).is_file():
            raise ValueError(
                f"HFTokenizer: {str(path)!r} holds a CharTokenizer ({CHAR_TOKENIZER_FILE}, e.g. a `tiny:` checkpoint), "
                "not a Hugging Face tokenizer: leave `tokenizer` unset (it is loaded from the model's directory) or "
                "use lightning_offpolicy.data.tokenizers.CharTokenizer."
            )
        local = Path(path).is_dir()
        if not local:
            from lightning_offpolicy.preflight import check_hub_model

            # A hub name that cannot be fetched fails now, not after a minute of the hub client's retries.
            check_hub_model(str(path), "HFTokenizer.path", files=("tokenizer_config.json", "tokenizer.json"))
        files = _tokenizer_files(Path(path)) if local else []
        if local and not files:
            raise FileNotFoundError(_missing_tokenizer_message(Path(path), "holds no tokenizer files"))
        no_vocab = local and not _has_vocab_file(files)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **self.load_kwargs)
        except (OSError, ValueError) as err:
            if not no_vocab:
                raise
            what = f"has no vocabulary: transformers could not build a tokenizer from its settings ({err})"
            raise ValueError(_missing_tokenizer_message(Path(path), what)) from err
        if no_vocab and not tokenizer(_PROBE_TEXT)["input_ids"]:
            # Settings without a vocabulary: transformers builds the model_type's tokenizer with special tokens only.
            what = (
                f"has no vocabulary: transformers built a tokenizer of {len(tokenizer)} ids that encodes "
                f"{_PROBE_TEXT!r} to none"
            )
            raise ValueError(_missing_tokenizer_message(Path(path), what))
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if self.add_bos is True and tokenizer.bos_token_id is None:
            raise ValueError(
                f"HFTokenizer.add_bos=True but the tokenizer at {str(path)!r} has no bos token: set add_bos to "
                "'auto' or false."
            )
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"HFTokenizer.chat_template=True but the tokenizer at {str(path)!r} defines no chat template: set "
                "chat_template to false, or give the tokenizer a template (tokenizer.chat_template = '...'; "
                "save_pretrained)."
            )
        self.path, self._tokenizer = str(path), tokenizer
        return self

    @property
    def tokenizer(self) -> Any:
        """The wrapped ``transformers`` tokenizer."""
        if self._tokenizer is None:
            raise RuntimeError(
                "HFTokenizer(path=None) is not loaded yet: OffPolicyRLModule loads it from the model's directory "
                "when it loads the model (configure_model); elsewhere pass `path` or call .load(path)."
            )
        return self._tokenizer

    # ------------------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (``len(tokenizer)``)."""
        return len(self.tokenizer)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    # ------------------------------------------------------------------------------ encoding
    def encode(self, text: str, add_bos: bool | Literal["auto"] | None = None) -> list[int]:
        """Ids of ``text`` by the tokenizer's own rule (``tokenizer(text)``), bos as ``add_bos`` says.

        ``add_bos``: ``None`` takes this tokenizer's ``add_bos`` setting; ``"auto"`` keeps the rule's
        choice; ``True`` makes it exactly one bos in front; ``False`` removes a bos in front.
        """
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode takes a text, got {type(text).__name__}; for chat use encode_prompt.")
        ids = [int(i) for i in self.tokenizer(text)["input_ids"]]
        return self._with_bos(ids, self.add_bos if add_bos is None else add_bos)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Ids a completion of ``prompt`` is generated from.

        A text is encoded by :meth:`encode` (or, with ``chat_template=True``, rendered as one user
        message); a ``messages`` list goes through ``apply_chat_template(messages,
        add_generation_prompt=True)`` with ``system_prompt`` put first. ``add_bos`` then applies.
        """
        if isinstance(prompt, str):
            if self.chat_template:
                return self._render_chat([{"role": "user", "content": prompt}])
            if self.system_prompt is not None:
                raise ValueError(
                    "HFTokenizer.system_prompt is set but the prompt is a plain text and chat_template=False, so it "
                    "would be ignored: set chat_template=True (text prompts rendered as chat) or drop system_prompt."
                )
            return self.encode(prompt)
        return self._render_chat(checked_messages(prompt, "HFTokenizer.encode_prompt"))

    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """:meth:`encode_prompt` of each prompt; plain texts are tokenized in one batched call."""
        prompts = list(prompts)
        if self.chat_template or self.system_prompt is not None or not all(isinstance(p, str) for p in prompts):
            return [self.encode_prompt(p) for p in prompts]
        if not prompts:
            return []
        batch = self.tokenizer(prompts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return [self._with_bos(ids if isinstance(ids, list) else ids_to_list(ids), self.add_bos) for ids in batch]

    def _render_chat(self, messages: ChatMessages) -> list[int]:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"HFTokenizer: a chat prompt (messages) needs a chat template, and the tokenizer at {self.path!r} "
                "has none: give it one (tokenizer.chat_template = '...'; save_pretrained) or use text prompts."
            )
        if self.system_prompt is not None:
            if messages[0]["role"] == "system":
                raise ValueError(
                    "HFTokenizer.system_prompt is set and the prompt already starts with a system message "
                    f"({messages[0]['content']!r}): drop one of them."
                )
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self._with_bos(chat_ids(tokenizer, messages), self.add_bos)

    def _with_bos(self, ids: list[int], add_bos: bool | Literal["auto"]) -> list[int]:
        if add_bos == "auto":
            return ids
        if add_bos is not True and add_bos is not False:
            raise ValueError(f"HFTokenizer.encode: add_bos={add_bos!r} must be None, 'auto', True or False.")
        bos = self.bos_token_id
        if bos is None:
            if add_bos:
                raise ValueError("HFTokenizer.encode: add_bos=True but the tokenizer has no bos token.")
            return ids
        while ids and ids[0] == bos:  # the rule's (or the template's) own bos, maybe repeated
            ids = ids[1:]
        return [bos, *ids] if add_bos else ids

    # ------------------------------------------------------------------------------ decoding
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids_to_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def save_pretrained(self, directory: str | os.PathLike) -> Any:
        return self.tokenizer.save_pretrained(str(directory))

    def __repr__(self) -> str:
        if not self.loaded:
            return f"HFTokenizer(path=None, add_bos={self.add_bos!r}, chat_template={self.chat_template})"
        return (
            f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, add_bos={self.add_bos!r}, "
            f"chat_template={self.chat_template})"
        )


def _tokenizer_files(directory: Path) -> list[str]:
    """The tokenizer files (:data:`TOKENIZER_FILES`, ``*.tiktoken``) in ``directory``."""
    found = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    return found + sorted(p.name for p in directory.glob("*.tiktoken"))


def _has_vocab_file(files: list[str]) -> bool:
    return any(name in TOKENIZER_VOCAB_FILES or name.endswith(".tiktoken") for name in files)


def _missing_tokenizer_message(directory: Path, what: str) -> str:
    """Why the tokenizer at ``directory`` is unusable, which files are missing, and what to do."""
    found = _tokenizer_files(directory)
    missing = []
    if not _has_vocab_file(found):
        missing.append("tokenizer.json (or a vocabulary file: vocab.json + merges.txt, vocab.txt, tokenizer.model)")
    if "tokenizer_config.json" not in found:
        missing.append("tokenizer_config.json")
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    holds = f"the directory holds {listed}" if names else "the directory is empty"
    return (
        f"HFTokenizer: {str(directory)!r} {what} (missing: {'; '.join(missing) or 'nothing known'}; {holds}), so "
        "every prompt would encode to no tokens. Save the model's tokenizer beside its weights "
        f"(tokenizer.save_pretrained({str(directory)!r}), with the tokenizer the model was trained with), or load "
        "it from elsewhere: in YAML model.tokenizer: {class_path: lightning_offpolicy.data.tokenizers.HFTokenizer, "
        "init_args: {path: <the tokenizer's directory or hub id>}}; in Python OffPolicyRLModule(tokenizer="
        "HFTokenizer(<path>))."
    )


def load_tokenizer(path: str | os.PathLike, **kwargs: Any) -> CharTokenizer | HFTokenizer:
    """:class:`CharTokenizer` when ``path`` holds ``char_tokenizer.json``, else :class:`HFTokenizer`.

    ``tiny:...`` model specs are not resolved here: pass the output of
    :func:`lightning_offpolicy.train.policy.resolve_model_spec`.
    """
    if (Path(path) / CHAR_TOKENIZER_FILE).is_file():
        return CharTokenizer.from_pretrained(path)
    return HFTokenizer(path, **kwargs)
