#!/usr/bin/env python
"""What renormalizing over a top-k / top-p sampling mask costs the trainer's logprobs, on CPU.

One forward + backward of the response logprobs at a Qwen2-sized vocabulary (V = 151936, the
head's input H = 896), once plain (the sampled token's logprob over the whole vocabulary) and once
per kept-support width K (the renormalized logprob over K kept ids per position, the trainer's path
under a sampling mask: ``K + 1`` gathered columns, then a ``logsumexp`` over the kept ones), in both
logprob paths of :func:`lightning_offpolicy.logprobs.causal_lm_token_logprobs`:

* fused: ``fused_linear_token_logprobs(hidden [T, H], weight [V, H], targets)`` (no logits);
* lean:  ``token_logprobs(logits [T, V], targets)``.

Every ratio (time, peak extra memory) is against the plain row measured in the same run, same
process, one thread. Peak memory is the process's resident high-water mark above the inputs,
reset before each step (``/proc/self/clear_refs``, as ``benchmarks/logprob_memory.py``).

Usage::

    python benchmarks/sampling_mask_cost.py --output docs/reports/performance_sampling_mask.md   # ~2-4 min
    python benchmarks/sampling_mask_cost.py --quick --output /tmp/x.md                  # seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

from harness.memory import mb, peak_bytes, reset_peak, rss_bytes
from harness.report import header_bullets, load_bullet, run_header, write_report

FULL = {"vocab": 151936, "hidden": 896, "tokens": 1024, "widths": [0, 20, 64, 512], "repeats": 3}
QUICK = {"vocab": 4000, "hidden": 64, "tokens": 256, "widths": [0, 20, 64], "repeats": 2}


def supports(tokens: int, vocab: int, width: int, targets, generator):
    """``[T, width]`` distinct kept ids per position, the sampled token among them (``None`` for width 0)."""
    import torch

    if width == 0:
        return None
    ids = torch.multinomial(torch.ones(tokens, vocab), width, replacement=False, generator=generator)
    missing = ~(ids == targets[:, None]).any(-1)
    ids[missing, 0] = targets[missing]
    return ids


def step(path: str, inputs: dict, targets, support, temperature: float = 0.9):
    """Forward + backward of the summed response logprobs (renormalized over ``support`` when given)."""
    import torch

    from lightning_offpolicy.logprobs import token_logprobs
    from lightning_offpolicy.logprobs.fused import fused_linear_token_logprobs
    from lightning_offpolicy.logprobs.support import over_support

    columns = targets if support is None else torch.cat([targets[:, None], support], dim=-1)
    if path == "fused":
        out = fused_linear_token_logprobs(inputs["hidden"], inputs["weight"], columns, temperature=temperature)
    else:
        out = token_logprobs(inputs["logits"], columns, temperature=temperature)
    if support is not None:
        out = over_support(out[None], support[None], return_entropy=False, full_entropy=False)[0]
    out.sum().backward()
    return float(out.detach().double().sum())


def measure(path: str, settings: dict) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    tokens, vocab, hidden = settings["tokens"], settings["vocab"], settings["hidden"]
    if path == "fused":
        inputs = {
            "hidden": torch.randn(tokens, hidden, generator=generator).requires_grad_(True),
            "weight": (torch.randn(vocab, hidden, generator=generator) * 0.05).requires_grad_(True),
        }
    else:
        inputs = {"logits": (torch.randn(tokens, vocab, generator=generator) * 2.0).requires_grad_(True)}
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    widths = settings["widths"]
    masks = {width: supports(tokens, vocab, width, targets, generator) for width in widths}
    for width in widths:  # warm-up of each shape
        step(path, inputs, targets, masks[width])
    times: dict[int, list[float]] = {width: [] for width in widths}
    peaks = dict.fromkeys(widths, 0)
    # Rounds over every width back to back: each round's ratios meet the same machine load.
    for _ in range(settings["repeats"]):
        for width in widths:
            for tensor in inputs.values():
                tensor.grad = None
            gc.collect()
            base = rss_bytes()
            reset_ok = reset_peak()
            began = time.perf_counter()
            step(path, inputs, targets, masks[width])
            times[width].append(time.perf_counter() - began)
            peaks[width] = max(peaks[width], peak_bytes(reset_ok) - base)
    plain = widths[0]
    rows = []
    for width in widths:
        ratios = [t / p for t, p in zip(times[width], times[plain], strict=True)]
        rows.append(
            {
                "path": path,
                "width": width,
                "time_s": statistics.median(times[width]),
                "time_ratio": statistics.median(ratios),
                "peak_extra": peaks[width],
                "memory_ratio": peaks[width] / max(peaks[plain], 1),
            }
        )
    return rows


def render(header: dict, settings: dict, rows: list[dict]) -> str:
    lines = [
        "# The cost of a sampling mask in the trainer's logprobs",
        "",
        *header_bullets(header),
        *([load_bullet(*header["load"])] if "load" in header else []),
        f"- **Shape**: V = {settings['vocab']}, H = {settings['hidden']}, T = {settings['tokens']} response "
        f"tokens, float32, temperature 0.9, one thread; medians of {settings['repeats']} rounds, each round "
        "running every K back to back (a ratio is the median of its per-round ratios).",
        "",
        "| path | kept ids per position (K) | forward + backward (median) | x plain | peak extra MiB | x plain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        width = "plain (no mask)" if row["width"] == 0 else str(row["width"])
        lines.append(
            f"| {row['path']} | {width} | {row['time_s'] * 1e3:.0f} ms | {row['time_ratio']:.3f} "
            f"| {mb(row['peak_extra'])} | {row['memory_ratio']:.2f} |"
        )
    lines += [
        "",
        "## Method",
        "",
        "Under a sampling mask the trainer gathers the logprobs of the sampled token and of the K kept ids "
        "at each position (`[T, K + 1]` columns of the chunked log-softmax it computes anyway), then subtracts "
        "the `logsumexp` of the kept ones: no `[T, V]` mask is ever built. The kept ids here are random "
        "(the sampled one among them); K is the widest kept set of a batch (a batch pads every position to it). "
        "Peak extra memory is the resident high-water mark of the step above the inputs "
        "(`/proc/self/clear_refs`), so it includes the gradient of the logits (lean path) or of the head "
        "weight (fused path), which the plain step makes too.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--output", type=Path, default=None, help="Markdown report (a .json next to it)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    load_start = os.getloadavg()[0]
    rows = measure("fused", settings) + measure("lean", settings)
    header = {**run_header("sampling_mask_cost.py", argv), "load": [load_start, os.getloadavg()[0]]}
    write_report(args.output, render(header, settings, rows), {"header": header, "settings": settings, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
