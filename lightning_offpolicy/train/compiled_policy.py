"""``torch.compile`` of the policy's decoder for the teacher-forced forwards of a training step.

:func:`compile_policy` compiles, in place, the decoder that
:func:`~lightning_offpolicy.logprobs.head.fused_head_parts` finds under the fused head (``model.base_model``,
e.g. ``LlamaModel``): the forward and its backward run as inductor graphs, and the fused head keeps
computing the logprobs from the hidden states as before. The graph is built with dynamic shapes, so the
packed micro-batches of a step (a different number of tokens each) share a few graphs instead of
compiling per length: one per grad mode, plus the specializations dynamo and inductor make (a micro-batch
packed into a single row; on CPU, one of more than 4096 packed positions).

Only the call is replaced (``Module._compiled_call_impl``, which ``Module.compile`` sets): the parameters,
their names and the ``state_dict`` keys are those of the eager model, so checkpoints load either way.
Calls with a KV cache (``generate``, the HF engine sharing the policy's weights) stay eager, and a
copy of the model (``copy.deepcopy``: the HF engines' own copies) is an eager model.

:func:`resolve_compile` decides, from the ``compile_policy`` setting, the policy and the strategy,
whether to compile (docs/training.md, "Compiled policy").
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_offpolicy.logprobs.head import fused_head_parts

__all__ = [
    "AUTO_COMPILE_DEVICES",
    "COMPILE_MODES",
    "CompileMode",
    "compile_policy",
    "compile_refusal",
    "is_compiled",
    "resolve_compile",
]

CompileMode = Literal["auto", "on", "off"]
COMPILE_MODES: tuple[str, ...] = ("auto", "on", "off")

#: Device types on which ``compile_policy="auto"`` compiles. None: on CPU the compiled decoder was not
#: faster than the eager one for the tiny and small models measured (docs/reports/performance_compile.md),
#: and no accelerator has been measured.
AUTO_COMPILE_DEVICES: frozenset[str] = frozenset()


class _DecoderCall:
    """A decoder's ``__call__``: compiled for forwards without a KV cache, eager for the others.

    Installed as ``module._compiled_call_impl`` (what ``Module.__call__`` runs when set). A deep copy of
    the module gets ``None`` there, i.e. an eager module: the compiled function holds the original
    module, and a copy that called it would run the original's weights. It pickles to ``None`` too
    (compiled functions do not pickle).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.eager = module._call_impl
        # dynamic=True: symbolic sizes from the first call, so a new micro-batch length is no new graph.
        self.compiled = torch.compile(module._call_impl, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # generate() and the HF engines' sampling loop pass use_cache=True and a growing cache: a
        # graph per decoding step would cost more than it saves; the logprob forwards pass use_cache=False.
        if kwargs.get("use_cache") is False and kwargs.get("past_key_values") is None:
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _none, ()


def _none() -> None:
    return None


def compile_refusal(policy: torch.nn.Module, sharded: bool = False) -> str | None:
    """Why the policy's decoder cannot be compiled here, or ``None`` when it can.

    Args:
        policy: The causal LM (or a peft LoRA model around one), after LoRA and gradient checkpointing.
        sharded: Whether FSDP2 shards it (``ModelParallelStrategy``).

    Returns:
        ``None``, or a sentence saying why not.
    """
    if sharded:
        return (
            "the policy is sharded by FSDP2 (ModelParallelStrategy): its forwards run the model's own forward "
            "through FSDP's hooks, which this compiles no part of"
        )
    parts = fused_head_parts(policy)
    if isinstance(parts, str):
        return f"only the decoder under the fused head is compiled, and this policy's head cannot be fused: {parts}"
    return None


def resolve_compile(
    mode: CompileMode, policy: torch.nn.Module, device: torch.device, sharded: bool, setting: str
) -> bool:
    """Whether to compile the policy's decoder: ``mode`` against the model, the strategy and the device.

    Args:
        mode: ``"auto"`` (where :data:`AUTO_COMPILE_DEVICES` holds the device's type and the model allows
            it), ``"on"`` (required) or ``"off"``.
        policy: The policy, as :func:`compile_refusal` takes it.
        device: The device the policy trains on.
        sharded: Whether FSDP2 shards the policy.
        setting: The setting's name, for the error (``"OffPolicyRLModule.compile_policy"``).

    Raises:
        ValueError: ``mode="on"`` and the policy cannot be compiled (the reason is given).
    """
    if mode == "off":
        return False
    refusal = compile_refusal(policy, sharded)
    if mode == "on" and refusal is not None:
        raise ValueError(f"{setting}='on', but {refusal}. Set {setting}='auto' or 'off' (eager forwards).")
    return refusal is None and (mode == "on" or device.type in AUTO_COMPILE_DEVICES)


def compile_policy(model: torch.nn.Module) -> torch.nn.Module:
    """Compile ``model``'s decoder in place (see the module docstring); once, a second call changes nothing.

    Args:
        model: A causal LM that :func:`compile_refusal` accepts (the policy or a frozen reference copy).

    Returns:
        The decoder that was compiled.

    Raises:
        ValueError: The model's head cannot be fused (no separate decoder to compile).
    """
    parts = fused_head_parts(model)
    if isinstance(parts, str):
        raise ValueError(f"compile_policy: {parts}.")
    decoder = parts[0]
    if not isinstance(decoder._compiled_call_impl, _DecoderCall):
        decoder._compiled_call_impl = _DecoderCall(decoder)
    return decoder


def is_compiled(model: torch.nn.Module | None) -> bool:
    """Whether :func:`compile_policy` compiled ``model``'s decoder (``False`` for ``None`` and other models)."""
    if model is None:
        return False
    parts = fused_head_parts(model)
    return not isinstance(parts, str) and isinstance(parts[0]._compiled_call_impl, _DecoderCall)
