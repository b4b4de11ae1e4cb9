"""Building the policy that :class:`~lightning_offpolicy.OffPolicyRLModule` trains.

From a model spec to the modules of a training step, in the order ``configure_model`` applies them:

1. :func:`load_policy`: a local path, a hub name or a spec of a registered scheme such as
   ``"tiny:<task>"`` (:func:`resolve_model_spec`) becomes a ``transformers`` causal LM and its tokenizer;
2. :func:`add_lora`: peft LoRA adapters, the only trained parameters;
3. :func:`build_reference`: the reference policy of the reference KL loss: a frozen copy, or the
   base model behind a peft model's ``disable_adapter()`` (no second copy), or none;
4. :func:`enable_gradient_checkpointing` and :func:`shard_fsdp2` (FSDP2 ``fully_shard`` per decoder
   layer, then the root, for ``ModelParallelStrategy``).

:func:`resolve_packing` decides, once the policy is built, whether its micro-batches run packed.

The core does not import the demo models: ``tiny:`` specs reach them through the
``lightning_offpolicy.model_specs`` entry points (:func:`resolve_model_spec`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from importlib.metadata import entry_points
from typing import Any, Literal

import torch

from lightning_offpolicy.data.tokenizers import HFTokenizer

ReferenceMode = Literal["auto", "none", "frozen_copy", "disable_adapter"]
REFERENCE_MODES: tuple[str, ...] = ("auto", "none", "frozen_copy", "disable_adapter")
PackingMode = Literal["auto", "on", "off"]
PACKING_MODES: tuple[str, ...] = ("auto", "on", "off")

#: The entry-point group of model-spec schemes: ``name = "module:function"`` resolves ``"name:..."`` specs to a
#: local checkpoint directory (the kit registers ``tiny``, its demo checkpoints built on first use).
MODEL_SPEC_GROUP = "lightning_offpolicy.model_specs"


def resolve_model_spec(model: str | os.PathLike) -> str:
    """The local directory or hub name a model spec stands for.

    ``"SCHEME:REST"`` goes to the function registered under ``SCHEME`` in the
    :data:`MODEL_SPEC_GROUP` entry points (``"tiny:reverse"``: the demo's tiny checkpoints); anything
    else (a local directory, a hub name, a path whose prefix names no scheme) is returned as given.

    Raises:
        ValueError: The scheme's resolver refused the spec (its message says why).
    """
    name = os.fspath(model)
    scheme, colon, _ = name.partition(":")
    if not colon or not scheme.isidentifier():
        return name
    found = entry_points(group=MODEL_SPEC_GROUP, name=scheme)
    if not found:
        return name
    return os.fspath(next(iter(found)).load()(name))


def load_policy(model: str, torch_dtype: str, tokenizer: Any = None) -> tuple[torch.nn.Module, Any]:
    """The causal LM named by ``model`` and its tokenizer.

    Args:
        model: A local directory, a hub name, or a registered scheme's spec such as ``"tiny:<task>"``
            (:func:`resolve_model_spec`: the demo's tiny checkpoints, built on first use).
        torch_dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the dtype the weights load in.
        tokenizer: ``None``: loaded from the model's directory; an ``HFTokenizer`` without its files
            (configured options only): its files are loaded from the model's directory; anything
            else is returned as is.

    Returns:
        ``(policy, tokenizer)``.
    """
    from lightning_offpolicy.data.tokenizers import load_tokenizer
    from lightning_offpolicy.preflight import check_hub_model

    path = resolve_model_spec(model)
    check_hub_model(path)  # a name that cannot be downloaded fails now, not after a minute of retries
    from transformers import AutoModelForCausalLM

    # The tokenizer first: a directory without tokenizer files fails in a second, not after the weights loaded.
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    elif isinstance(tokenizer, HFTokenizer) and not tokenizer.loaded:
        tokenizer.load(path)  # options from the config, files from the model's directory
    from transformers import AutoConfig

    attention = faithful_attention(AutoConfig.from_pretrained(path))
    kwargs = {"attn_implementation": attention} if attention else {}
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, torch_dtype), **kwargs)
    return policy, tokenizer


def faithful_attention(config: Any) -> str | None:
    """The attention implementation the policy must load with to compute what its architecture defines
    (``None``: transformers' default).

    transformers' default, ``sdpa``, drops the attention logit soft-capping of Gemma-2-style configs
    (``attn_logit_softcapping``), which vLLM applies: the trainer would score another policy than the
    engine samples (docs/training.md, "Weight sync across model families"). ``eager`` applies it.
    """
    if getattr(config, "attn_logit_softcapping", None) and getattr(config, "_attn_implementation", None) in (
        None,
        "sdpa",
    ):
        return "eager"
    return None


def add_lora(policy: torch.nn.Module, rank: int, alpha: float, target_modules: list[str] | str) -> torch.nn.Module:
    """``policy`` wrapped in peft LoRA adapters of ``rank`` (unchanged when ``rank == 0`` or already a peft model).

    Args:
        policy: The causal LM.
        rank: Adapter rank; 0 adds none (full fine-tuning).
        alpha: Scaling numerator: the update is ``alpha / rank * B @ A``.
        target_modules: Module names (or ``"all-linear"``) the adapters wrap.
    """
    if rank <= 0 or hasattr(policy, "disable_adapter"):
        return policy
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,  # the policy runs without dropout (see OffPolicyRLModule.configure_model)
        task_type="CAUSAL_LM",
    )
    return get_peft_model(policy, config)


def effective_reference_mode(mode: ReferenceMode, policy: torch.nn.Module, ref_kl_coef: float) -> str:
    """What ``mode`` means for this policy: ``"auto"`` is ``"none"`` without a reference KL loss,
    else ``"disable_adapter"`` for a peft model and ``"frozen_copy"`` otherwise.

    Args:
        mode: The configured reference mode.
        policy: The policy (after :func:`add_lora`).
        ref_kl_coef: ``PolicyLossConfig.ref_kl_coef``.
    """
    if mode != "auto":
        return mode
    if ref_kl_coef <= 0:
        return "none"
    return "disable_adapter" if hasattr(policy, "disable_adapter") else "frozen_copy"


def build_reference(
    policy: torch.nn.Module,
    mode: ReferenceMode,
    ref_kl_coef: float,
    existing: torch.nn.Module | None = None,
) -> torch.nn.Module | None:
    """The separate reference model the mode needs: a frozen copy of ``policy``, or ``None``.

    Args:
        policy: The policy (after :func:`add_lora`): the copy is taken now, before any training.
        mode: The configured reference mode.
        ref_kl_coef: ``PolicyLossConfig.ref_kl_coef``.
        existing: A reference built before; returned instead of a second copy.

    Raises:
        ValueError: A reference KL loss with ``mode="none"``, or ``"disable_adapter"`` without a peft policy.
    """
    effective = effective_reference_mode(mode, policy, ref_kl_coef)
    if ref_kl_coef > 0 and effective == "none":
        raise ValueError("PolicyLossConfig.ref_kl_coef > 0 needs a reference: set reference='auto' or another mode.")
    if effective == "disable_adapter" and not hasattr(policy, "disable_adapter"):
        raise ValueError("reference='disable_adapter' needs a peft model (with LoRA adapters) as the policy.")
    if effective == "frozen_copy" and existing is None:
        return copy.deepcopy(policy).requires_grad_(False).eval()
    return existing


@contextlib.contextmanager
def reference_policy(
    policy: torch.nn.Module, reference_model: torch.nn.Module | None, mode: str
) -> Iterator[torch.nn.Module]:
    """The model whose forward gives the reference logprobs, for the duration of the block.

    Args:
        policy: The policy.
        reference_model: The frozen copy, if any (:func:`build_reference`).
        mode: The effective mode (:func:`effective_reference_mode`): with ``"disable_adapter"`` the
            policy itself with its adapters off.
    """
    if mode == "disable_adapter":
        with policy.disable_adapter():
            yield policy
    else:
        yield reference_model


def enable_gradient_checkpointing(policy: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass, keeping the policy's dropout off.

    Args:
        policy: A ``transformers`` model (or a peft model around one), in eval mode.

    Raises:
        ValueError: ``policy`` has no ``gradient_checkpointing_enable``.
    """
    if not hasattr(policy, "gradient_checkpointing_enable"):
        raise ValueError(
            "OffPolicyRLModule.gradient_checkpointing=True needs a transformers model "
            "(with gradient_checkpointing_enable)."
        )
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers recomputes a layer only when that layer is in training mode. Flip the flag on
    # the decoder layers alone (not recursively): their attention / MLP / dropout stay in eval mode.
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in policy.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def shard_fsdp2(models: Sequence[torch.nn.Module | None], device_mesh: Any) -> None:
    """FSDP2 ``fully_shard`` of every decoder layer (the model's ``_no_split_modules``), then of each root.

    Args:
        models: The policy and the reference model; ``None`` entries are skipped.
        device_mesh: ``ModelParallelStrategy``'s mesh; its ``"data_parallel"`` dimension when it has one.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"] if "data_parallel" in device_mesh.mesh_dim_names else device_mesh
    for model in models:
        if model is None:
            continue
        layer_types = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)


def check_packing_mode(mode: object, setting: str) -> None:
    """Refuse a packing mode that is not one of :data:`PACKING_MODES`.

    Args:
        mode: The configured value.
        setting: The setting's name, for the error (``"OffPolicyRLModule.packing"``).

    Raises:
        ValueError: ``mode`` is not ``"auto"``, ``"on"`` or ``"off"``.
    """
    if mode not in PACKING_MODES:
        raise ValueError(
            f"{setting}={mode!r} is not known; allowed: 'auto' (packed where the model allows it), 'on' (required) "
            "or 'off' (padded)."
        )


def resolve_packing(mode: PackingMode, models: Sequence[torch.nn.Module | None], setting: str) -> bool:
    """Whether micro-batches run packed: ``mode`` against what the models allow.

    Args:
        mode: ``"auto"`` (packed where every model allows it), ``"on"`` (required) or ``"off"``.
        models: The models whose forwards run on the micro-batches (the policy, the reference); ``None``
            entries are skipped.
        setting: The setting's name, for the error (``"OffPolicyRLModule.packing"``).

    Raises:
        ValueError: ``mode="on"`` and a model cannot run packed sequences (the reason is given).
    """
    from lightning_offpolicy.logprobs.packed import packing_refusal

    if mode == "off":
        return False
    refusals = [reason for model in models if model is not None and (reason := packing_refusal(model)) is not None]
    if refusals and mode == "on":
        raise ValueError(
            f"{setting}='on', but this model cannot train on packed micro-batches: {refusals[0]}. Set {setting}='auto' "
            "(packed where the model allows it, padded otherwise) or 'off'."
        )
    return not refusals
