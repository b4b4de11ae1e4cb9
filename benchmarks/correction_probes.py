"""What the correction benchmark measures besides time: bytes touched, peak memory, memory bandwidth."""

from __future__ import annotations

import gc
import math
import statistics
import time
from pathlib import Path

import torch
from correction_cases import Case
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ------------------------------------------------------------------------------------ bytes
_TRANSCENDENTAL_OPS = {"exp", "expm1", "log", "log1p", "sigmoid"}
_NO_DATA_OPS = {"lift_fresh", "detach", "alias", "promote_types", "_local_scalar_dense"}


def _tensor_bytes(t: torch.Tensor) -> int:
    storage_bytes = t.untyped_storage().nbytes()
    view_bytes = t.numel() * t.element_size()
    return min(storage_bytes, view_bytes)


class ByteCounter(TorchDispatchMode):
    """Records the storages every aten op reads and writes (keeps them alive so pointers stay unique)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}
        self.traffic = 0
        self.ops = 0
        self.transcendental = 0  # elements through exp / expm1 / log / sigmoid (a compute-cost count)
        self._alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        for t in ins + outs:
            st = t.untyped_storage()
            self.storages.setdefault(st.data_ptr(), st.nbytes())
        self._alive.extend(ins + outs)
        name = func.overloadpacket.__name__
        if name.rstrip("_") in _TRANSCENDENTAL_OPS:
            self.transcendental += sum(t.numel() for t in outs)
        if not getattr(func, "is_view", False) and name not in _NO_DATA_OPS:
            self.ops += 1
            self.traffic += sum(_tensor_bytes(t) for t in ins + outs)
        return out

    @property
    def distinct(self) -> int:
        return sum(self.storages.values())


def count_bytes(case: Case) -> tuple[int, int, int, int]:
    """(distinct bytes, op-traffic bytes, number of data ops, transcendental elements) of one eager step."""
    case.reset()
    counter = ByteCounter()
    with counter:
        case.step()
    case.reset()
    result = counter.distinct, counter.traffic, counter.ops, counter.transcendental
    counter._alive.clear()
    return result


# ------------------------------------------------------------------------------------ memory
def peak_extra_memory(cases: list[Case]) -> dict[str, int]:
    """Peak bytes allocated (and live at once) inside one step of each case.

    One profiler session covers one step of every case, each inside a ``record_function`` range;
    the CPU allocator's allocation events (any thread) are assigned to a case by time.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    for case in cases:
        case.reset()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for case in cases:
            with record_function(f"bench_step::{case.key}"):
                case.step()
            case.reset()
    ranges: dict[str, tuple[int, int]] = {}
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        elif node.name.startswith("bench_step::"):
            ranges[node.name.split("::", 1)[1]] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    allocations.sort(key=lambda e: e[0])
    peaks = {}
    for case in cases:
        begin, finish = ranges[case.key]
        live: dict[int, int] = {}
        current = peak = 0
        for when, size, ptr in allocations:
            if when < begin or when > finish:
                continue
            if size > 0:
                live[ptr] = size
                current += size
                peak = max(peak, current)
            elif ptr in live:  # a free of a block allocated inside the step
                current -= live.pop(ptr)
        peaks[case.key] = peak
    return peaks


# ------------------------------------------------------------------------------------ bandwidth
def _llc_bytes() -> int:
    for index in range(4, -1, -1):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
        return int(text.rstrip("KMG")) * scale
    return 32 * 1024**2


class BandwidthProbe:
    """``torch.add(a, b, out=c)`` over [B, T] float32: hot (same tensors) and streaming (distinct)."""

    def __init__(self, batch: int, seq_len: int, stream: bool = True) -> None:
        self.bytes_per_add = 3 * 4 * batch * seq_len
        self.a = torch.rand(batch, seq_len)
        self.b = torch.rand(batch, seq_len)
        self.c = torch.empty(batch, seq_len)
        self.hot: list[float] = []
        self.stream: list[float] = []
        self.exp: list[float] = []  # torch.exp(a, out=c): one transcendental per element, hot tensors
        self.pool = None
        if stream:
            n = max(4, math.ceil(4 * _llc_bytes() / self.bytes_per_add))
            self.pool = [
                (torch.rand(batch, seq_len), torch.rand(batch, seq_len), torch.empty(batch, seq_len)) for _ in range(n)
            ]

    def measure(self, reps: int = 20) -> None:
        a, b, c = self.a, self.b, self.c
        torch.add(a, b, out=c)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.add(a, b, out=c)
            samples.append(time.perf_counter() - t0)
        self.hot.append(statistics.median(samples))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.exp(a, out=c)
            samples.append(time.perf_counter() - t0)
        self.exp.append(statistics.median(samples))
        if self.pool:
            t0 = time.perf_counter()
            for pa, pb, pc in self.pool:
                torch.add(pa, pb, out=pc)
            self.stream.append((time.perf_counter() - t0) / len(self.pool))

    def exp_over_add(self) -> float:
        """How many add passes one exp pass over the same tensors costs (compute, not memory)."""
        return statistics.median(self.exp) / statistics.median(self.hot) if self.exp and self.hot else float("nan")

    def bandwidth(self, kind: str) -> float:
        samples = self.hot if kind == "hot" else self.stream
        return self.bytes_per_add / statistics.median(samples) if samples else float("nan")
