"""A tiny real-format checkpoint that calls a calculator tool, warmed up by SFT on the call format.

A Qwen2 model built from a config, a byte-level BPE tokenizer trained on the task's conversations
(with Qwen2's pre-tokenizer, one token per digit, which ``AutoTokenizer`` rebuilds identically on
load), and Qwen2.5-Instruct's chat template with its tool branch (shipped byte for byte as
``templates/qwen2_5.jinja``, so TRL recognises it too). ``<tool_call>``, ``</tool_call>``,
``<tool_response>`` and ``</tool_response>`` are single tokens, not special, as in Qwen2.5. The
warm-up trains on solved episodes of :class:`~lightning_offpolicy.data.tasks.tool_use.MultiplyToolTask`
(question, tool call, tool result, final answer), loss on the assistant's turns only
(:func:`~lightning_offpolicy.demo.chat_sft.sft_on_conversations`); it stops short of perfect copying, which
leaves RL something to raise. Settings and the success rates they reach: docs/multi_turn.md.

    >>> from lightning_offpolicy.demo.tool_use import prepare_tool_use_checkpoint
    >>> path = prepare_tool_use_checkpoint()          # doctest: +SKIP
    >>> # then in YAML:  model: {init_args: {model: <path>}},  rollout.episodes.tools: [...tool_use.multiply]
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask
from lightning_offpolicy.demo.chat_sft import play_held_out, sft_on_conversations
from lightning_offpolicy.demo.checkpoint_cache import cached_build, chat_checkpoint_target
from lightning_offpolicy.demo.tiny_bpe import (
    SPECIAL_TOKENS,
    save_chat_checkpoint,
    seeded_model,
    tiny_config,
    train_bpe_tokenizer,
)
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings, episode_metadata

__all__ = [
    "DEFAULT_TOOL_USE_SETTINGS",
    "TOOL_TOKENS",
    "build_tool_use_checkpoint",
    "held_out_prompts",
    "prepare_tool_use_checkpoint",
    "qwen2_5_chat_template",
    "tool_use_success",
]

#: The tool-calling tokens of Qwen2.5's template; each is one added (not special) token.
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_TEMPLATE = Path(__file__).parent / "templates" / "qwen2_5.jinja"
#: Bump when the recipe changes so stale caches are rebuilt.
_RECIPE_VERSION = 1

#: The warm-up of :func:`prepare_tool_use_checkpoint`; chosen so greedy success lands well above 0
#: and well below 1, with the errors left (a digit of the product skipped or repeated) ones that sampled
#: episodes sometimes avoid, so RL has a signal to learn from (the rates it reaches: docs/multi_turn.md).
DEFAULT_TOOL_USE_SETTINGS: dict[str, Any] = {
    "sft_steps": 550,
    "sft_lr": 3e-3,
    "sft_lr_schedule": "constant",
    "sft_batch_size": 16,
    "num_conversations": 1000,
    "vocab_size": 512,
    "a_digits": 4,
    "b_digits": 3,
}
# Eight heads of dim 64 (vLLM's CPU attention needs 64) on the tiny decoder's hidden 128: copying a digit is
# attending to one position at a fixed distance, and the two factors and the product each sit at another
# distance; with two or four heads the model learns the first and copies the others only much later.
_MODEL_OVERRIDES: dict[str, Any] = {"num_attention_heads": 8, "num_key_value_heads": 8}


def qwen2_5_chat_template() -> str:
    """Qwen2.5-Instruct's chat template, as shipped in ``templates/qwen2_5.jinja`` (Apache-2.0)."""
    return _TEMPLATE.read_text(encoding="utf-8")


