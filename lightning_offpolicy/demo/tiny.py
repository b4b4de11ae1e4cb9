"""A tiny Llama, warmed up by supervised fine-tuning on a built-in task, cached as a checkpoint.

The quickstart trains with RL from a checkpoint that already knows the format of a task but is
far from solving it. Nothing is downloaded: the model is built from a config, the tokenizer is
:class:`~lightning_offpolicy.data.tokenizers.CharTokenizer`.

    >>> from lightning_offpolicy.demo.tiny import resolve_model_path
    >>> path = resolve_model_path("tiny:reverse")          # doctest: +SKIP
    >>> path = resolve_model_path("tiny:addition?sft_steps=300&seed=1")   # doctest: +SKIP

Warm-up settings and the measured rewards they reach: docs/training.md, "The tiny checkpoints".
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import torch
import torch.nn.functional as F

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.data.tasks import Task, get_task
from lightning_offpolicy.data.tokenizers import CharTokenizer, HFTokenizer, encode_prompt
from lightning_offpolicy.demo.checkpoint_cache import cached_build, default_cache_dir, save_model
from lightning_offpolicy.preflight import check_vocab

__all__ = [
    "DEFAULT_SFT_STEPS",
    "build_tiny_llama",
    "greedy_completions",
    "greedy_reward",
    "prepare_tiny_checkpoint",
    "resolve_model_path",
    "tiny_llama_config",
    "warmup_sft",
]

#: Bump when the recipe changes so stale caches are rebuilt.
_RECIPE_VERSION = 1
TINY_PREFIX = "tiny:"

#: Warm-up steps per task, chosen so the greedy reward lands well above random but far from 1
#: (the rewards they reach: docs/training.md, "The tiny checkpoints").
DEFAULT_SFT_STEPS: dict[str, int] = {"reverse": 100, "addition": 200, "copy": 40}
#: Warm-up learning rate per task (addition is unstable at 3e-3: its reward falls back).
DEFAULT_SFT_LR: dict[str, float] = {"reverse": 3e-3, "addition": 1e-3, "copy": 3e-3}
_FALLBACK_STEPS, _FALLBACK_LR = 150, 3e-3

Tokenizer = CharTokenizer | HFTokenizer


#: The sizes of every tiny decoder the kit builds (the tiny Llama here, the BPE checkpoints of
#: :mod:`lightning_offpolicy.demo.tiny_bpe`): head dim 64, because vLLM's CPU attention needs it.
TINY_DECODER_SIZES: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=False,
)


def tiny_llama_config(vocab_size: int = 64, **overrides: Any):
    """Config of a ~0.34M-parameter Llama (344,704 at vocab 64): hidden 128, 2 layers, 2 heads of dim 64.

    Head dim 64: vLLM's CPU attention needs it.
    """
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        **TINY_DECODER_SIZES,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_tiny_llama(vocab_size: int = 64, seed: int = 0):
    """A freshly initialised float32 tiny Llama (eval mode); the global RNG state is left untouched."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(vocab_size))
    return model.to(torch.float32).eval()


