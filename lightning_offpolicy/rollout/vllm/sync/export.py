"""Export the trainer's weights for an engine: CPU tensors under checkpoint names, written atomically.

Any engine that loads the trainer's weights from safetensors files (the in-process
:class:`~lightning_offpolicy.rollout.VLLMEngine`, a remote ``vllm serve`` server reading a shared
directory) takes them from :func:`export_state_dict` (wrappers removed, tied weights un-shared as
safetensors requires, or left out for an engine) and :func:`write_safetensors` (a reader never sees a
half-written file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_offpolicy.argcheck import is_int

__all__ = [
    "checkpoint_format",
    "export_state_dict",
    "is_peft_model",
    "make_private_dirs",
    "unique_tensors",
    "unwrap",
    "weight_source",
    "write_safetensors",
]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / DataParallel / ``torch.compile`` wrappers (their names carry prefixes)."""
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
            module = module._orig_mod
        else:
            return module


def is_peft_model(source: Any) -> bool:
    """Whether ``source`` is a peft model (LoRA adapters around a base model)."""
    return type(source).__module__.startswith("peft.")


def export_state_dict(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    who: str,
    for_files: bool = True,
    tied: Literal["copy", "drop"] = "copy",
) -> dict[str, torch.Tensor]:
    """The tensors of ``source`` (a module or a state dict) on CPU, contiguous, with no shared storage.

    ``who`` names the caller in error messages (e.g. ``"VLLMEngine.update_weights"``). Sharded
    (FSDP2 DTensor) parameters are gathered whole: a collective, so every rank must call it.
    ``for_files=False``: the tensors as they are (any device, no copy), for a sync that copies
    them into its own buffer.

    ``tied``: what becomes of a tensor that is the same as an earlier one (a tied output layer,
    ``lm_head.weight`` after ``model.embed_tokens.weight``). ``"copy"``: exported under its own
    name too (what ``load_state_dict(strict=True)`` needs); ``"drop"``: left out, as
    ``save_pretrained`` leaves it out (what a vLLM engine loads: some of its models, Gemma-2's,
    have no output layer of their own and refuse the name; the others tie it themselves, and the
    kit's receiver processes the tied layer again, :mod:`~lightning_offpolicy.rollout.vllm.worker_extension`).
    """
    if isinstance(source, torch.nn.Module):
        model = unwrap(source)
        state = checkpoint_format(model, model.state_dict())
    else:
        state = source
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{who}: {name!r} is a {type(value).__name__}, not a tensor.")
    if tied == "drop":
        state = unique_tensors(state)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # CPU storages exported so far (for files)
    for name, value in state.items():
        tensor = value.detach()
        if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2): the engine needs the whole parameter
            tensor = tensor.full_tensor()
        if not for_files:
            tensors[name] = tensor
            continue
        tensor = tensor.to("cpu")
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if ptr in storages:  # tied weights: safetensors refuses shared storage
            tensor = tensor.clone()
        storages.add(ptr)
        tensors[name] = tensor.contiguous()
    return tensors


def checkpoint_format(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s state dict, or tensors under its names) under the checkpoint's names and layout.

    transformers 5 keeps some families in memory under other names or fused (Mixtral's experts under
    ``mlp.experts`` as one ``gate_up_proj``; the checkpoint has ``block_sparse_moe.experts.N.w1``):
    engines load checkpoints, so the export undoes that conversion as ``save_pretrained`` does
    (``revert_weight_conversion``). Sharded (DTensor) tensors are left as they are.
    """
    if any(hasattr(t, "full_tensor") for t in state.values()):
        return state
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # an older transformers: names in memory are the checkpoint's
        return state
    if not isinstance(model, PreTrainedModel):
        return state
    return revert_weight_conversion(model, dict(state))


def unique_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` less every one that is the same tensor as an earlier one (a tied ``lm_head.weight``).

    The same: one storage at one offset with one shape (a DTensor: the same object).
    """
    seen: set[tuple] = set()
    unique = {}
    for name, tensor in tensors.items():
        if hasattr(tensor, "full_tensor") or tensor.numel() == 0:
            key: tuple = (id(tensor),)
        else:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = tensor
    return unique


def weight_source(
    source: torch.nn.Module | Mapping[str, torch.Tensor], version: int, who: str
) -> tuple[torch.nn.Module | Mapping[str, torch.Tensor], bool]:
    """Check the arguments of an engine's ``update_weights``; returns ``(source unwrapped, is a module)``."""
    if not is_int(version):
        raise TypeError(f"{who}: version must be an int, got {version!r}.")
    is_module = isinstance(source, torch.nn.Module)
    if not is_module and not isinstance(source, Mapping):
        raise TypeError(
            f"{who}: source must be a torch.nn.Module or a mapping of parameter names to tensors, "
            f"got {type(source).__name__}."
        )
    return (unwrap(source) if is_module else source), is_module


def make_private_dirs(directory: Path, mode: int = 0o700) -> list[Path]:
    """Create ``directory`` and each missing parent with exactly ``mode``, whatever the umask; the ones created.

    ``Path.mkdir(parents=True, mode=...)`` gives the parents it creates the umask's default
    (``0777`` under umask 000) and the leaf ``mode`` less the umask. Existing directories are
    left as they are.
    """
    missing: list[Path] = []
    current = Path(os.path.abspath(directory))
    while not current.is_dir():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir(mode=mode)
        except FileExistsError:  # another process made it in between: not ours to change
            if not path.is_dir():
                raise
            continue
        os.chmod(path, mode)
        created.append(path)
    return created


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], directory: Path, filename: str = "model.safetensors", mode: int = 0o600
) -> Path:
    """Write ``tensors`` to ``directory / filename`` atomically; returns the file's path.

    The partial file's name does not end in ``.safetensors``, so a loader globbing the directory
    never picks it up. The file gets exactly ``mode`` (default owner-only) before it takes its
    name, whatever the umask: the engine loads what it finds there, so no other user may write it.
    A missing ``directory`` (and each missing parent) is created ``0700``, whatever the umask.
    """
    from safetensors.torch import save_file

    make_private_dirs(directory, 0o700)
    target = directory / filename
    partial = directory / (filename + ".partial")
    save_file(dict(tensors), str(partial))
    os.chmod(partial, mode)
    os.replace(partial, target)
    return target
