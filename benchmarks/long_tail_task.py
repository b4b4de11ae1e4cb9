"""The long-tail side-by-side's task: a ~10M-parameter Qwen2 with a byte-level BPE tokenizer, completions
of ~16 to 512 tokens, and a reward that depends on the completion's length.

* **Model**: Qwen2-shaped (hidden 384, 6 layers, 6 query heads and 2 key/value heads of dim 64,
  intermediate 1024, untied output layer, vocabulary 1024), random init, float32, saved with
  ``save_pretrained`` next to its tokenizer (:func:`build_checkpoint`).
* **Lengths**: a random-init model almost never ends a turn (its end-of-turn token is one of 1024
  near-equally likely ones), so every completion would run to the cap and nothing would be long-tailed.
  An instruct checkpoint ends its turns at lengths spread over orders of magnitude, learned; so is this
  one's: a supervised warm-up (:data:`WARM_UP`, :func:`warm_up_rows`) on completions of random letters
  that end after a geometric number of tokens (mean :data:`MEAN_LENGTH`, capped below the 512 of the
  runs), so that completion lengths start geometric (median ~90 tokens, a few percent reaching the cap)
  and stay so under RL's first steps. With ``warm_up_steps=0`` the checkpoint is the random init with an
  *end-of-turn prior* set in the weights instead (:func:`add_end_of_turn_prior`, what the benchmark ran
  before): the same start, but fragile: AdamW's first steps grow the rest of the residual stream
  against its dimension, and within a few steps both sides sample much longer completions
  (docs/performance.md, "Notes on the figures").
* **Task**: the prompt is 3-6 random lowercase letters, a space, a target length ``N`` in characters
  (log-uniform in 16..1024) and ``:``. The reward is the share of the prompt's first letter among the
  completion's characters times the length factor ``min(c / N, N / c)`` of the completion's ``c``
  characters: a dense per-token signal (the letter) and a length-dependent one (the target).
"""

from __future__ import annotations

import math
import os
import random
import string
from pathlib import Path
from typing import Any

