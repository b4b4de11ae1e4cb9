"""Engine-independent pieces of a weight sync: export the trainer's weights, check they arrived.

Any engine that loads the trainer's weights from safetensors files (the in-process
:class:`~lightning_offpolicy.rollout.VLLMEngine`, a remote ``vllm serve`` server reading a shared
directory) uses the same three steps:

1. :func:`export_state_dict`: the trainer's tensors on CPU under checkpoint names (wrappers
   removed, tied weights un-shared, as safetensors requires);
2. :func:`write_safetensors`: written atomically (a reader never sees a half-written file);
3. :class:`SyncCheck`: the engine's logprobs of a fixed probe sequence against the trainer's,
   raising when they disagree, or when the engine's did not move while the trainer's did (a sync
   that silently never arrived: a known failure of LoRA syncs in peer frameworks).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SyncCheck",
    "export_state_dict",
    "is_peft_model",
    "probe_ids",
    "trainer_probe_logprobs",
    "unwrap",
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

    ``who`` names the caller in error messages (e.g. ``"VLLMEngine.update_weights"``).
    """
    state = unwrap(source).state_dict() if isinstance(source, torch.nn.Module) else source
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{who}: {name!r} is a {type(value).__name__}, not a tensor.")
        tensor = value.detach().to("cpu")
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        if ptr in seen:  # tied weights: safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(ptr)
        tensors[name] = tensor.contiguous()
    return tensors


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], directory: Path, filename: str = "model.safetensors"
) -> Path:
    """Write ``tensors`` to ``directory / filename`` atomically; returns the file's path.

    The partial file's name does not end in ``.safetensors``, so a loader globbing the directory
    never picks it up.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / filename
    partial = directory / (filename + ".partial")
    save_file(dict(tensors), str(partial))
    os.replace(partial, target)
    return target


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

    def __call__(self, engine: torch.Tensor, trainer: torch.Tensor, tolerance: float) -> float:
        """Raise ``RuntimeError`` if the sync did not arrive; return the max |engine - trainer|."""
        diff = float((engine - trainer).abs().max())
        self.last_max_abs_diff = diff
        if not math.isfinite(diff) or diff > tolerance:
            raise RuntimeError(
                f"{self.who} weight-sync check failed: the engine's logprobs of a probe sequence differ from the "
                f"trainer's by up to {diff:.4g} (> weight_sync_tolerance={tolerance:g}): the new weights did not "
                "arrive in the engine (or arrived wrong: parameter names / dtype). Nothing was stamped with the new "
                "version."
            )
        if self._prev_engine is not None and self._prev_trainer is not None:
            engine_moved = float((engine - self._prev_engine).abs().max())
            trainer_moved = float((trainer - self._prev_trainer).abs().max())
            if engine_moved == 0.0 and trainer_moved > tolerance / 100:
                raise RuntimeError(
                    f"{self.who} weight-sync check failed: the trainer's probe logprobs moved by up to "
                    f"{trainer_moved:.4g} since the last sync but the engine's did not change at all: "
                    "the new weights did not arrive in the engine. Nothing was stamped with the new version."
                )
        self._prev_engine, self._prev_trainer = engine, trainer
        return diff
