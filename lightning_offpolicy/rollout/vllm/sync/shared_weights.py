"""Move the trainer's weights into a local vLLM engine through one reused shared-memory bucket.

The trainer copies a bucket of tensors (cast to the engine's dtype) into a file mapped in shared
memory (``/dev/shm`` where it exists); one ``collective_rpc`` per bucket has every worker view
the same pages and load them in place with vLLM's layerwise reload (the machinery of its
``reload_weights``)
(:class:`~lightning_offpolicy.rollout.vllm.worker_extension.SharedWeightsReceiver`). Nothing is
written to disk and no second copy of the model is made: the extra memory is the bucket, at
least the largest single tensor. Why, and the measured cost against the file path:
docs/scaling.md, "Weight sync".

Importing this module does not import vLLM.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from lightning_offpolicy.rollout.vllm.sync.export import unique_tensors

_T = TypeVar("_T")

__all__ = ["BucketSlot", "SharedWeightsBuffer", "plan_buckets"]

log = logging.getLogger(__name__)

#: Offsets of tensors in the bucket are multiples of this (every dtype can view its slot).
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class BucketSlot:
    """Where one tensor lies in the bucket: plain values, so it crosses vLLM's RPC as they are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def as_rpc(self) -> list:
        """The slot as the list :meth:`SharedWeightsReceiver.lo_load_shared_bucket` reads."""
        return [self.name, self.dtype, list(self.shape), self.offset]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def transfer_dtype(tensor: torch.Tensor, engine_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor crosses in: the engine's for floating tensors (the engine casts to it anyway)."""
    if engine_dtype is not None and tensor.is_floating_point():
        return engine_dtype
    return tensor.dtype


def _payload_bytes(tensor: torch.Tensor, engine_dtype: torch.dtype | None) -> int:
    """Bytes of ``tensor`` in its transfer dtype."""
    return tensor.numel() * transfer_dtype(tensor, engine_dtype).itemsize


def plan_buckets(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int, engine_dtype: torch.dtype | None
) -> list[list[str]]:
    """Split the names of ``tensors`` into buckets of at most ``bucket_bytes`` (in the transfer dtype).

    A decoder layer's tensors never straddle two buckets (vLLM processes a layer once all its
    weights arrived, and the bucket's pages are reused right after), and the un-indexed tensors
    (embedding, final norm, output layer) go last, in the bucket whose call also finalizes the
    reload: vLLM may hold those until then. A group larger than ``bucket_bytes`` gets a bucket of
    its own (the buffer grows to hold it).
    """

    layers: dict[str, list[str]] = {}  # first-appearance order
    loose: list[str] = []
    for name in tensors:
        key = _layer_key(name)
        if key is None:
            loose.append(name)
        else:
            layers.setdefault(key, []).append(name)
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for group in [*layers.values(), loose] if loose else list(layers.values()):
        size = sum(_aligned(_payload_bytes(tensors[name], engine_dtype)) for name in group)
        if current and (used + size > bucket_bytes or group is loose):
            buckets.append(current)
            current, used = [], 0
        current.extend(group)
        used += size
    if current:
        buckets.append(current)
    return buckets


def _layer_key(name: str) -> str | None:
    """The name up to its first all-digit part (``model.layers.3``), the layer it belongs to; ``None``: none."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return None


def _shared_dir(nbytes: int) -> str | None:
    """``/dev/shm`` where it exists with room for ``nbytes`` (memory, not disk); else the temporary directory.

    A container's ``/dev/shm`` is often small (Docker's default is 64 MB): writing past its size
    would kill the process (SIGBUS), so a buffer that does not fit goes to an ordinary file, which
    the page cache serves at nearly the same speed.
    """
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    if not os.access("/dev/shm", os.W_OK) or stat.f_bavail * stat.f_frsize < nbytes:
        log.warning(
            "/dev/shm has less than %.0f MB free: the in-memory weight sync maps its buffer from the temporary "
            "directory instead (give the container more shared memory, e.g. docker run --shm-size=2g).",
            nbytes / 1e6,
        )
        return None
    return "/dev/shm"


class SharedWeightsBuffer:
    """One shared-memory bucket, reused for every bucket of every sync, and the copy into it.

    Args:
        bucket_bytes: Size of a bucket (bytes); grown to the largest tensor when one is larger.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.path: Path | None = None
        self.nbytes = 0
        self._buffer: torch.Tensor | None = None

    def ensure(self, nbytes: int) -> None:
        """Map a buffer of at least ``nbytes`` (a new file when the old one is too small)."""
        if self._buffer is not None and self.nbytes >= nbytes:
            return
        self.close()
        from lightning_offpolicy.rollout.vllm.leftovers import bucket_prefix  # not at the top: see leftovers.py

        # Named after this process: a later start removes it if this process was killed holding it.
        fd, name = tempfile.mkstemp(prefix=bucket_prefix(), dir=_shared_dir(nbytes))  # mode 0600
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.nbytes = Path(name), nbytes
        self._buffer = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)

    def fill(self, tensors: Iterable[tuple[str, torch.Tensor]], engine_dtype: torch.dtype | None) -> list[BucketSlot]:
        """Copy ``tensors`` (cast to the transfer dtype) into the buffer; the slots they took."""
        assert self._buffer is not None, "ensure() first"
        slots = []
        offset = 0
        for name, tensor in tensors:
            dtype = transfer_dtype(tensor, engine_dtype)
            nbytes = tensor.numel() * dtype.itemsize
            view = self._buffer[offset : offset + nbytes].view(dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            slots.append(BucketSlot(name, _dtype_name(dtype), tuple(tensor.shape), offset))
            offset += _aligned(nbytes)
        return slots

    def send(
        self,
        tensors: Mapping[str, torch.Tensor],
        engine_dtype: torch.dtype | None,
        load: Callable[[str, int, list[list], bool, bool], _T],
    ) -> tuple[int, _T]:
        """Move ``tensors`` bucket by bucket: fill the buffer, then ``load(path, nbytes, slots, first, last)``.

        A tensor that is the same as an earlier one (a tied output layer) crosses once, under the first name.

        Returns:
            The bytes moved (after the cast to the transfer dtype) and what the last ``load`` returned.
        """
        tensors = unique_tensors(tensors)
        buckets = plan_buckets(tensors, self.bucket_bytes, engine_dtype)
        sizes = [sum(_aligned(_payload_bytes(tensors[n], engine_dtype)) for n in bucket) for bucket in buckets]
        self.ensure(max(sizes + [_ALIGN]))
        for index, bucket in enumerate(buckets):
            slots = self.fill(((name, tensors[name]) for name in bucket), engine_dtype)
            try:
                answer = load(
                    str(self.path),
                    self.nbytes,
                    [slot.as_rpc() for slot in slots],
                    index == 0,
                    index == len(buckets) - 1,
                )
            finally:
                if index == 0 and self.path is not None:
                    # Every worker has mapped it now (or failed, and the engine is gone), and a mapping outlives
                    # the name: without it, a run that dies leaves nothing behind in /dev/shm.
                    self.path.unlink(missing_ok=True)
        return sum(_payload_bytes(t, engine_dtype) for t in tensors.values()), answer

    def close(self) -> None:
        """Unmap the buffer and delete its file if still there (a worker's own mapping lasts until it lets go)."""
        self._buffer = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path, self.nbytes = None, 0
