"""Finding a causal LM's head that can be fused, and the fused logprobs of that head (LoRA adapters included).

:func:`fused_head_parts` says whether a model's forward is ``lm_head(decoder(...))`` with nothing
after the head, and returns the two; :func:`fused_head_token_logprobs` runs
:func:`~lightning_offpolicy.logprobs.fused.fused_linear_token_logprobs` on that head, a plain
``nn.Linear`` or a peft LoRA ``Linear`` around one (docs/logprobs.md, "LoRA on the head").
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from lightning_offpolicy.argcheck import is_real
from lightning_offpolicy.logprobs.fused import fused_linear_token_logprobs

__all__ = ["FUSED_HEAD_ARCHITECTURES", "fused_head_parts", "fused_head_token_logprobs"]

#: transformers causal-LM classes whose forward is ``lm_head(last_hidden_state[:, keep])`` with
#: nothing after it other than what a config attribute in ``_LOGIT_TRANSFORMS`` announces (checked
#: in transformers 5.x). Other classes use the fused head only when asked (``fused_head=True``).
FUSED_HEAD_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Olmo2ForCausalLM",
    }
)


#: Config attributes of a model that changes its logits after ``lm_head`` (name -> the value
#: that means "no change"): soft-capping (Gemma 2/3), scaling (Cohere, Granite, Falcon-H1).
_LOGIT_TRANSFORMS: dict[str, Any] = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
    "output_multiplier": 1.0,
}


def _is_sharded(module: nn.Module, head: nn.Module) -> bool:
    """True for FSDP2 / DTensor models: their root hooks must run, i.e. the model's own forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule) or isinstance(head.weight, DTensor)


