"""The vLLM worker side of the in-memory weight sync (loaded into vLLM's workers by name).

:class:`~lightning_offpolicy.rollout.VLLMEngine` starts vLLM with ``worker_extension_cls`` set to
:data:`RECEIVER_CLS`: vLLM mixes the class into each worker, and
``collective_rpc("lo_load_shared_bucket", ...)`` runs its method there. The trainer's side is
:mod:`~lightning_offpolicy.rollout.vllm.shared_weights`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["RECEIVER_CLS", "SharedWeightsReceiver", "slot_views"]


class SharedWeightsReceiver:
    """Reloads the worker's weights in place from buckets in a shared-memory file.

    One sync is a run of calls: the first starts vLLM's layerwise reload (what its
    ``reload_weights`` does: each layer is rebuilt from the checkpoint-format weights and
    processed once all of them arrived, then copied into the tensors the engine computes with),
    each hands a bucket's tensors to the model's ``load_weights`` as views of the mapped pages
    (no copy), the last finishes the reload. The trainer reuses the pages for the next bucket
    when a call returns, so a weight vLLM still holds then (a layer not complete yet) is copied
    out first.
    """

    def lo_load_shared_bucket(self, path: str, nbytes: int, slots: list[list], first: bool, last: bool) -> int:
        """Load the tensors ``slots`` describes (``[name, dtype, shape, offset]``) from the file ``path``.

        Args:
            path: The shared-memory file (mapped once, kept while the trainer reuses it).
            nbytes: Its size.
            slots: One ``[name, dtype name, shape, byte offset]`` per tensor.
            first: The sync's first bucket (starts the reload).
            last: The sync's last bucket (finishes it).

        Returns:
            The number of tensors loaded.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        mapped = getattr(self, "_lo_mapped", None)
        if mapped is None or mapped[0] != path or mapped[1] != nbytes:
            mapped = self._lo_mapped = (
                path,
                nbytes,
                torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8),
            )
        buffer = mapped[2]
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            if first:
                initialize_layerwise_reload(model)
            model.load_weights(slot_views(buffer, slots))
            if last:
                finalize_layerwise_reload(model, runner.model_config)
                for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                    if hasattr(runner, reset):  # what vLLM's reload_weights resets after loading
                        getattr(runner, reset)()
            else:
                _copy_out_held_views(model, buffer)
        return len(slots)

    def lo_release_shared(self) -> None:
        """Unmap the buffer (the trainer deleted or replaced its file)."""
        self._lo_mapped = None


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


#: What :class:`~lightning_offpolicy.rollout.VLLMEngine` passes as vLLM's ``worker_extension_cls``.
RECEIVER_CLS = f"{SharedWeightsReceiver.__module__}.{SharedWeightsReceiver.__qualname__}"
