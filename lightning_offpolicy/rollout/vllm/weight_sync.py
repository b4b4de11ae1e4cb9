"""Engine-independent pieces of a weight sync: export the trainer's weights, check they arrived.

Any engine that loads the trainer's weights from safetensors files (the in-process
:class:`~lightning_offpolicy.rollout.VLLMEngine`, a remote ``vllm serve`` server reading a shared
directory) uses the same three steps:

1. :func:`export_state_dict`: the trainer's tensors on CPU under checkpoint names (wrappers
   removed, tied weights un-shared, as safetensors requires);
2. :func:`write_safetensors`: written atomically (a reader never sees a half-written file);
3. :class:`SyncCheck`: the engine's logprobs of a fixed probe sequence against the trainer's,
   raising when they disagree by more than the engine's precision explains
   (:class:`SyncTolerance`), or when the engine's did not move while the trainer's did (a sync
   that silently never arrived: a known failure of LoRA syncs in peer frameworks).

A peft LoRA model is exported one of two ways: :func:`merged_state_dict` (the base weights with
the active adapters folded in, under the base model's checkpoint names, computed out of place so
the trainer's weights stay bit-identical), or :func:`base_state_dict` once plus
:func:`save_adapter` at every sync (for engines that apply LoRA themselves).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_int

__all__ = [
    "SyncCheck",
    "SyncTolerance",
    "adapter_rank",
    "base_state_dict",
    "export_state_dict",
    "full_state_dict",
    "is_peft_model",
    "merged_state_dict",
    "probe_ids",
    "save_adapter",
    "sync_tolerance",
    "trainer_probe_logprobs",
    "unwrap",
    "weight_source",
    "write_safetensors",
]

#: Length of the self-check's probe sequence (tokens).
PROBE_LENGTH = 32
_PROBE_SEED = 20240611


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


def export_state_dict(source: torch.nn.Module | Mapping[str, torch.Tensor], who: str) -> dict[str, torch.Tensor]:
    """The tensors of ``source`` (a module or a state dict) on CPU, contiguous, with no shared storage.

    ``who`` names the caller in error messages (e.g. ``"VLLMEngine.update_weights"``). Sharded
    (FSDP2 DTensor) parameters are gathered whole: a collective, so every rank must call it.
    """
    state = unwrap(source).state_dict() if isinstance(source, torch.nn.Module) else source
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{who}: {name!r} is a {type(value).__name__}, not a tensor.")
        tensor = value.detach()
        if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2): the engine needs the whole parameter
            tensor = tensor.full_tensor()
        tensor = tensor.to("cpu")
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if ptr in seen:  # tied weights: safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(ptr)
        tensors[name] = tensor.contiguous()
    return tensors


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


def full_state_dict(source: torch.nn.Module | Mapping[str, torch.Tensor], who: str) -> dict[str, torch.Tensor]:
    """The weights an engine without adapters computes with: merged for a peft model, else exported as they are."""
    return merged_state_dict(source, who) if is_peft_model(source) else export_state_dict(source, who)


@dataclass(frozen=True)
class SyncTolerance:
    """The probe check's per-token bound: ``|engine_t - trainer_t| <= atol + rtol * |trainer_t|``.

    Why a relative part: an engine in reduced precision differs from a float32 trainer in
    proportion to the size of the logits, not by a fixed amount. Once the policy is peaked, the
    random probe tokens sit deep in the tail (logprobs of -100 and below) and a healthy bfloat16
    engine differs there by more than any fixed tolerance small enough to mean something: the
    flagship bfloat16 config died at batch ~235 of 300 on a difference of 1.2 nats. Measured on
    the tiny Llama with a bfloat16 vLLM engine, ``lm_head`` scaled by 1 to 100 (probe logprobs
    from -6 to -1000): ``|engine - trainer| / (1 + |trainer|)`` stayed at or below 0.011 (1.4
    ``eps``), while weights that did not arrive, or arrived under the wrong names, differ by tens
    of percent of ``|trainer|``.

    Attributes:
        atol: Absolute part (nats): the whole bound when engine and trainer are both float32.
        rtol: Relative part: ``16 * eps`` of the coarsest dtype of engine and trainer (bfloat16:
            0.125, float16: 0.0156), 0 when both are float32.
    """

    atol: float
    rtol: float = 0.0

    def bound(self, trainer: torch.Tensor) -> torch.Tensor:
        """The largest accepted |engine - trainer| of each probe token."""
        return self.atol + self.rtol * trainer.abs()

    def __str__(self) -> str:
        return f"{self.atol:g}" if self.rtol == 0 else f"{self.atol:g} + {self.rtol:g} * |trainer logprob|"


def weights_dtype(module: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most of ``module``'s parameter elements (a peft model: its base's).

    What an engine should compute in to sample the policy the trainer trains: a LoRA model's float32
    adapters around a bfloat16 base count as bfloat16.
    """
    counts: dict[torch.dtype, int] = {}
    for param in module.parameters():
        if param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    if not counts:
        raise ValueError(f"{type(module).__name__} has no floating-point parameters.")
    return max(counts, key=counts.__getitem__)