def held_out_prompts(task: MultiplyToolTask, count: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """``count`` prompts of ``task`` from a seed stream no warm-up draws from (``f"held-out:{seed}"``)."""
    rng = random.Random(f"held-out:{seed}")  # str seeds are hashed with sha512: stable across runs
    return [task.sample(rng) for _ in range(count)]


#: The episodes of the task: a tool call, then the answer (a third turn for a retry).
TOOL_USE_MAX_TURNS = 3


def tool_use_episodes(task: MultiplyToolTask) -> EpisodeSettings:
    """The task's episode settings: its tools, :data:`TOOL_USE_MAX_TURNS` turns of ``task.max_new_tokens``."""
    return EpisodeSettings(
        tools=list(task.tools),
        max_turns=TOOL_USE_MAX_TURNS,
        max_episode_tokens=TOOL_USE_MAX_TURNS * task.max_new_tokens + 64,
    )


def tool_use_success(
    model: torch.nn.Module,
    tokenizer: Any,
    task: MultiplyToolTask,
    num_prompts: int = 200,
    greedy: bool = True,
    seed: int = 0,
) -> float:
    """Mean reward of episodes played by the kit's runner on ``num_prompts`` held-out prompts, the tool run.

    Args:
        model: the checkpoint's model.
        tokenizer: its tokenizer (Qwen2.5 template).
        task: the task (its prompts, tools and reward).
        num_prompts: held-out prompts (:func:`held_out_prompts` with ``seed``).
        greedy: greedy decoding; False samples at temperature 1 (seeded with ``seed``).
        seed: seed of the prompts and of the sampling.

    Returns:
        The fraction of episodes whose last turn states the exact product (not truncated).
    """
    samples = held_out_prompts(task, num_prompts, seed)
    metadata = [m for _, m in samples]
    episodes = play_held_out(model, tokenizer, tool_use_episodes(task), samples, task.max_new_tokens, greedy, seed)
    rewards = [
        task.reward(tokenizer.decode(e.completion.token_ids, skip_special_tokens=True), episode_metadata(e, m, ""))
        for e, m in zip(episodes, metadata, strict=True)
    ]
    return sum(rewards) / max(len(rewards), 1)


def _balanced_samples(task: MultiplyToolTask, count: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` samples of ``task``, as many of each product length (in digits) as the lengths allow.

    A product of an ``a``-digit and a ``b``-digit number has ``a + b - 1`` or ``a + b`` digits, the shorter
    far less often; a warm-up on plain samples copies the longer products and never the shorter ones, a
    failure no sampled episode escapes, so RL could not raise it.
    """
    rng = random.Random(seed)
    by_length: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    lengths = (task.a_digits + task.b_digits - 1, task.a_digits + task.b_digits)
    samples: list[tuple[str, dict[str, Any]]] = []
    while len(samples) < count:
        prompt, metadata = task.sample(rng)
        length = len(str(metadata["answer"]))
        bucket = by_length.setdefault(length, [])
        # Keep a sample of a length only while that length is not ahead of the others.
        if length not in lengths or len(bucket) <= min(len(by_length.get(n, [])) for n in lengths):
            bucket.append((prompt, metadata))
            samples.append((prompt, metadata))
    return samples


def build_tool_use_checkpoint(
    directory: str | os.PathLike,
    seed: int = 0,
    sft_steps: int = DEFAULT_TOOL_USE_SETTINGS["sft_steps"],
    sft_lr: float = DEFAULT_TOOL_USE_SETTINGS["sft_lr"],
    sft_lr_schedule: str = DEFAULT_TOOL_USE_SETTINGS["sft_lr_schedule"],
    sft_batch_size: int = DEFAULT_TOOL_USE_SETTINGS["sft_batch_size"],
    num_conversations: int = DEFAULT_TOOL_USE_SETTINGS["num_conversations"],
    vocab_size: int = DEFAULT_TOOL_USE_SETTINGS["vocab_size"],
    a_digits: int = DEFAULT_TOOL_USE_SETTINGS["a_digits"],
    b_digits: int = DEFAULT_TOOL_USE_SETTINGS["b_digits"],
    **config_overrides: Any,
) -> dict[str, Any]:
    """Build the tool-use checkpoint into ``directory`` (created if missing; same-named files overwritten).

    Steps: draw ``num_conversations`` solved episodes of ``MultiplyToolTask(a_digits, b_digits)``, as many
    with each product length (:func:`_balanced_samples`); train
    the tokenizer on them rendered with the tool; build a tiny Qwen2 (seeded); warm it up for
    ``sft_steps``; save model, tokenizer (with the Qwen2.5 template) and a generation config stopping on
    ``<|im_end|>`` and ``<|endoftext|>``. The global RNG state is left untouched.

    Args:
        directory: where to save.
        seed: seed of the conversations, the initial weights and the warm-up batches.
        sft_steps: warm-up steps (0: random initialisation).
        sft_lr: warm-up learning rate (AdamW).
        sft_lr_schedule: ``"constant"`` or ``"cosine"`` (as in
            :func:`~lightning_offpolicy.demo.chat_sft.sft_on_conversations`).
        sft_batch_size: conversations per warm-up step.
        num_conversations: distinct solved episodes the warm-up draws from.
        vocab_size: the tokenizer's target vocabulary size.
        a_digits: digits of the first factor of the task's prompts.
        b_digits: digits of the second factor.
        **config_overrides: passed to the model config (e.g. ``num_hidden_layers=4``).

    Returns:
        ``{"final_loss": ..., "directory": ...}``: the last warm-up loss and the absolute directory.
    """
    if not is_int(num_conversations) or num_conversations < 1:
        raise ValueError(f"build_tool_use_checkpoint: num_conversations={num_conversations!r} must be an int >= 1.")
    task = MultiplyToolTask(a_digits=a_digits, b_digits=b_digits)
    conversations = [task.reference_conversation(p, m) for p, m in _balanced_samples(task, num_conversations, seed)]
    template = qwen2_5_chat_template()
    render = train_bpe_tokenizer(["-"], vocab_size=300, chat_template=template)  # renders only; any vocabulary
    corpus = [render.apply_chat_template(c, tools=task.tools, tokenize=False) for c in conversations[:256]]
    tokenizer = train_bpe_tokenizer(
        corpus, vocab_size=vocab_size, chat_template=template, added_tokens=TOOL_TOKENS, pre_tokenizer="qwen2"
    )
    end_of_text, _, end_of_turn = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    padded_vocab = -(-len(tokenizer) // 64) * 64
    overrides = {**_MODEL_OVERRIDES, **config_overrides}
    config = tiny_config("qwen2", padded_vocab, pad_token_id=end_of_text, eos_token_id=end_of_turn, **overrides)
    model = seeded_model(config, seed)
    losses = sft_on_conversations(
        model,
        tokenizer,
        conversations,
        steps=sft_steps,
        tools=task.tools,
        batch_size=sft_batch_size,
        lr=sft_lr,
        seed=seed,
        lr_schedule=sft_lr_schedule,
    )
    target = save_chat_checkpoint(model, tokenizer, directory, end_of_turn, end_of_text)
    return {"final_loss": losses[-1] if losses else None, "directory": str(target)}


def prepare_tool_use_checkpoint(
    seed: int = 0,
    directory: str | os.PathLike | None = None,
    eval_prompts: int = 200,
    **settings: Any,
) -> Path:
    """:func:`build_tool_use_checkpoint`, cached: reused when its marker file records the same spec.

    Built in a temporary sibling directory and renamed into place under a file lock, as
    :func:`~lightning_offpolicy.demo.tiny.prepare_tiny_checkpoint` does: concurrent callers share one
    build and never see a partial one. The marker also records the final warm-up loss, the greedy
    success on ``eval_prompts`` held-out prompts and the build time.

    Args:
        seed: seed of the build.
        directory: where to save; default ``<cache>/tiny-tool-use-seed{seed}`` (``-{hash}`` appended when
            ``settings`` differ from :data:`DEFAULT_TOOL_USE_SETTINGS`), with ``<cache>`` =
            ``$LIGHTNING_OFFPOLICY_CACHE`` or ``~/.cache/lightning_offpolicy``.
        eval_prompts: held-out prompts of the greedy success recorded in the marker (0: not measured).
        **settings: overrides of :data:`DEFAULT_TOOL_USE_SETTINGS` (the keys of :func:`build_tool_use_checkpoint`).

    Returns:
        The absolute checkpoint directory (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load it).

    Raises:
        ValueError: A setting is not one of :data:`DEFAULT_TOOL_USE_SETTINGS`, or ``seed`` is not an int.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chosen, target = chat_checkpoint_target(
        "prepare_tool_use_checkpoint", "tiny-tool-use", seed, directory, DEFAULT_TOOL_USE_SETTINGS, settings
    )
    spec = {"recipe": _RECIPE_VERSION, "seed": seed, **chosen}

    def build(directory: Path) -> dict[str, Any]:
        built = build_tool_use_checkpoint(directory, seed=seed, **chosen)
        success = None
        if eval_prompts:
            model = AutoModelForCausalLM.from_pretrained(directory)
            tokenizer = AutoTokenizer.from_pretrained(directory)
            task = MultiplyToolTask(a_digits=chosen["a_digits"], b_digits=chosen["b_digits"])
            success = tool_use_success(model, tokenizer, task, num_prompts=eval_prompts, greedy=True)
        return {"final_loss": built["final_loss"], "greedy_success": success}

    return cached_build(target, spec, build)
