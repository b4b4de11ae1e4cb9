"""A tiny real-format checkpoint: a Qwen2 or Llama model built from a config, with a byte-level BPE
tokenizer trained locally on your task's text and a ChatML chat template.

It is what an ordinary Hugging Face checkpoint directory looks like (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a ``chat_template``), only small enough to train on a CPU in seconds. Nothing is downloaded.
The special tokens follow Qwen2.5-Instruct: no bos token, ``<|endoftext|>`` pads, ``<|im_end|>``
ends a turn, and the generation config stops on both (``eos_token_id: [<|im_end|>, <|endoftext|>]``).

    >>> from lightning_offpolicy.demo.tiny_bpe import build_bpe_checkpoint
    >>> texts = ["Calculate 5 - 3.", "2", "Calculate 7 + 1.", "8"]
    >>> path = build_bpe_checkpoint("/tmp/my-model", texts)          # doctest: +SKIP
    >>> # then in YAML:  model: {init_args: {model: /tmp/my-model}}

A short supervised warm-up on ``(prompt, answer)`` pairs (:func:`sft_on_pairs`) gives RL a model that
knows the answer format, as a real instruct model would.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.demo.tiny import TINY_DECODER_SIZES, sft_step

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_bpe_checkpoint",
    "chat_prompt_ids",
    "save_chat_checkpoint",
    "sft_on_pairs",
    "seeded_model",
    "tiny_config",
    "train_bpe_tokenizer",
]

#: ``<|endoftext|>`` (pad, end of document), ``<|im_start|>`` / ``<|im_end|>`` (chat turns), as in Qwen2.5.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_PAD, _IM_START, _IM_END = SPECIAL_TOKENS

#: ChatML, the template of Qwen2.5-Instruct without its tool-calling branches: an optional system turn,
#: then ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, and ``<|im_start|>assistant\n`` as the
#: generation prompt.
CHATML_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Architecture = Literal["qwen2", "llama"]
PreTokenizer = Literal["byte_level", "qwen2"]


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    min_frequency: int = 2,
    chat_template: str | None = CHATML_TEMPLATE,
    added_tokens: Sequence[str] = (),
    pre_tokenizer: PreTokenizer = "byte_level",
):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Byte level: every byte has a token (the 256-symbol alphabet is always in the vocabulary), so any
    text encodes, including text the training corpus never showed. The tokenizer's own rule adds no
    special token (``tokenizer(text)`` gives the text's ids only), as Qwen2's does. The special and
    added tokens are cut out of the corpus before training: they are never split when encoding, so
    merges learnt inside them would be wasted.

    Args:
        texts: the corpus (e.g. your prompts and answers).
        vocab_size: target vocabulary size, specials and the 256 bytes included (merges fill the rest,
            as far as the corpus has pairs occurring ``min_frequency`` times).
        min_frequency: least count of a pair for it to become a merge.
        chat_template: Jinja chat template stored with the tokenizer (``None``: none).
        added_tokens: extra tokens that always encode as one id and are not special (decoding with
            ``skip_special_tokens=True`` keeps them), as Qwen2.5's ``<tool_call>``; they take ids after the
            trained vocabulary and count towards ``vocab_size``.
        pre_tokenizer: how text is cut into words before BPE: ``"byte_level"`` (GPT-2's rule: digits in
            runs), or ``"qwen2"``: Qwen2's rule and NFC normalisation, one token per digit, exactly what
            ``AutoTokenizer`` rebuilds when it loads a ``qwen2`` checkpoint (transformers' ``Qwen2Tokenizer``
            replaces a saved pre-tokenizer with its own), so the loaded tokenizer encodes as the trained one.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    added = list(dict.fromkeys(added_tokens))
    bad = [t for t in added if not isinstance(t, str) or not t or t in SPECIAL_TOKENS]
    if bad:
        raise ValueError(
            f"train_bpe_tokenizer: added_tokens={list(added_tokens)!r}: {bad!r} are empty, not strings, or "
            f"already special tokens ({', '.join(SPECIAL_TOKENS)}); give other non-empty strings."
        )
    minimum = 256 + len(SPECIAL_TOKENS) + len(added)
    if not is_int(vocab_size) or vocab_size < minimum:
        raise ValueError(
            f"train_bpe_tokenizer: vocab_size={vocab_size!r} must be an int >= {minimum} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens + {len(added)} added tokens)."
        )
    whole = re.compile("|".join(re.escape(t) for t in sorted((*SPECIAL_TOKENS, *added), key=len, reverse=True)))
    corpus = [whole.sub("\n", t) for t in texts if isinstance(t, str) and t]
    if not any(corpus):
        raise ValueError("train_bpe_tokenizer: `texts` holds no non-empty string to train on.")
    core = Tokenizer(models.BPE())
    if pre_tokenizer == "qwen2":
        from tokenizers import Regex, normalizers
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        core.normalizer = normalizers.NFC()
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre_tokenizer == "byte_level":
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        raise ValueError(
            f"train_bpe_tokenizer: pre_tokenizer={pre_tokenizer!r} is not known; allowed: 'byte_level', 'qwen2'."
        )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=_IM_END, pad_token=_PAD)
    tokenizer.add_special_tokens({"additional_special_tokens": [_IM_START]})
    if added:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_config(architecture: Architecture, vocab_size: int, pad_token_id: int, eos_token_id: int, **overrides: Any):
    """Config of a ~0.3M-parameter decoder (hidden 128, 2 layers, 2 heads of dim 64: vLLM CPU needs 64)."""
    from transformers import LlamaConfig, Qwen2Config

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if architecture not in classes:
        raise ValueError(f"tiny_config: architecture={architecture!r} is not known; allowed: 'qwen2', 'llama'.")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        **TINY_DECODER_SIZES,
        max_position_embeddings=512,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_token_id,
    )
    kwargs.update(overrides)
    return classes[architecture](**kwargs)


def seeded_model(config: Any, seed: int) -> torch.nn.Module:
    """A float32 causal LM of ``config`` initialised from ``seed``; the global RNG state is left untouched."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).to(torch.float32)


