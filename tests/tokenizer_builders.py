"""Real Hugging Face tokenizers built locally with ``tokenizers`` (no download), for the tokenization tests.

Each builder saves a ``PreTrainedTokenizerFast`` with ``save_pretrained`` so tests load it the way
a user does, through ``HFTokenizer(dir)`` / ``AutoTokenizer``.
"""

from __future__ import annotations

from pathlib import Path

from lightning_offpolicy.data.tokenizers import DEFAULT_ALPHABET

#: The char-level vocabulary: 3 specials, then one id per character of the built-in tasks' alphabet.
CHAR_VOCAB: dict[str, int] = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(DEFAULT_ALPHABET)}
BOS_ID, EOS_ID = CHAR_VOCAB["<s>"], CHAR_VOCAB["</s>"]

#: A small chat template over the char alphabet: ``"u: hi.a:"`` for one user message + generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
#: The same with the bos token written by the template itself (as Llama 3's does).
CHAT_TEMPLATE_WITH_BOS = "{{ bos_token }}" + CHAT_TEMPLATE


def char_ids(text: str) -> list[int]:
    """Hand reference: one id per character."""
    return [CHAR_VOCAB[c] for c in text]


def save_char_tokenizer(
    directory: Path, bos_rule: bool = False, chat_template: str | None = None, pad: bool = True
) -> Path:
    """A char-level ``PreTrainedTokenizerFast`` with bos ``<s>`` / eos ``</s>``.

    ``bos_rule=False``: its rule adds no special token (``tokenizer("ab")`` is the 2 char ids), like
    the tokenizer of issue 10; ``True``: a ``TemplateProcessing`` post-processor puts ``<s>`` in front.
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer(models.WordLevel(CHAR_VOCAB, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    if bos_rule:
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>" if pad else None
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return Path(directory)


def save_gpt2_style_tokenizer(directory: Path) -> tuple[Path, object]:
    """A byte-level BPE trained here, whose bos, eos and unk are all ``<|endoftext|>`` (as GPT-2's).

    Returns the directory and the raw ``tokenizers.Tokenizer`` (an independent reference encoder).
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(["the copy of the first letter", "hello world", "abc: a", "reverse this"] * 20, trainer)
    special = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=special, eos_token=special, unk_token=special)
    fast.save_pretrained(str(directory))
    return Path(directory), raw