def _no_hooks(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _peft_lora_linear_type() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # peft not installed
        return None
    return Linear


def _head_adapters(head: nn.Module) -> tuple[nn.Linear, list[tuple[nn.Module, nn.Linear, nn.Linear, float]]] | str:
    """The plain ``nn.Linear`` and the LoRA adapters ``(dropout, lora_A, lora_B, scaling)`` of a head.

    A plain ``nn.Linear`` has no adapters. A peft ``lora.Linear`` around one is taken apart the
    way its forward reads it (peft 0.17 - 0.21): adapters disabled -> the base layer alone;
    merged -> the base layer alone (its weight already holds ``B A * scaling``); otherwise
    ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` for each active adapter. Anything
    else (DoRA and other LoRA variants, ``lora_bias``, ``fan_in_fan_out``, a disabled adapter on
    merged weights, which the forward unmerges first, hooks) is refused with the reason.
    """
    if type(head) is nn.Linear:
        return (head, []) if _no_hooks(head) else "lm_head has forward hooks or a patched forward"
    lora_linear = _peft_lora_linear_type()
    if lora_linear is None or type(head) is not lora_linear:
        return (
            f"the output embedding is {type(head).__name__}, not a torch.nn.Linear or a peft LoRA "
            "Linear around one (e.g. a quantized head)"
        )
    base = head.base_layer
    if type(base) is not nn.Linear:
        return f"LoRA on lm_head wraps a {type(base).__name__}, not a plain torch.nn.Linear"
    if not (_no_hooks(head) and _no_hooks(base)):
        return "lm_head (LoRA) has forward hooks or a patched forward"
    if getattr(head, "fan_in_fan_out", False):
        return "LoRA on lm_head has fan_in_fan_out=True"
    if head.disable_adapters:
        if head.merged:
            return "LoRA on lm_head is merged but disabled (its forward unmerges the weights first)"
        return base, []
    if head.merged:
        return base, []
    adapters: list[tuple[nn.Module, nn.Linear, nn.Linear, float]] = []
    for name in head.active_adapters:
        if name not in head.lora_A.keys():
            continue
        variants = getattr(head, "lora_variant", {})
        if name in variants or getattr(head, "use_dora", {}).get(name, False):
            variant = type(variants.get(name)).__name__
            return f"LoRA adapter {name!r} on lm_head is a LoRA variant ({variant}, e.g. DoRA), not plain LoRA"
        if getattr(head, "lora_bias", {}).get(name, False):
            return f"LoRA adapter {name!r} on lm_head has lora_bias=True"
        lora_a, lora_b, dropout = head.lora_A[name], head.lora_B[name], head.lora_dropout[name]
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None:
            return f"LoRA adapter {name!r} on lm_head: lora_A / lora_B are not plain bias-free nn.Linear"
        if type(dropout) not in (nn.Dropout, nn.Identity):
            return f"LoRA adapter {name!r} on lm_head has a {type(dropout).__name__} dropout"
        if not all(_no_hooks(m) for m in (lora_a, lora_b, dropout)):
            return f"LoRA adapter {name!r} on lm_head has forward hooks"
        scaling = head.scaling[name]
        if not is_real(scaling) or not math.isfinite(float(scaling)):
            return f"LoRA adapter {name!r} on lm_head has a non-scalar scaling"
        adapters.append((dropout, lora_a, lora_b, float(scaling)))
    return base, adapters


def fused_head_token_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`fused_linear_token_logprobs` of a head that :func:`fused_head_parts` accepted.

    For a plain ``nn.Linear`` its weight and bias; for peft LoRA on the head, the base layer's
    weight and bias plus one low-rank term per active adapter,
    ``u = lora_A(dropout(hidden))`` (``hidden`` cast to ``lora_A``'s dtype first, as peft does),
    ``B = lora_B.weight``, ``scale = scaling``. The adapters' dropout runs here, on the hidden
    states the head sees, as in the model's own forward.

    Rounding differs from peft's forward only where it rounds: peft adds the float32 adapter
    output to the bf16 base output and rounds the sum to bf16; here both are summed in float32.

    Args:
        head: the model's output layer, as :func:`fused_head_parts` returned it.
        hidden: ``[..., H]`` hidden states the head is applied to.
        targets, temperature, chunk_size, return_entropy: as in
            :func:`~lightning_offpolicy.logprobs.fused.fused_linear_token_logprobs`.

    Returns:
        What :func:`~lightning_offpolicy.logprobs.fused.fused_linear_token_logprobs` returns.

    Raises:
        ValueError: the head cannot be fused (the reason).
    """
    parts = _head_adapters(head)
    if isinstance(parts, str):
        raise ValueError(f"the head cannot be fused: {parts}.")
    base, adapters = parts
    low_rank = []
    for dropout, lora_a, lora_b, scaling in adapters:
        x = head._cast_input_dtype(hidden, lora_a.weight.dtype)
        low_rank.append((lora_a(dropout(x)), lora_b.weight, scaling))
    return fused_linear_token_logprobs(
        hidden,
        base.weight,
        targets,
        bias=base.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        low_rank=low_rank,
    )


def fused_head_parts(model: nn.Module, force: bool = False) -> tuple[nn.Module, nn.Module] | str:
    """The ``(decoder, lm_head)`` of a transformers causal LM whose head can be fused, or why not.

    The decoder (``model.base_model``, e.g. ``LlamaModel``) returns the final-normed hidden
    states; the head must be a plain ``nn.Linear`` without hooks, or a peft LoRA ``Linear``
    around one with plain LoRA adapters (see :func:`fused_head_token_logprobs`; DoRA and other
    variants are refused). A peft model with adapters injected into its layers (LoRA) is
    unwrapped (its layers keep the adapters); prompt learning is not (the peft forward adds
    virtual tokens).

    Args:
        model: the causal LM (or a peft model around one).
        force: accept a class outside :data:`FUSED_HEAD_ARCHITECTURES` when the structure fits
            (the caller vouches that its forward applies nothing after ``lm_head``).

    Returns:
        ``(decoder, head)`` (give ``head`` to :func:`fused_head_token_logprobs`), or a sentence
        saying why the head cannot be fused.
    """
    base = model
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and hasattr(model, "get_base_model"):
        if getattr(peft_config, "is_prompt_learning", False):
            return "a peft prompt-learning model (its forward adds virtual tokens)"
        base = model.get_base_model()
    for m in {id(model): model, id(base): base}.values():
        if not _no_hooks(m):
            return f"{type(m).__name__} has forward hooks or a patched forward, which the fused path would skip"
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        return f"the output embedding is {type(head).__name__}, not a torch.nn.Linear"
    parts = _head_adapters(head)
    if isinstance(parts, str):
        return parts
    linear, adapters = parts
    if not linear.weight.is_floating_point() or not all(b.weight.is_floating_point() for _, _, b, _ in adapters):
        return "lm_head's weight is not floating point"
    if _is_sharded(model, linear) or _is_sharded(base, linear):
        return "the model is sharded (FSDP / DTensor): its own forward must run"
    config = getattr(base, "config", None)
    for attr, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, attr, neutral)
        if value is not None and value != neutral and not (neutral is None and value == 0):
            return f"config.{attr} = {value!r} changes the logits after lm_head"
    if not force and type(base).__name__ not in FUSED_HEAD_ARCHITECTURES:
        return f"{type(base).__name__} is not in FUSED_HEAD_ARCHITECTURES (pass fused_head=True to force)"
    decoder = getattr(base, "base_model", None)
    if not isinstance(decoder, nn.Module) or decoder is base:
        return f"{type(base).__name__} has no separate decoder (base_model)"
    return decoder, head