#: Safety factor over the machine epsilon of a reduced-precision dtype (measured need: 1.4).
_RTOL_EPS_FACTOR = 16.0


def sync_tolerance(engine_dtype: torch.dtype | None, module: torch.nn.Module, atol: float | None) -> SyncTolerance:
    """The probe check's bound for an engine computing in ``engine_dtype`` against ``module``.

    Args:
        engine_dtype: The engine's compute dtype (``None``: unknown, taken as bfloat16).
        module: The trainer's module (its parameters' dtype counts too).
        atol: The user's ``weight_sync_tolerance``; ``None``: ``1e-3`` when engine and trainer
            are both float32, else ``1.0``.
    """
    dtypes = [engine_dtype or torch.bfloat16, next(module.parameters()).dtype]
    reduced = [d for d in dtypes if d.is_floating_point and torch.finfo(d).bits < 32]
    if not reduced:
        return SyncTolerance(atol=1e-3 if atol is None else float(atol))
    eps = max(torch.finfo(d).eps for d in reduced)
    return SyncTolerance(atol=1.0 if atol is None else float(atol), rtol=_RTOL_EPS_FACTOR * eps)


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


# ---------------------------------------------------------------------- peft (LoRA) models


def merged_state_dict(model: torch.nn.Module, who: str = "merged_state_dict") -> dict[str, torch.Tensor]:
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
    return _peft_export(unwrap(model), merge=True, who=who)


def base_state_dict(model: torch.nn.Module, who: str = "base_state_dict") -> dict[str, torch.Tensor]:
    """The base weights of a peft LoRA model (adapters left out) under the base model's checkpoint names.

    What an engine that applies the adapter itself (vLLM's LoRA support) needs once, before the
    first :func:`save_adapter`. Names as in :func:`merged_state_dict`; a ``modules_to_save`` layer
    exports its original module (the trained copy belongs to the adapter).

    Raises:
        ValueError: An adapter is merged into the base weights (``merge_adapter()``): the base
            weights are then not in the model; unmerge first.
    """
    return _peft_export(unwrap(model), merge=False, who=who)


def adapter_rank(model: torch.nn.Module) -> int:
    """The largest LoRA rank of the active adapter of a peft model (``r`` and any ``rank_pattern``)."""
    model = unwrap(model)
    config = _active_lora_config(model, "adapter_rank")
    ranks = [int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())]
    return max(ranks)


def save_adapter(model: torch.nn.Module, directory: Path) -> Path:
    """Save the active adapter of a peft model (adapter weights and config only) into ``directory``.

    Returns:
        The directory holding ``adapter_config.json`` and ``adapter_model.safetensors`` (peft puts
        an adapter not named ``"default"`` into a subdirectory of that name).
    """
    model = unwrap(model)
    _active_lora_config(model, "save_adapter")
    name = _active_adapter(model, "save_adapter")
    # save_embedding_layers=False: "auto" may look the base model up on the hub (no network on
    # training nodes); full embedding layers are only needed for a resized vocabulary.
    model.save_pretrained(str(directory), selected_adapters=[name], save_embedding_layers=False)
    return directory if name == "default" else directory / name


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


def _peft_export(model: Any, merge: bool, who: str) -> dict[str, torch.Tensor]:
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
    return export_state_dict(out, who)


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


