"""A character-level tokenizer: the built-in tasks and their ``tiny:`` checkpoints are trained with it."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterable
from pathlib import Path

from lightning_offpolicy.data.prompts import Prompt, ids_to_list

__all__ = ["CHAR_TOKENIZER_FILE", "DEFAULT_ALPHABET", "UNKNOWN_CHAR", "CharTokenizer"]

#: Digits, lowercase letters, space and the symbols of the built-in tasks (3 specials + 45 = 48 ids).
DEFAULT_ALPHABET: str = string.digits + string.ascii_lowercase + " +-*=,.:?"


#: The file :meth:`CharTokenizer.save_pretrained` writes; its presence marks a char-tokenizer directory.
CHAR_TOKENIZER_FILE = "char_tokenizer.json"


#: What :meth:`CharTokenizer.decode` writes for an id outside the tokenizer's vocabulary.
UNKNOWN_CHAR = "\ufffd"


_PAD, _BOS, _EOS = "<pad>", "<bos>", "<eos>"
_NUM_SPECIAL = 3


class CharTokenizer:
    """Character-level tokenizer: ``pad=0``, ``bos=1``, ``eos=2``, then one id per character.

    Args:
        alphabet: the characters, in id order (the first gets id 3). Must not repeat a character.
    """

    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError("CharTokenizer: `alphabet` must be a non-empty string.")
        if UNKNOWN_CHAR in alphabet:
            raise ValueError("CharTokenizer: `alphabet` must not contain U+FFFD (the unknown-id marker).")
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if repeated:
            raise ValueError(f"CharTokenizer: `alphabet` repeats the characters {repeated!r}.")
        self.alphabet = alphabet
        self._char_to_id = {c: i + _NUM_SPECIAL for i, c in enumerate(alphabet)}
        self._id_to_char = {i: c for c, i in self._char_to_id.items()}
        self.pad_token, self.bos_token, self.eos_token = _PAD, _BOS, _EOS

    @property
    def vocab_size(self) -> int:
        """Number of ids: 3 specials + one per character."""
        return _NUM_SPECIAL + len(self.alphabet)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.pad_token_id, self.bos_token_id, self.eos_token_id))

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Ids of ``text`` (with ``bos`` first when ``add_bos``). Unknown characters raise ValueError."""
        ids = [self.bos_token_id] if add_bos else []
        for position, char in enumerate(text):
            try:
                ids.append(self._char_to_id[char])
            except KeyError:
                raise ValueError(
                    f"CharTokenizer: character {char!r} (position {position} of {text!r}) is not in the "
                    f"alphabet {self.alphabet!r}."
                ) from None
        return ids

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Ids of a text prompt, bos first (what the built-in tasks and ``tiny:`` checkpoints expect).

        A chat ``messages`` list raises ``TypeError``: a character tokenizer has no chat template.
        """
        if not isinstance(prompt, str):
            raise TypeError(
                f"CharTokenizer.encode_prompt: got a {type(prompt).__name__} prompt, expected a text. Chat prompts "
                "(`messages` lists) need a tokenizer with a chat template: use "
                "lightning_offpolicy.data.tokenizers.HFTokenizer with a model whose tokenizer defines one."
            )
        return self.encode(prompt, add_bos=True)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; does not stop at ``eos``. Special ids are dropped when ``skip_special_tokens``,
        else written as ``<pad>``, ``<bos>``, ``<eos>``. Ids the alphabet does not cover (a model's
        embedding is often larger than the tokenizer) decode to ``UNKNOWN_CHAR`` (U+FFFD), so a sampled
        stray id never crashes a rollout; it simply scores as a wrong character."""
        names = {self.pad_token_id: _PAD, self.bos_token_id: _BOS, self.eos_token_id: _EOS}
        out = []
        for i in ids_to_list(ids):
            if i in names:
                if not skip_special_tokens:
                    out.append(names[i])
            elif i in self._id_to_char:
                out.append(self._id_to_char[i])
            else:
                out.append(UNKNOWN_CHAR)
        return "".join(out)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``char_tokenizer.json`` into ``directory`` (created if missing); returns the file."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHAR_TOKENIZER_FILE
        spec = {
            "type": "CharTokenizer",
            "alphabet": self.alphabet,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        path.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> CharTokenizer:
        """Load from a directory holding ``char_tokenizer.json`` (or the file itself)."""
        path = Path(directory)
        if path.is_dir():
            path = path / CHAR_TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"CharTokenizer: no {CHAR_TOKENIZER_FILE} at {path}.")
        spec = json.loads(path.read_text(encoding="utf-8"))
        if spec.get("type", "CharTokenizer") != "CharTokenizer" or "alphabet" not in spec:
            raise ValueError(f"CharTokenizer: {path} does not describe a CharTokenizer.")
        return cls(spec["alphabet"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(("CharTokenizer", self.alphabet))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"
