"""A peft LoRA model's weights for an engine, two ways.

:func:`merged_state_dict`: the base weights with the active adapters folded in, under the base
model's checkpoint names, computed out of place so the trainer's weights stay bit-identical; or
:func:`base_state_dict` once plus :func:`save_adapter` at every sync (for engines that apply LoRA
themselves). :func:`full_state_dict` is what an engine without adapters computes with.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_offpolicy.rollout.vllm.sync.export import checkpoint_format, export_state_dict, is_peft_model, unwrap

__all__ = [
    "adapter_rank",
    "base_state_dict",
    "check_vllm_adapter",
    "full_state_dict",
    "merged_state_dict",
    "save_adapter",
]

#: peft initialisations vLLM 0.32 loads as plain LoRA (the others change the base weights when peft loads them).
_VLLM_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def full_state_dict(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    who: str,
    for_files: bool = True,
    tied: Literal["copy", "drop"] = "copy",
) -> dict[str, torch.Tensor]:
    """The weights an engine without adapters computes with: merged for a peft model, else exported as they are.

    ``for_files``, ``tied``: as :func:`~lightning_offpolicy.rollout.vllm.sync.export.export_state_dict`'s (a
    merged peft model's tensors are always CPU copies).
    """
    if is_peft_model(source):
        return merged_state_dict(source, who, tied)
    return export_state_dict(source, who, for_files=for_files, tied=tied)


def merged_state_dict(
    model: torch.nn.Module, who: str = "merged_state_dict", tied: Literal["copy", "drop"] = "copy"
) -> dict[str, torch.Tensor]:
    """The weights a peft LoRA model computes with, under the base model's checkpoint names.

    Each LoRA-wrapped layer's weight is exported as ``W + scaling * B @ A`` summed over its active
    adapters (peft's own ``get_delta_weight``, the arithmetic of ``merge_adapter``), computed into
    a new tensor: the model's parameters are never written, so they stay bit-identical (peft's
    ``merge_adapter`` / ``unmerge_adapter`` round trip does not: ``(W + D) - D != W`` in floating
    point). Only the merged layers are copied; every other tensor is the model's own (moved to
    CPU). Names lose peft's ``base_model.model.`` and ``.base_layer`` parts; adapter tensors
    (``lora_A``, ``lora_B``, ...) are dropped; a ``modules_to_save`` layer exports the copy the
    forward uses. The result follows the model's current state: adapters disabled (``with
    model.disable_adapter():``) export the base weights, already merged adapters are not added twice.

    Args:
        model: A peft model with LoRA adapters (``peft.get_peft_model(...)``), possibly wrapped in
            DDP / ``torch.compile``.
        who: The caller, for error messages.

    Raises:
        TypeError: ``model`` is not a peft model.
        NotImplementedError: A peft method other than LoRA, or a LoRA variant whose merge is not a
            plain ``W + B @ A`` (DoRA, ...).
        ValueError: Adapters are merged in place while disabled (unmerge first).
    """
    return _peft_export(unwrap(model), merge=True, who=who, tied=tied)


def base_state_dict(
    model: torch.nn.Module, who: str = "base_state_dict", tied: Literal["copy", "drop"] = "copy"
) -> dict[str, torch.Tensor]:
    """The base weights of a peft LoRA model (adapters left out) under the base model's checkpoint names.

    What an engine that applies the adapter itself (vLLM's LoRA support) needs once, before the
    first :func:`save_adapter`. Names as in :func:`merged_state_dict`; a ``modules_to_save`` layer
    exports its original module (the trained copy belongs to the adapter).

    Raises:
        ValueError: An adapter is merged into the base weights (``merge_adapter()``): the base
            weights are then not in the model; unmerge first.
    """
    return _peft_export(unwrap(model), merge=False, who=who, tied=tied)


def adapter_rank(model: torch.nn.Module) -> int:
    """The largest LoRA rank of the active adapter of a peft model (``r`` and any ``rank_pattern``)."""
    model = unwrap(model)
    config = _active_lora_config(model, "adapter_rank")
    ranks = [int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())]
    return max(ranks)


def save_adapter(model: torch.nn.Module, directory: Path) -> Path:
    """Save the active adapter of a peft model (adapter weights and config only) into ``directory``.

    Returns:
        The directory holding ``adapter_config.json`` and ``adapter_model.safetensors``, and
        nothing else (peft puts an adapter not named ``"default"`` into a subdirectory of that name).
    """
    model = unwrap(model)
    _active_lora_config(model, "save_adapter")
    name = _active_adapter(model, "save_adapter")
    # save_embedding_layers=False: "auto" may look the base model up on the hub (no network on
    # training nodes); full embedding layers are only needed for a resized vocabulary.
    model.save_pretrained(str(directory), selected_adapters=[name], save_embedding_layers=False)
    path = directory if name == "default" else directory / name
    # peft's model card: no engine reads it, and it would be moved at every sync.
    (path / "README.md").unlink(missing_ok=True)
    return path


def check_vllm_adapter(model: torch.nn.Module, who: str) -> None:
    """Refuse an active adapter that vLLM's LoRA support cannot apply, before anything is written or sent.

    vLLM 0.32 refuses these when it loads the adapter (its ``PEFTHelper``), with an error that
    reaches the trainer as a server error at best; here the trainer names the setting at once.

    Raises:
        TypeError: ``model`` is not a peft model.
        NotImplementedError: The adapter is not LoRA, or uses a feature vLLM does not apply (DoRA,
            ``lora_bias``, ``bias``, ``modules_to_save``, an init that changes the base weights,
            aLoRA, ``layer_replication``, QALoRA).
    """
    config = _active_lora_config(unwrap(model), who)
    problems = []
    if getattr(config, "use_dora", False):
        problems.append("use_dora=True (DoRA)")
    if getattr(config, "lora_bias", False):
        problems.append("lora_bias=True")
    if getattr(config, "bias", "none") != "none":
        problems.append(f"bias={config.bias!r}")
    if getattr(config, "modules_to_save", None):
        problems.append(f"modules_to_save={list(config.modules_to_save)}")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _VLLM_PLAIN_INITS:
        problems.append(f"init_lora_weights={init!r}")
    for field in ("alora_invocation_tokens", "layer_replication", "use_qalora"):
        if getattr(config, field, None):
            problems.append(f"{field}={getattr(config, field)!r}")
    if problems:
        raise NotImplementedError(
            f"{who}: vLLM's LoRA support cannot apply this adapter ({'; '.join(problems)}): use plain LoRA, or "
            "weight_sync.lora='merged', which folds the adapter into the weights (lora_bias and modules_to_save "
            "included; DoRA in neither mode)."
        )


def _active_adapter(model: Any, who: str) -> str:
    names = list(getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", "default")])
    if len(names) != 1:
        raise ValueError(f"{who}: the peft model has {len(names)} active adapters ({names}); exactly one is needed.")
    return str(names[0])


def _active_lora_config(model: Any, who: str) -> Any:
    if not is_peft_model(model):
        raise TypeError(f"{who}: expected a peft model (peft.get_peft_model(...)), got {type(model).__name__}.")
    config = model.peft_config[_active_adapter(model, who)]
    peft_type = getattr(config, "peft_type", None)
    peft_type = getattr(peft_type, "value", peft_type)
    if peft_type != "LORA":  # AdaLoRA, X-LoRA, ... have layers like LoRA's but merge differently
        raise NotImplementedError(f"{who}: only LoRA adapters are supported, the model's adapter is {peft_type}.")
    return config


def _peft_export(model: Any, merge: bool, who: str, tied: Literal["copy", "drop"]) -> dict[str, torch.Tensor]:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    _active_lora_config(model, who)
    base = model.get_base_model()
    lora: dict[str, Any] = {}
    wrappers: dict[str, Any] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            lora[name] = module
        elif isinstance(module, ModulesToSaveWrapper):
            wrappers[name] = module
        elif isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            raise NotImplementedError(
                f"{who}: {name!r} is a {type(module).__name__}: only LoRA layers and modules_to_save can be exported."
            )
    replaced = {}
    with torch.no_grad():
        for name, module in lora.items():
            replaced.update(_lora_layer_tensors(name, module, merge, who))
    state = base.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        target = _checkpoint_name(key, lora, wrappers, merge)
        if target is None:
            continue
        if target in out:
            raise RuntimeError(f"{who}: two tensors map to the checkpoint name {target!r} ({key!r} is the second).")
        out[target] = replaced.get(key, value)
    return export_state_dict(checkpoint_format(base, out), who, tied=tied)


def _lora_layer_tensors(name: str, module: Any, merge: bool, who: str) -> dict[str, torch.Tensor]:
    """The replacement tensors of one LoRA layer: its merged weight (and bias), keyed by state-dict name."""
    merged_in = list(module.merged_adapters)
    if not merge:
        if merged_in:
            raise ValueError(
                f"{who}: adapter(s) {merged_in} are merged into {name!r}: the base weights are not in the model. "
                "Call unmerge_adapter() first."
            )
        return {}
    if module.disable_adapters:
        if merged_in:  # the forward would unmerge first: that state cannot be exported without writing
            raise ValueError(
                f"{who}: {name!r} has merged adapters {merged_in} while adapters are disabled; call "
                "unmerge_adapter() first."
            )
        return {}
    adapters = [
        a
        for a in module.active_adapters
        if (a in module.lora_A or a in getattr(module, "lora_embedding_A", {})) and a not in merged_in
    ]
    if not adapters:
        return {}
    variants = [a for a in adapters if a in getattr(module, "lora_variant", {})]
    if variants:
        raise NotImplementedError(
            f"{who}: {name!r} uses a LoRA variant ({type(module.lora_variant[variants[0]]).__name__}, e.g. DoRA) "
            "whose merge is not W + B @ A; use plain LoRA."
        )
    layer = module.get_base_layer()
    weight = layer.weight.detach()
    bias = getattr(layer, "bias", None)
    bias = None if bias is None else bias.detach()
    new_bias = None
    for adapter in adapters:
        # Out of place (`weight + ...`, never `+=`): the trainer's tensors must not change.
        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        if getattr(module, "lora_bias", {}).get(adapter, False):
            if bias is None:
                raise ValueError(f"{who}: {name!r} has lora_bias=True but its base layer has no bias.")
            bias = new_bias = bias + (module.lora_B[adapter].bias * module.scaling[adapter]).to(bias.dtype)
    # Straight to CPU: on a GPU trainer the merged copies must not pile up in device memory.
    tensors = {f"{name}.base_layer.weight": weight.to("cpu")}
    if new_bias is not None:
        tensors[f"{name}.base_layer.bias"] = new_bias.to("cpu")
    return tensors


def _checkpoint_name(key: str, lora: Mapping[str, Any], wrappers: Mapping[str, Any], merge: bool) -> str | None:
    """The base checkpoint's name of a peft state-dict key (``None``: not exported).

    A ``modules_to_save`` layer exports the copy the forward uses when merging, else the original
    (the trained copy is part of the adapter then).
    """
    parts = key.split(".")
    kept: list[str] = []
    i = 0
    while i < len(parts):
        prefix = ".".join(parts[:i])
        if prefix in lora:
            if parts[i] == "base_layer":
                i += 1
                continue
            if parts[i].startswith("lora_") or parts[i] in lora[prefix].adapter_layer_names:
                return None
        elif prefix in wrappers:
            wrapper = wrappers[prefix]
            used = _modules_to_save_used(wrapper) if merge else None
            if parts[i] == "original_module":
                if used is not None:
                    return None
                i += 1
                continue
            if parts[i] == "modules_to_save":
                if used is None or i + 1 >= len(parts) or parts[i + 1] != used:
                    return None
                i += 2
                continue
        kept.append(parts[i])
        i += 1
    return ".".join(kept)


def _modules_to_save_used(wrapper: Any) -> str | None:
    """The adapter whose ``modules_to_save`` copy the wrapper's forward uses (``None``: the original module)."""
    active = list(wrapper.active_adapters)
    if wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active):
        return None
    return active[0]
