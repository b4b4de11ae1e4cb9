#!/usr/bin/env python
"""Packed vs padded token logprobs on one device: are they equal, and which is faster, per attention kernel.

A random Qwen2 (``--hidden``, ``--layers``, vocabulary 32000) scores one long-tailed batch
(``--rows`` sequences, prompts of 16-64 tokens, responses of 8-``--max-response`` tokens) with
``causal_lm_token_logprobs(..., packed=False)`` and ``packed=True``, for each attention
implementation and dtype asked: the largest |packed - padded| logprob (float32 tells whether a
sequence sees another's tokens: it would differ by far more than rounding), and the median time of a
forward + backward of each (after a warm-up). Prints one JSON line per case.

Usage::

    python benchmarks/packing_probe.py --device cuda --dtypes float32,bfloat16 --attention sdpa,eager
    python benchmarks/packing_probe.py --device cpu --hidden 128 --layers 2 --rows 8 --max-response 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from lightning_offpolicy.logprobs import causal_lm_token_logprobs


def make_batch(rows: int, max_response: int, vocab: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, 65, (rows,), generator=gen).tolist()
    # Long-tailed response lengths: most short, a few near the maximum.
    responses = [
        min(max_response, max(8, int(8 * (max_response / 8) ** float(u) ** 3))) for u in torch.rand(rows, generator=gen)
    ]
    start = max(prompts)
    width = start + max(responses)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, (p, n) in enumerate(zip(prompts, responses, strict=True)):
        ids[r, start - p : start + n] = torch.randint(3, vocab, (p + n,), generator=gen)
        mask[r, start - p : start + n] = 1
    real = int(mask.sum())
    return ids.to(device), mask.to(device), start, real / mask.numel()


def timed(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--attention", default="sdpa,eager")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 32000
    ids, mask, start, real_share = make_batch(args.rows, args.max_response, vocab, args.device)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for attention in args.attention.split(","):
            config = Qwen2Config(
                vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=2048,
            )  # fmt: skip
            config._attn_implementation = attention
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config).to(device=args.device, dtype=dtype).train()

            def run(packed: bool, backward: bool = True, model: torch.nn.Module = model) -> torch.Tensor:
                lp = causal_lm_token_logprobs(model, ids, mask, start, packed=packed)
                if backward:
                    lp.float().sum().backward()
                    model.zero_grad(set_to_none=True)
                return lp.detach()

            with torch.no_grad():
                padded, packed = run(False, False), run(True, False)
            response_mask = mask[:, start:].bool()
            diff = (packed - padded).abs()[response_mask]
            out = {
                "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                "dtype": dtype_name,
                "attention": attention,
                "real_token_share": round(real_share, 4),
                "max_abs_diff": float(diff.max()),
                "mean_abs_diff": float(diff.mean()),
                "padded_s": timed(lambda: run(False), args.device, args.repeats),
                "packed_s": timed(lambda: run(True), args.device, args.repeats),
            }
            out["speedup"] = out["padded_s"] / out["packed_s"]
            print(json.dumps(out), flush=True)
            del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