def probe_ids(vocab_size: int, max_model_len: int) -> list[int]:
    """The fixed probe sequence of the sync self-check (same for every engine of a vocabulary)."""
    rng = random.Random(_PROBE_SEED)
    return [rng.randrange(vocab_size) for _ in range(min(PROBE_LENGTH, max_model_len - 1))]


@torch.no_grad()
def trainer_probe_logprobs(module: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    """The module's temperature-1 logprob of each probe token given the ones before it (float64, CPU)."""
    from lightning_offpolicy.logprobs import causal_lm_token_logprobs

    device = next(module.parameters()).device
    ids = torch.tensor([probe], device=device)
    was_training = module.training
    module.eval()
    try:
        lp = causal_lm_token_logprobs(module, ids, torch.ones_like(ids), response_start=1)
    except Exception as err:
        raise RuntimeError(
            "weight-sync check: scoring the probe sequence with the trainer's module failed "
            f"({err!r}); it needs a transformers causal LM. Pass check_weight_sync=False to skip the check."
        ) from err
    finally:
        module.train(was_training)
    return lp[0].double().cpu()


class SyncCheck:
    """Compares an engine's probe logprobs with the trainer's after each sync.

    Two tests, both needed:

    * **agreement**: every probe token within :class:`SyncTolerance` (precision-aware); catches
      weights that arrived wrong (names, dtype, another model) and a sync that never arrived once
      the trainer has moved past the engine's precision;
    * **movement**: the engine's probe logprobs are a deterministic function of its weights. If
      they are bit-identical to those at the engine's last change while the trainer's moved since
      then by more than ``atol / 100`` on some token, the sync did not arrive. This test is exact,
      so it needs no precision margin: it catches a missed sync at once, however peaked the
      policy. (Could a reduced-precision engine round a real update away entirely? Only if not
      one weight crossed a rounding boundary. Measured on the tiny Llama with ``lm_head`` x30: a
      step of 1e-6 on every weight moved the trainer's probe by 0.034 nats and changed 10,374 of
      its 344,704 bfloat16 weights.) The reference stays at the
      engine's last change, so small movements below the threshold add up.

    Args:
        who: The engine's name, for the error messages.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.last_max_abs_diff: float | None = None
        self._prev_engine: torch.Tensor | None = None
        self._prev_trainer: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the previous probes (a restarted engine, or a sync that could not be checked)."""
        self.last_max_abs_diff = None
        self._prev_engine = self._prev_trainer = None

    def __call__(self, engine: torch.Tensor, trainer: torch.Tensor, tolerance: SyncTolerance | float) -> float:
        """Raise ``RuntimeError`` if the sync did not arrive; return the max |engine - trainer| (nats)."""
        if not isinstance(tolerance, SyncTolerance):
            tolerance = SyncTolerance(atol=float(tolerance))
        abs_diff = (engine - trainer).abs()
        diff = float(abs_diff.max())
        self.last_max_abs_diff = diff
        excess = abs_diff - tolerance.bound(trainer)
        if not math.isfinite(diff) or bool((excess > 0).any()):
            worst = int(excess.nan_to_num(nan=math.inf).argmax())
            raise RuntimeError(
                f"{self.who} weight-sync check failed: the engine's logprobs of a probe sequence differ from the "
                f"trainer's by up to {diff:.4g} (probe token {worst + 1}: engine {float(engine[worst]):.4g}, trainer "
                f"{float(trainer[worst]):.4g}; accepted: weight_sync_tolerance={tolerance}): the new weights did not "
                "arrive in the engine (or arrived wrong: parameter names / dtype). Nothing was stamped with the new "
                "version."
            )
        if self._prev_engine is not None and self._prev_trainer is not None and torch.equal(engine, self._prev_engine):
            trainer_moved = float((trainer - self._prev_trainer).abs().max())
            if trainer_moved > tolerance.atol / 100:
                raise RuntimeError(
                    f"{self.who} weight-sync check failed: the trainer's probe logprobs moved by up to "
                    f"{trainer_moved:.4g} since the engine's last changed but the engine's did not change at all: "
                    "the new weights did not arrive in the engine. Nothing was stamped with the new version."
                )
            return diff  # keep the reference at the engine's last change: small movements add up
        self._prev_engine, self._prev_trainer = engine, trainer
        return diff