#: The settings both sides share (written into the JSON header).
SETTINGS: dict[str, Any] = {
    "prompts_per_step": 4,
    "samples_per_prompt": 8,
    "max_new_tokens": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "learning_rate": 1e-4,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "loss": "token-mean (TRL loss_type='dapo')",
    "kl": 0.0,
    "dtype": "float32",
    "threads": 1,
}
#: The model's shape (Qwen2Config fields).
MODEL_SHAPE: dict[str, Any] = dict(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
VOCAB_SIZE = 1024
#: Mean completion length (tokens) the end-of-turn prior aims at, before the cap.
MEAN_LENGTH = 128
#: Target lengths (characters) the prompts draw from, log-uniformly.
TARGET_RANGE = (16, 1024)
#: The hidden dimension carrying the end-of-turn prior, and the size of its component in every embedding.
PRIOR_DIM, PRIOR_COMPONENT = 0, 1.0
#: The checkpoint's supervised warm-up (:func:`build_checkpoint`): optimizer steps, completion tokens per step, AdamW
#: learning rate (decaying linearly to 0), the pool of rows the steps draw from, and its length buckets.
WARM_UP: dict[str, Any] = {"steps": 200, "tokens": 2048, "lr": 1e-3, "rows": 4000, "buckets": 8}


def score(prompt: str, completion: str) -> float:
    """Share of ``prompt``'s first letter among ``completion``'s characters, times the length factor."""
    head, _, rest = prompt.partition(" ")
    target = int(rest.rstrip(":"))
    chars = len(completion)
    if not head or chars == 0:
        return 0.0
    return completion.count(head[0]) / chars * min(chars / target, target / chars)


def kit_reward(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """The kit's reward signature: ``(prompts, completions, metadata) -> rewards``."""
    return [score(p, c) for p, c in zip(prompts, completions, strict=True)]


def trl_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """TRL's reward signature: ``(prompts, completions, **columns) -> rewards``."""
    return [score(p, c) for p, c in zip(prompts, completions, strict=True)]


def make_prompts(count: int, seed: int) -> list[str]:
    """``count`` prompts ``"<3-6 letters> <N>:"`` with ``N`` log-uniform in :data:`TARGET_RANGE`."""
    rng = random.Random(seed)
    low, high = (math.log(x) for x in TARGET_RANGE)
    out = []
    for _ in range(count):
        letters = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        out.append(f"{letters} {round(math.exp(rng.uniform(low, high)))}:")
    return out


def _corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: prompts, and letter runs like the completions the reward asks for."""
    rng = random.Random(seed + 1)
    runs = ["".join(rng.choices(string.ascii_lowercase + "  ", k=rng.randint(16, 200))) for _ in range(2000)]
    return make_prompts(2000, seed) + runs


def add_end_of_turn_prior(model: Any, end_of_turn: int, mean_length: float = MEAN_LENGTH) -> float:
    """Give ``model`` a mean chance of ``1 / mean_length`` to end its turn at every token; return that chance.

    Every token embedding gets :data:`PRIOR_COMPONENT` in hidden dimension :data:`PRIOR_DIM` (no other
    embedding weight is changed), which the final norm turns into a near-constant value there; the
    output layer's end-of-turn row reads that dimension with the weight, found by bisection, that
    makes the mean end-of-turn probability ``1 / mean_length`` over random token sequences (the output
    layer is untied: changing it leaves the hidden states as they are).
    """
    import torch

    target = 1.0 / mean_length
    with torch.no_grad():
        model.get_input_embeddings().weight[:, PRIOR_DIM] = PRIOR_COMPONENT
        head = model.get_output_embeddings().weight
        head[:, PRIOR_DIM] = 0.0
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, head.shape[0], (16, 128), generator=generator)
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1].float()
        logits = hidden @ head.float().T
        reads = hidden[..., PRIOR_DIM]

        def chance(weight: float) -> float:
            shifted = logits.clone()
            shifted[..., end_of_turn] += weight * reads
            return float(shifted.softmax(-1)[..., end_of_turn].mean())

        low, high = -100.0, 100.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if chance(middle) < target else (low, middle)
        head[end_of_turn, PRIOR_DIM] = (low + high) / 2
        return chance((low + high) / 2)


def warm_up_rows(tokenizer: Any, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``count`` ``(prompt_ids, completion_ids)`` rows of the warm-up: a prompt of the task (its own seeded
    stream, apart from the runs'), then random lowercase letters and spaces cut after a geometric number of
    tokens (mean :data:`MEAN_LENGTH`, at most ``max_new_tokens - 1``), then the end-of-turn token."""
    rng = random.Random(seed + 2)
    cap = SETTINGS["max_new_tokens"] - 1
    rows = []
    for prompt in make_prompts(count, seed + 2):
        length = min(1 + int(rng.expovariate(1.0 / MEAN_LENGTH)), cap)
        ids: list[int] = []
        while len(ids) < length:  # a BPE token covers a few letters: draw text until it is long enough
            text = "".join(rng.choices(string.ascii_lowercase + "  ", k=4 * length))
            ids += tokenizer(text, add_special_tokens=False).input_ids
        rows.append((tokenizer(prompt).input_ids, ids[:length] + [tokenizer.eos_token_id]))
    return rows


def build_checkpoint(directory: Path, seed: int, warm_up_steps: int = WARM_UP["steps"]) -> Path:
    """Save the Qwen2 and its BPE tokenizer into ``directory``: warmed up on :func:`warm_up_rows` for
    ``warm_up_steps`` (teacher-forced cross-entropy on the completions; one torch thread per core), or,
    with 0, the random init with the end-of-turn prior (:func:`add_end_of_turn_prior`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_offpolicy.demo.tiny_bpe import save_chat_checkpoint, tiny_config, train_bpe_tokenizer

    # No chat template: both sides encode the prompt as plain text, as for a base model.
    tokenizer = train_bpe_tokenizer(_corpus(seed), vocab_size=VOCAB_SIZE, chat_template=None, pre_tokenizer="qwen2")
    end_of_turn, end_of_text = tokenizer.eos_token_id, tokenizer.pad_token_id
    vocab = -(-len(tokenizer) // 64) * 64
    config = tiny_config("qwen2", vocab, pad_token_id=end_of_text, eos_token_id=end_of_turn, **MODEL_SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    if warm_up_steps:
        from lightning_offpolicy.demo.tiny import sft_step

        # A step's rows come from one length bucket (little padding), as many as make about `tokens` completion
        # tokens, and a bucket is drawn in proportion to its tokens: every completion token of the pool weighs
        # the same in expectation, as in batches drawn from the whole pool (where padding to the longest row
        # would cost several times the compute). The learning rate decays to 0: no last bucket weighs more.
        rows = sorted(warm_up_rows(tokenizer, WARM_UP["rows"], seed), key=lambda row: len(row[1]))
        count = WARM_UP["buckets"]
        buckets = [rows[len(rows) * i // count : len(rows) * (i + 1) // count] for i in range(count)]
        tokens = [sum(len(completion) for _, completion in bucket) for bucket in buckets]
        per_step = [
            min(len(b), max(1, round(WARM_UP["tokens"] * len(b) / t))) for b, t in zip(buckets, tokens, strict=True)
        ]
        rng = random.Random(seed + 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_UP["lr"], weight_decay=0.0)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / warm_up_steps)
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, os.cpu_count() or 1))  # the build runs before either side
        model.train()
        try:
            for _ in range(warm_up_steps):
                (index,) = rng.choices(range(count), weights=tokens)
                sft_step(model, optimizer, rng.sample(buckets[index], per_step[index]), end_of_text)
                decay.step()
        finally:
            torch.set_num_threads(threads)
    else:
        add_end_of_turn_prior(model, end_of_turn)
    model.eval()
    return save_chat_checkpoint(model, tokenizer, directory, end_of_turn, end_of_text)


def parameter_count(directory: Path) -> int:
    """Parameters of the saved model (from its config, without loading the weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    return sum(p.numel() for p in model.parameters())
