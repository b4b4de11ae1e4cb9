#!/usr/bin/env python
"""Bandwidth of the ways a weight sync can move a model between two processes, on this machine's device.

What the sync cost model of docs/scaling.md needs where no vLLM runs (a GPU machine without vLLM
installed, or this CPU machine): the trainer's weights (random bfloat16 tensors of a model's
shape, on ``--device``) move to a second process that copies them into its own copy of the
weights on the same device, as a vLLM worker's load does. Ways:

* ``shared_memory``: the kit's in-memory transport
  (:class:`~lightning_offpolicy.rollout.vllm.sync.shared_weights.SharedWeightsBuffer`): each bucket is
  copied into a shared-memory file (device to host on a GPU), the receiver maps it and copies each
  tensor into its weights (host to device);
* ``cuda_ipc`` (CUDA only): each bucket is packed into one device buffer whose CUDA IPC handle the
  receiver opens and copies from, device to device (the mechanism of vLLM's ``ipc`` weight-transfer
  backend, used when trainer and engine share a GPU);
* ``file``: each bucket is written as a safetensors file on local disk and the receiver loads it
  onto its device (the kit's file transport).

Usage::

    python benchmarks/transfer_bandwidth.py --device cuda --models qwen2-0.5b,qwen2-7b --output /tmp/bw.md
    python benchmarks/transfer_bandwidth.py --device cpu --models qwen2-0.5b --output /tmp/bw_cpu.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# benchmarks/*.py run as scripts: their directory is on sys.path, and with it the shared harness.
from harness.report import write_report

from lightning_offpolicy.rollout.vllm.sync.shared_weights import SharedWeightsBuffer
from lightning_offpolicy.rollout.vllm.worker_extension import slot_views

#: Decoder shapes: (vocab, hidden, intermediate, layers, heads, kv heads, tied).
SHAPES = {
    "tiny": (256, 64, 128, 2, 2, 1, True),  # for the tests
    "qwen2-0.5b": (151936, 896, 4864, 24, 14, 2, True),
    "qwen2-7b": (152064, 3584, 18944, 28, 28, 4, False),
}
BUCKET_MB = 512
WAYS = ("shared_memory", "cuda_ipc", "file")


def model_tensors(shape: str, device: str) -> dict[str, torch.Tensor]:
    """Random bfloat16 tensors under Qwen2 checkpoint names (layer by layer, then the loose ones)."""
    vocab, hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    head_dim = hidden // heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen, device=device, dtype=torch.bfloat16)

    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = rand(hidden, hidden)
        out[p + "self_attn.k_proj.weight"] = rand(kv * head_dim, hidden)
        out[p + "self_attn.v_proj.weight"] = rand(kv * head_dim, hidden)
        out[p + "self_attn.o_proj.weight"] = rand(hidden, hidden)
        out[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        out[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        out[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        out[p + "input_layernorm.weight"] = rand(hidden)
        out[p + "post_attention_layernorm.weight"] = rand(hidden)
    out["model.embed_tokens.weight"] = rand(vocab, hidden)
    out["model.norm.weight"] = rand(hidden)
    if not tied:
        out["lm_head.weight"] = rand(vocab, hidden)
    return out


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    """A float64 sum over every element: what arrived is what was sent."""
    return float(sum(t.double().sum() for t in tensors.values()))


def receiver(conn: Any, shape: str, device: str) -> None:
    """The engine's side: its own weights; loads each bucket it is told of, answers when done."""
    weights = {name: torch.empty_like(t) for name, t in model_tensors(shape, device).items()}
    mapped: tuple[str, torch.Tensor] | None = None
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        way, payload = msg
        if way == "checksum":
            conn.send(checksum(weights))
            continue
        if way == "shared_memory":
            path, nbytes, slots = payload
            if mapped is None or mapped[0] != path:
                mapped = (path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
            for name, view in slot_views(mapped[1], slots):  # what a vLLM worker hands its load_weights
                weights[name].copy_(view)
        elif way == "cuda_ipc":
            buffer, slots = payload  # rebuilt from the IPC handle by torch.multiprocessing
            for name, offset, count in slots:
                weights[name].view(-1).copy_(buffer[offset : offset + count])
        else:
            from safetensors.torch import load_file

            for name, tensor in load_file(payload, device=device).items():
                weights[name].copy_(tensor)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        conn.send("done")


def _buckets(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    buckets, current, used = [], [], 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if current and used + size > BUCKET_MB << 20:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return [*buckets, current] if current else buckets


def one_sync(way: str, tensors: dict[str, torch.Tensor], conn: Any, device: str, state: dict[str, Any]) -> float:
    """Move every tensor once; seconds until the receiver has copied the last bucket."""
    began = time.perf_counter()
    if way == "shared_memory":
        buffer: SharedWeightsBuffer = state.setdefault("buffer", SharedWeightsBuffer(BUCKET_MB << 20))

        def load(path: str, nbytes: int, slots: list[list], first: bool, last: bool) -> None:
            conn.send((way, (path, nbytes, slots)))
            assert conn.recv() == "done"

        if device.startswith("cuda"):
            torch.cuda.synchronize()
        buffer.send(tensors, None, load)
    elif way == "cuda_ipc":
        for bucket in _buckets(tensors):
            total = sum(tensors[n].numel() for n in bucket)
            packed = state.get("packed")
            if packed is None or packed.numel() < total:
                packed = state["packed"] = torch.empty(
                    max(total, (BUCKET_MB << 20) // 2), dtype=torch.bfloat16, device=device
                )
            slots, offset = [], 0
            for name in bucket:
                n = tensors[name].numel()
                packed[offset : offset + n].copy_(tensors[name].view(-1))
                slots.append((name, offset, n))
                offset += n
            torch.cuda.synchronize()
            conn.send((way, (packed, slots)))
            assert conn.recv() == "done"
    else:
        from safetensors.torch import save_file

        directory = state.setdefault("dir", tempfile.mkdtemp(prefix="transfer_bw_"))
        for index, bucket in enumerate(_buckets(tensors)):
            path = os.path.join(directory, f"bucket{index}.safetensors")
            save_file({n: tensors[n].contiguous() for n in bucket}, path)
            conn.send((way, path))
            assert conn.recv() == "done"
            os.unlink(path)
    return time.perf_counter() - began


def measure(shape: str, device: str, repeats: int) -> list[dict[str, Any]]:
    tensors = model_tensors(shape, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    expected = checksum(tensors)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, shape, device), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    rows = []
    try:
        for way in WAYS:
            if way == "cuda_ipc" and not device.startswith("cuda"):
                continue
            state: dict[str, Any] = {}
            one_sync(way, tensors, parent, device, state)  # warm-up: maps, allocations
            times = sorted(one_sync(way, tensors, parent, device, state) for _ in range(repeats))
            parent.send(("checksum", None))
            if (received := parent.recv()) != expected:
                raise RuntimeError(f"{way}: the receiver's weights differ from the sender's ({received} vs {expected})")
            median = times[len(times) // 2]
            rows.append({"model": shape, "way": way, "bytes": nbytes, "seconds": median, "all_s": times})
            print(
                f"{shape:>11} {way:>14}: {nbytes / 1e9:.2f} GB in {median:.3f} s = {nbytes / median / 1e9:.2f} GB/s",
                flush=True,
            )
            if "buffer" in state:
                state["buffer"].close()
    finally:
        parent.send(None)
        proc.join(30)
    return rows


def render(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        "# Transfer bandwidth between two processes (weight-sync ways)",
        "",
        f"- **Device**: {header['device']}",
        f"- **Date**: {header['date']}; **command**: `{header['command']}`",
        "",
        "| model | way | GB / sync (bf16) | s / sync (median) | GB/s | 70B (141 GB) s at this rate |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r["bytes"] / r["seconds"]
        lines.append(
            f"| {r['model']} | {r['way']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.3f} | {rate / 1e9:.2f} "
            f"| {141.2e9 / rate:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="qwen2-0.5b,qwen2-7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    header = {
        "device": f"{device_name}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "benchmarks/transfer_bandwidth.py", *argv]),
    }
    rows = [row for m in args.models.split(",") if m for row in measure(m.strip(), args.device, args.repeats)]
    write_report(args.output, render(rows, header), {"header": header, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