def chat_prompt_ids(tokenizer: Any, prompt: str, system: str | None = None) -> list[int]:
    """Ids of ``prompt`` as one user turn, rendered by the tokenizer's chat template with the generation
    prompt (``apply_chat_template(..., add_generation_prompt=True)``)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def sft_on_pairs(
    model: torch.nn.Module,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    steps: int,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
) -> list[float]:
    """Supervised warm-up on ``(prompt, answer)`` pairs, chat-formatted: teacher-forced cross-entropy on
    the answer and ``<|im_end|>`` after the rendered prompt (:func:`chat_prompt_ids`); the prompt carries
    no loss. Batches are drawn with replacement from ``pairs`` (seeded); AdamW, constant ``lr``. Returns
    the loss of every step; the model is left in eval mode."""
    if not is_int(steps) or steps < 0:
        raise ValueError(f"sft_on_pairs: steps={steps!r} must be an int >= 0.")
    if steps and not pairs:
        raise ValueError("sft_on_pairs: `pairs` is empty; give (prompt, answer) pairs to train on.")
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"sft_on_pairs: batch_size={batch_size!r} must be an int >= 1.")
    rng = random.Random(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = []
    for prompt, answer in pairs:
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        encoded.append((prompt_ids, tokenizer(answer, add_special_tokens=False).input_ids + [eos]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = [sft_step(model, optimizer, [rng.choice(encoded) for _ in range(batch_size)], pad) for _ in range(steps)]
    model.eval()
    return losses


def build_bpe_checkpoint(
    directory: str | os.PathLike,
    texts: Iterable[str],
    architecture: Architecture = "qwen2",
    vocab_size: int = 512,
    seed: int = 0,
    sft_pairs: Sequence[tuple[str, str]] = (),
    sft_steps: int = 0,
    sft_lr: float = 1e-3,
    sft_batch_size: int = 16,
    chat_template: str | None = CHATML_TEMPLATE,
    **config_overrides: Any,
) -> Path:
    """Train a byte-level BPE tokenizer on ``texts``, build a tiny ``architecture`` model for it, optionally
    warm it up on ``sft_pairs`` for ``sft_steps``, and save both into ``directory`` (created if missing).

    The model's vocabulary is the tokenizer's length rounded up to a multiple of 64 (as real checkpoints
    pad their embeddings); its generation config stops on ``<|im_end|>`` and ``<|endoftext|>``.

    Args:
        directory: where to save; any existing files of the same names are overwritten.
        texts: the tokenizer's training corpus (e.g. the task's prompts and answers).
        architecture: ``"qwen2"`` or ``"llama"``.
        vocab_size: the tokenizer's target vocabulary size (see :func:`train_bpe_tokenizer`).
        seed: seed of the initial weights and of the warm-up batches.
        sft_pairs: ``(prompt, answer)`` pairs of the supervised warm-up (:func:`sft_on_pairs`).
        sft_steps: warm-up steps (0: the model stays at its random initialisation).
        sft_lr: warm-up learning rate.
        sft_batch_size: warm-up sequences per step.
        chat_template: the tokenizer's chat template (default ChatML).
        **config_overrides: passed to the model config (e.g. ``num_hidden_layers=4``).

    Returns the absolute directory: ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load it, and so does ``OffPolicyRLModule(model=<directory>)``.
    """

    if sft_steps and not sft_pairs:
        raise ValueError(f"build_bpe_checkpoint: sft_steps={sft_steps} needs `sft_pairs` to train on.")
    # transformers loads a qwen2 checkpoint's tokenizer with Qwen2's own pre-tokenizer (digits one by one):
    # train with it, or the model is warmed up on other ids than the ones it is served.
    pre_tokenizer = "qwen2" if architecture == "qwen2" else "byte_level"
    tokenizer = train_bpe_tokenizer(
        texts, vocab_size=vocab_size, chat_template=chat_template, pre_tokenizer=pre_tokenizer
    )
    eos, end_of_text = tokenizer.convert_tokens_to_ids(_IM_END), tokenizer.convert_tokens_to_ids(_PAD)
    padded_vocab = -(-len(tokenizer) // 64) * 64
    config = tiny_config(architecture, padded_vocab, pad_token_id=end_of_text, eos_token_id=eos, **config_overrides)
    model = seeded_model(config, seed)
    if sft_steps:
        pairs = list(sft_pairs)
        sft_on_pairs(model, tokenizer, pairs, steps=sft_steps, batch_size=sft_batch_size, lr=sft_lr, seed=seed)
    model.eval()
    return save_chat_checkpoint(model, tokenizer, directory, eos, end_of_text)


def save_chat_checkpoint(
    model: Any, tokenizer: Any, directory: str | os.PathLike, end_of_turn: int, end_of_text: int
) -> Path:
    """Save ``model`` and ``tokenizer`` as a Qwen2.5-style chat checkpoint: generation stops on
    ``end_of_turn`` and ``end_of_text``, pads with ``end_of_text``, no bos. Returns the absolute directory."""
    from lightning_offpolicy.demo.checkpoint_cache import save_model

    model.generation_config.eos_token_id = [end_of_turn, end_of_text]
    model.generation_config.pad_token_id = end_of_text
    model.generation_config.bos_token_id = None
    target = Path(directory).expanduser().absolute()
    target.mkdir(parents=True, exist_ok=True)
    save_model(model, target)
    tokenizer.save_pretrained(target)
    return target
