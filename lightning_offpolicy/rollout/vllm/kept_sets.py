"""The exact set of tokens vLLM's top-k / top-p kept at each sampled position, read inside its worker.

vLLM returns the logprobs of the distribution it sampled from (``processed_logprobs``) but not which
tokens that distribution kept, except as the finite entries among the top logprobs a request asks
for, and asking for enough of them to cover a wide nucleus costs a sort and a Python object per
vocabulary entry. The kit's worker extension therefore wraps the worker's top-k / top-p sampler:
after each step, for every row of a request the kit tagged (``SamplingParams.extra_args``), it keeps
the ids whose processed logprob is finite, which is the kept set exactly, whatever its width. The
engine fetches a call's sets with ``collective_rpc("lo_take_kept_sets", keys)`` once its requests
are answered (docs/off_policy_correction.md, "Sampling masks: top-k / top-p").
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from typing import Any

import numpy as np
import torch

__all__ = ["KEPT_SET_KEY", "KeptSetRecorder", "decode_kept_sets", "encode_kept_sets"]

#: The ``SamplingParams.extra_args`` key (``vllm_xargs`` of a server request) that tags a request
#: whose kept sets the worker records; its value names the request in :meth:`KeptSetRecorder.lo_take_kept_sets`.
KEPT_SET_KEY = "lo_kept_set"

#: A request's records nobody took within this many seconds are dropped (its call was given up).
_FORGET_AFTER_S = 600.0

# vLLM names the i-th of a request's n samples "{i}_{request id}" (parallel sampling).
_CHILD = re.compile(r"(\d+)_")


def encode_kept_sets(kept: list[np.ndarray]) -> list[str]:
    """Per-token kept ids (``int32``, empty: the whole vocabulary) as two base64 strings: the
    lengths and the concatenated ids (what ``collective_rpc`` answers, over JSON too)."""
    lengths = np.array([len(ids) for ids in kept], dtype=np.int32)
    ids = np.concatenate(kept).astype(np.int32) if kept else np.zeros(0, dtype=np.int32)
    return [base64.b64encode(lengths.tobytes()).decode(), base64.b64encode(ids.tobytes()).decode()]


def decode_kept_sets(encoded: list[str]) -> list[list[int]]:
    """The inverse of :func:`encode_kept_sets`: one list of ids per token (``[]``: the whole vocabulary)."""
    lengths = np.frombuffer(base64.b64decode(encoded[0]), dtype=np.int32)
    ids = np.frombuffer(base64.b64decode(encoded[1]), dtype=np.int32)
    if int(lengths.sum()) != len(ids):
        raise ValueError(f"kept sets of {int(lengths.sum())} ids announced, {len(ids)} received.")
    return [part.tolist() for part in np.split(ids, np.cumsum(lengths)[:-1])] if len(lengths) else []


class KeptSetRecorder:
    """Worker-extension methods that record the kept set of every sampled token of the tagged requests.

    Mixed into vLLM's worker with the kit's receiver
    (:class:`~lightning_offpolicy.rollout.vllm.worker_extension.SharedWeightsReceiver`); reads the
    worker's ``model_runner``.
    """

    def lo_record_kept_sets(self) -> bool:
        """Wrap the worker's top-k / top-p sampler so that it records kept sets (once; idempotent).

        Returns:
            Whether the worker records them (``False``: this vLLM's model runner has no such sampler,
            and the engine reads the kept sets from top logprobs instead).
        """
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        sampler = getattr(getattr(runner, "sampler", None), "topk_topp_sampler", None)
        if sampler is None or not hasattr(runner, "input_batch") or not hasattr(runner, "requests"):
            return False
        if getattr(self, "_lo_kept", None) is not None:
            return True
        self._lo_kept: dict[str, dict[int, list[np.ndarray]]] = {}
        self._lo_kept_times: dict[str, float] = {}
        self._lo_kept_lock = threading.Lock()
        inner = sampler.forward

        def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> Any:
            sampled, processed = inner(logits, generators, k, p)
            if processed is not None:
                self._lo_record(runner, processed)
            return sampled, processed

        sampler.forward = forward
        return True

    def lo_take_kept_sets(self, keys: list[str] | str) -> dict[str, dict[int, list[str]]]:
        """The recorded kept sets of the requests tagged ``keys``, forgotten here.

        Args:
            keys: The tags, or their JSON list (what a server's ``/collective_rpc`` passes on).

        Returns:
            Per key, per sample index, :func:`encode_kept_sets` of its tokens' kept sets in order
            (keys with nothing recorded are left out).
        """
        if isinstance(keys, str):
            keys = json.loads(keys)
        with self._lo_kept_lock:
            taken = {key: self._lo_kept.pop(key) for key in keys if key in self._lo_kept}
            for key in keys:
                self._lo_kept_times.pop(key, None)
            stale = [key for key, at in self._lo_kept_times.items() if time.monotonic() - at > _FORGET_AFTER_S]
            for key in stale:
                self._lo_kept.pop(key, None)
                self._lo_kept_times.pop(key, None)
        return {
            key: {index: encode_kept_sets(kept) for index, kept in samples.items()} for key, samples in taken.items()
        }

    def _lo_record(self, runner: Any, processed: torch.Tensor) -> None:
        """Record the finite entries of each tagged row of ``processed`` (``[rows, V]``) under its request."""
        req_ids = runner.input_batch.req_ids
        rows = min(processed.shape[0], len(req_ids))
        discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        tagged: list[tuple[int, str, int]] = []
        for row in range(rows):
            state = runner.requests.get(req_ids[row])
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            if KEPT_SET_KEY not in extra or (discard is not None and bool(discard[row])):
                continue  # not the kit's, or a partial prefill whose sample vLLM discards
            child = _CHILD.match(req_ids[row])
            tagged.append((row, str(extra[KEPT_SET_KEY]), int(child.group(1)) if child else 0))
        if not tagged:
            return
        # On the device, then only the kept ids cross to the host (a nucleus is usually narrow).
        finite = torch.isfinite(processed[[row for row, _, _ in tagged]])
        counts = finite.sum(-1).tolist()
        ids = finite.nonzero()[:, 1].to(torch.int32).cpu().numpy()
        vocab = finite.shape[-1]
        now = time.monotonic()
        with self._lo_kept_lock:
            for (_, key, index), kept, count in zip(tagged, np.split(ids, np.cumsum(counts)[:-1]), counts, strict=True):
                kept = np.zeros(0, dtype=np.int32) if count == vocab else kept  # nothing cut: the whole vocabulary
                self._lo_kept.setdefault(key, {}).setdefault(index, []).append(kept)
                self._lo_kept_times[key] = now
