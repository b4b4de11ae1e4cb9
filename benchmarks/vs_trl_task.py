"""The side-by-side's task, settings, character tokenizer and random-init checkpoint (the study's letter task too)."""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

#: The settings both sides share (written into the JSON header).
SETTINGS: dict[str, Any] = {
    "prompts_per_step": 8,
    "samples_per_prompt": 8,
    "max_new_tokens": 16,
    "temperature": 1.0,
    "top_p": 1.0,
    "learning_rate": 1e-3,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "loss": "token-mean (TRL loss_type='dapo')",
    "kl": 0.0,
    "dtype": "float32",
    "threads": 1,
}
#: Characters the reward counts in each completion.
SCORED_CHARS = 16
#: The running-mean threshold whose first crossing the report gives (and the window of that mean).
THRESHOLD, WINDOW = 0.5, 10
SIDES = ("trl", "kit")
ENGINES = ("hf", "vllm")


def first_letter_score(prompt: str, completion: str) -> float:
    """Occurrences of ``prompt``'s first character among ``completion``'s first 16 characters, / 16."""
    return completion[:SCORED_CHARS].count(prompt[0]) / SCORED_CHARS if prompt else 0.0


def kit_reward(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """The kit's reward signature: ``(prompts, completions, metadata) -> rewards``."""
    return [first_letter_score(p, c) for p, c in zip(prompts, completions, strict=True)]


def trl_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """TRL's reward signature: ``(prompts, completions, **columns) -> rewards``."""
    return [first_letter_score(p, c) for p, c in zip(prompts, completions, strict=True)]


def make_prompts(count: int, seed: int) -> list[str]:
    """``count`` prompts of 3-6 random lowercase letters followed by ``:``."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6))) + ":" for _ in range(count)]


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` whose own rule adds no special token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    chars = string.ascii_lowercase + ":"
    vocab = {token: i for i, token in enumerate(specials + list(chars))}
    # BPE without merges splits a word into its characters; no pre-tokenizer, no post-processor
    # (so no special token is added), and decoding fuses the characters back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def build_checkpoint(directory: Path, seed: int) -> Path:
    """Save the random-init tiny Llama and the char tokenizer into ``directory``."""
    import torch
    from transformers import LlamaForCausalLM

    from lightning_offpolicy.demo.tiny import tiny_llama_config

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(
        vocab_size=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