def warmup_sft(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    task: Task,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Supervised warm-up: teacher-forced cross-entropy on ``prompt + reference + eos``.

    Only the completion tokens (the reference answer and ``eos``) carry loss. Prompts come from
    ``task.sample(random.Random(seed))``; the optimizer is AdamW with a constant learning rate.
    Returns the loss of every step. The model is left in eval mode.
    """
    if steps < 0:
        raise ValueError(f"warmup_sft: `steps` must be >= 0, got {steps}.")
    if batch_size < 1:
        raise ValueError(f"warmup_sft: `batch_size` must be >= 1, got {batch_size}.")
    check_vocab(model, tokenizer)
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            prompt, metadata = task.sample(rng)
            completion_ids = tokenizer.encode(task.reference_completion(metadata), add_bos=False)
            rows.append((encode_prompt(tokenizer, prompt), completion_ids + [tokenizer.eos_token_id]))
        losses.append(sft_step(model, optimizer, rows, pad))
    model.eval()
    return losses


def sft_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: Sequence[tuple[list[int], list[int]]],
    pad_token_id: int,
) -> float:
    """One teacher-forced cross-entropy step on ``(prompt_ids, completion_ids)`` rows, right-padded.

    Only the completion tokens carry loss. Returns the step's loss.
    """
    device = next(model.parameters()).device
    length = max(len(prompt) + len(completion) for prompt, completion in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (prompt, completion) in enumerate(rows):
        sequence = torch.tensor(prompt + completion)
        input_ids[row, : len(sequence)] = sequence
        attention_mask[row, : len(sequence)] = 1
        labels[row, len(prompt) : len(sequence)] = torch.tensor(completion)
    input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def greedy_completions(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 256,
) -> list[str]:
    """Greedy completions (left-padded batches, each stops at ``eos``; ``eos`` not included)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for begin in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, p) for p in prompts[begin : begin + batch_size]]
            length = max(len(e) for e in encoded)
            input_ids = torch.full((len(encoded), length), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
            for i, ids in enumerate(encoded):
                input_ids[i, length - len(ids) :] = torch.tensor(ids)
                attention_mask[i, length - len(ids) :] = 1
            generated = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=eos,
            )[:, length:]
            for row in generated.tolist():
                if eos in row:
                    row = row[: row.index(eos)]
                out.append(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def greedy_reward(
    model: torch.nn.Module, tokenizer: Tokenizer, task: Task, num_prompts: int = 128, seed: int = 1234
) -> float:
    """Mean task reward of greedy completions of ``num_prompts`` prompts drawn with ``seed``."""
    rng = random.Random(seed)
    samples = [task.sample(rng) for _ in range(num_prompts)]
    completions = greedy_completions(model, tokenizer, [p for p, _ in samples], task.max_new_tokens)
    rewards = [task.reward(c, m) for c, (_, m) in zip(completions, samples, strict=True)]
    return sum(rewards) / max(len(rewards), 1)


def _format_lr(lr: float) -> str:
    return f"{lr:g}"


def prepare_tiny_checkpoint(
    task: str = "reverse",
    sft_steps: int | None = None,
    seed: int = 0,
    directory: str | os.PathLike | None = None,
    sft_lr: float | None = None,
) -> Path:
    """Build a tiny Llama, warm it up on ``task`` for ``sft_steps``, save model + tokenizer; cached.

    Args:
        task: a built-in task name.
        sft_steps: warm-up steps; ``None`` takes ``DEFAULT_SFT_STEPS[task]``.
        seed: seed of the initial weights and of the warm-up data.
        directory: where to save; default ``<cache>/tiny-{task}-sft{steps}-seed{seed}`` (plus
            ``-lr{lr}`` when ``sft_lr`` differs from the task's default), with ``<cache>`` =
            ``$LIGHTNING_OFFPOLICY_CACHE`` or ``~/.cache/lightning_offpolicy``.
        sft_lr: warm-up learning rate; ``None`` takes ``DEFAULT_SFT_LR[task]``.

    The directory is reused when its marker file records the same spec. The build happens in a
    temporary sibling directory, the marker is written last and the directory is renamed into
    place (under a file lock), so an interrupted build is redone and concurrent callers share one
    build and never see a partial one. Returns the absolute directory
    (``LlamaForCausalLM.from_pretrained`` and :func:`~lightning_offpolicy.data.tokenizers.load_tokenizer`
    load it); its marker also records the final SFT loss and the greedy reward.
    """
    task_obj = get_task(task)
    steps = DEFAULT_SFT_STEPS.get(task, _FALLBACK_STEPS) if sft_steps is None else sft_steps
    default_lr = DEFAULT_SFT_LR.get(task, _FALLBACK_LR)
    lr = default_lr if sft_lr is None else float(sft_lr)
    if not is_int(steps) or steps < 0:
        raise ValueError(f"prepare_tiny_checkpoint: `sft_steps` must be an int >= 0, got {sft_steps!r}.")
    if not is_int(seed):
        raise ValueError(f"prepare_tiny_checkpoint: `seed` must be an int, got {seed!r}.")
    if not lr > 0:
        raise ValueError(f"prepare_tiny_checkpoint: `sft_lr` must be > 0, got {sft_lr!r}.")
    if directory is None:
        name = f"tiny-{task}-sft{steps}-seed{seed}"
        if lr != default_lr:
            name += f"-lr{_format_lr(lr)}"
        target = default_cache_dir() / name
    else:
        target = Path(directory).expanduser()
    target = target.absolute()
    tokenizer = CharTokenizer()
    spec = {
        "recipe": _RECIPE_VERSION,
        "task": task,
        "sft_steps": steps,
        "sft_lr": lr,
        "seed": seed,
        "vocab_size": 64,
        "alphabet": tokenizer.alphabet,
    }

    def build(directory: Path) -> dict[str, Any]:
        model = build_tiny_llama(vocab_size=64, seed=seed)
        losses = warmup_sft(model, tokenizer, task_obj, steps=steps, lr=lr, seed=seed)
        reward = greedy_reward(model, tokenizer, task_obj)
        save_model(model, directory)
        tokenizer.save_pretrained(directory)
        return {"final_loss": losses[-1] if losses else None, "greedy_reward": reward}

    return cached_build(target, spec, build)


_QUERY_KEYS: dict[str, type] = {"sft_steps": int, "seed": int, "sft_lr": float}

#: Tasks whose ``tiny:`` checkpoint is a real-format chat model (a tiny Qwen2, a BPE tokenizer and a chat
#: template), warmed up on whole multi-turn episodes (built by their own modules: tool_use.py, guess_number.py).
CHAT_CHECKPOINTS: tuple[str, ...] = ("multiply", "guess_number")


def _prepare_chat_checkpoint(task: str, **kwargs: Any) -> Any:
    """Build (or find cached) the chat checkpoint of ``task``, one of :data:`CHAT_CHECKPOINTS`."""
    # Imported here: those modules build on this one.
    if task == "multiply":
        from lightning_offpolicy.demo.tool_use import prepare_tool_use_checkpoint

        return prepare_tool_use_checkpoint(**kwargs)
    from lightning_offpolicy.demo.guess_number import prepare_guess_number_checkpoint

    return prepare_guess_number_checkpoint(**kwargs)


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """``"tiny:TASK[?sft_steps=N&seed=S&sft_lr=LR]"`` -> a prepared tiny checkpoint; else unchanged.

    ``"tiny:reverse"`` takes the task's defaults; anything not starting with ``tiny:`` (a local
    directory, a hub name) is returned as given.

    >>> resolve_model_path("meta-llama/Llama-3.2-1B")
    'meta-llama/Llama-3.2-1B'
    """
    name = os.fspath(name_or_path)
    if not name.startswith(TINY_PREFIX):
        return name
    task, _, query = name[len(TINY_PREFIX) :].partition("?")
    if not task:
        raise ValueError(f"resolve_model_path: {name!r} names no task; e.g. 'tiny:reverse'.")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError as err:
        raise ValueError(
            f"resolve_model_path: bad query string {query!r} in {name!r} ({err}); "
            "expected e.g. 'tiny:addition?sft_steps=300&seed=1'."
        ) from None
    kwargs: dict[str, Any] = {}
    for key, value in pairs:
        if key not in _QUERY_KEYS:
            raise ValueError(
                f"resolve_model_path: unknown option {key!r} in {name!r}; allowed: {', '.join(_QUERY_KEYS)}."
            )
        if key in kwargs:
            raise ValueError(f"resolve_model_path: option {key!r} given twice in {name!r}.")
        kind = _QUERY_KEYS[key]
        try:
            kwargs[key] = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"resolve_model_path: option {key}={value!r} in {name!r} is not {what}.") from None
    get_task(task)  # a clear error for unknown tasks before any work
    if task in CHAT_CHECKPOINTS:  # a BPE tokenizer with a chat template, warmed up on whole episodes
        return str(_prepare_chat_checkpoint(task, **kwargs))
    return str(prepare_tiny_checkpoint(task, **kwargs))
