"""The weight sync of :class:`~lightning_offpolicy.rollout.VLLMEngine`: the trainer's weights into the
engine's workers in place, in memory (shared-memory buckets) or through safetensors files, both
loaded by the kit's receiver (:mod:`~lightning_offpolicy.rollout.vllm.worker_extension`), which says
what did not arrive; then the prefix cache dropped. docs/training.md, "Weight sync across model families".
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from lightning_offpolicy.rollout.vllm.sync.check import check_received
from lightning_offpolicy.rollout.vllm.sync.export import is_peft_model, write_safetensors
from lightning_offpolicy.rollout.vllm.sync.lora import SYNC_CALLER, write_base_checkpoint
from lightning_offpolicy.rollout.vllm.sync.peft_export import full_state_dict, merged_state_dict
from lightning_offpolicy.rollout.vllm.sync.shared_weights import SharedWeightsBuffer

__all__ = ["InProcessWeightSync"]


class InProcessWeightSync:
    """The weight-sync steps of :class:`~lightning_offpolicy.rollout.VLLMEngine`.

    A mixin: it uses the engine's ``_llm``, ``model``, ``weight_transport``, ``weight_bucket_mb``,
    ``compute_dtype``, ``_shared_weights``, ``_sync_dir`` and its ``_ensure_started``, ``_watched`` and
    ``_new_tmp_dir``; it sets ``last_sync_time_s`` and ``last_sync_bytes``.
    """

    def _reload_weights(self, weights_path: str) -> list[list[str] | None]:
        """Reload every worker's weights in place from the safetensors files in ``weights_path``; what each
        worker's model did not receive (:meth:`SharedWeightsReceiver.lo_reload_from_files`)."""
        llm = self._llm
        return self._watched(lambda: llm.collective_rpc("lo_reload_from_files", args=(weights_path,)), "reload_weights")

    def _update_full(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool) -> None:
        """Full-weight sync (``weight_sync.lora="merged"``): a peft model's weights are merged with its adapters."""
        peft = is_module and is_peft_model(source)
        if self._llm is None and self.model is None:
            if not is_module or not (peft or hasattr(source, "save_pretrained")):
                raise ValueError(
                    "VLLMEngine(model=None) starts from the trainer's module at the first update_weights: "
                    "pass a transformers model (with save_pretrained), or give `model` (a checkpoint dir)."
                )
            model_dir = self._new_tmp_dir("model")
            if peft:  # its save_pretrained writes the adapter only: write the merged model instead
                write_base_checkpoint(model_dir, source, merged_state_dict(source, SYNC_CALLER, tied="drop"))
            else:
                source.save_pretrained(str(model_dir))
            self._ensure_started(str(model_dir))
            self.last_sync_time_s = None  # nothing to transfer: the engine started from these weights
            return
        self._ensure_started()
        begin = time.perf_counter()
        self._push_weights(full_state_dict(source, SYNC_CALLER, for_files=self.weight_transport == "file", tied="drop"))
        self.last_sync_time_s = time.perf_counter() - begin

    def _push_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Move ``tensors`` into the engine's weights in place, then drop the stale prefix cache.

        ``tensors`` leaves a tied output layer out (``tied="drop"`` of the export): the receiver
        processes it again from the embedding it shares.
        """
        sent = len(tensors)
        if self.weight_transport == "memory":
            self.last_sync_bytes, missing = self._send_in_memory(tensors)
        else:
            if self._sync_dir is None:
                self._sync_dir = self._new_tmp_dir("sync")
            path = write_safetensors(tensors, self._sync_dir)
            self.last_sync_bytes = path.stat().st_size
            del tensors
            missing = self._reload_weights(str(self._sync_dir))
        check_received(missing, sent, "VLLMEngine")
        # Watched too: vLLM waits for the answer without a timeout, and a core that dies just after
        # the request was sent never gives one.
        if not self._watched(self._llm.reset_prefix_cache, "reset_prefix_cache"):
            raise RuntimeError(
                "VLLMEngine: vLLM refused to reset its prefix cache after the weight sync (requests still running?): "
                "cached KV of the old weights could serve new requests."
            )

    def _send_in_memory(self, tensors: dict[str, torch.Tensor]) -> tuple[int, list[list[str] | None]]:
        """Copy ``tensors`` bucket by bucket into shared memory, each loaded by every worker; the bytes moved
        and what each worker's model did not receive."""
        bucket_bytes = self.weight_bucket_mb << 20
        if self._shared_weights is None or self._shared_weights.bucket_bytes != bucket_bytes:
            if self._shared_weights is not None:
                self._shared_weights.close()
            self._shared_weights = SharedWeightsBuffer(bucket_bytes)
        return self._shared_weights.send(tensors, self.compute_dtype, self._load_bucket)

    def _load_bucket(self, path: str, nbytes: int, slots: list[list], first: bool, last: bool) -> list:
        """Have every worker load one bucket from the shared-memory file ``path`` (in-place reload); each
        worker's answer (after the last bucket: what its model did not receive)."""
        llm = self._llm
        return self._watched(
            lambda: llm.collective_rpc("lo_load_shared_bucket", args=(path, nbytes, slots, first, last)),
            "load_weights",
        )
