"""One measured logprob step in a fresh subprocess: lean, naive or fused, its peak memory and time."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

from harness.memory import peak_bytes, reset_peak, rss_bytes


def _step_fn(method: str, temperature: float, chunk_size: int):
    import torch

    from lightning_offpolicy.logprobs import token_logprobs

    if method == "lean":

        def fwd(logits, targets):
            return token_logprobs(logits, targets, temperature, chunk_size=chunk_size)

    elif method == "naive":

        def fwd(logits, targets):
            return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)

    elif method == "fused":
        from lightning_offpolicy.logprobs.fused import fused_linear_token_logprobs

        def fwd(hidden, weight, targets):
            return fused_linear_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)

    else:
        raise ValueError(method)
    return fwd


def _measure_steps(step: Callable[[], Any], leaves: list[Any], repeats: int, keep_rows: int = 0) -> tuple[dict, Any]:
    """Forward (``step``, returning logprobs ``[1, T]``) and backward ``repeats`` times, measured.

    Args:
        step: the forward, from the leaves to the logprobs.
        leaves: the tensors whose gradients the backward fills (cleared before each repeat).
        repeats: how many steps; the time is the best one, the memory the largest.
        keep_rows: how many of the last step's logprobs to return (float64), for a sanity check.

    Returns:
        The figures (memory in RSS bytes above the RSS before the first step, times, the logprob sum)
        and the kept logprobs (``None`` without ``keep_rows``).
    """
    gc.collect()
    base = rss_bytes()
    times, held, peak_fwd, peak, lp_sum, reset_ok, kept = [], 0, 0, 0, 0.0, True, None
    for _ in range(repeats):
        for leaf in leaves:
            leaf.grad = None
        gc.collect()
        reset_ok = reset_peak() and reset_ok  # peak of this step alone (where the kernel allows)
        t0 = time.perf_counter()
        lp = step()
        held = max(held, rss_bytes() - base)
        peak_fwd = max(peak_fwd, peak_bytes(reset_ok) - base)
        loss = lp.sum()
        loss.backward()
        times.append(time.perf_counter() - t0)
        peak = max(peak, peak_bytes(reset_ok) - base)
        lp_sum = float(lp.detach().double().sum())
        kept = lp.detach()[0, :keep_rows].double() if keep_rows else None
        del lp, loss
    measured = {
        "baseline_rss": base,
        "held_after_fwd": held,
        "peak_fwd": peak_fwd,
        "peak_fwd_bwd": peak,
        "time_s": min(times),
        "times_s": times,
        "peak_reset": reset_ok,
        "lp_sum": lp_sum,
    }
    return measured, kept


def fused_worker(args: argparse.Namespace) -> dict:
    """The fused head: hidden [1, T, H] and weight [V, H] leaves -> logprobs -> backward."""
    import torch

    from lightning_offpolicy.logprobs.fused import chunk_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fwd = _step_fn("fused", args.temperature, args.chunk_size)
    width = args.hidden

    w_h = torch.randn(1, min(args.tokens, 64), width).to(dtype).requires_grad_(True)
    w_w = torch.randn(args.vocab, width).to(dtype).requires_grad_(True)
    fwd(w_h, w_w, torch.randint(0, args.vocab, w_h.shape[:-1])).sum().backward()
    del w_h, w_w
    gc.collect()

    torch.manual_seed(args.seed)
    hidden = torch.empty(1, args.tokens, width, dtype=dtype).normal_(0.0, 1.0).requires_grad_(True)
    weight = torch.empty(args.vocab, width, dtype=dtype).normal_(0.0, 2.0 / width**0.5).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (1, args.tokens))
    logits_bytes = args.tokens * args.vocab * hidden.element_size()
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    measured, check = _measure_steps(lambda: fwd(hidden, weight, targets), [hidden, weight], args.repeats, 64)
    assert hidden.grad is not None and weight.grad is not None
    with torch.no_grad():  # sanity check on 64 rows: the unfused expression, in float32
        z = torch.nn.functional.linear(hidden[0, :64].float(), weight.float()) / args.temperature
        ref = torch.log_softmax(z, -1).gather(-1, targets[0, :64, None]).squeeze(-1).double()
    return {
        "vocab": args.vocab,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "method": "fused",
        "chunk_size": args.chunk_size,
        "chunk_used": chunk_rows(args.tokens, args.chunk_size),
        "hidden": width,
        "logits_bytes": logits_bytes,
        "grad_bytes": grad_bytes,
        **measured,
        "max_abs_diff": float((check - ref).abs().max()),
        "threads": torch.get_num_threads(),
        "skipped": "",
    }


def worker(args: argparse.Namespace) -> dict:
    if args.method == "fused":
        return fused_worker(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fwd = _step_fn(args.method, args.temperature, args.chunk_size)

    # Warm-up on a small input (kernels, OpenMP pool), freed before the baseline.
    w = torch.randn(1, min(args.tokens, 64), args.vocab).to(dtype).requires_grad_(True)
    fwd(w, torch.randint(0, args.vocab, w.shape[:-1])).sum().backward()
    del w
    gc.collect()

    torch.manual_seed(args.seed)
    logits = torch.empty(1, args.tokens, args.vocab, dtype=dtype).normal_(0.0, 2.0).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (1, args.tokens))
    logits_bytes = logits.numel() * logits.element_size()
    measured, _ = _measure_steps(lambda: fwd(logits, targets), [logits], args.repeats)
    assert logits.grad is not None and logits.grad.shape == logits.shape
    return {
        "vocab": args.vocab,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "method": args.method,
        "chunk_size": args.chunk_size if args.method == "lean" else None,
        "logits_bytes": logits_bytes,
        **measured,
        "threads": torch.get_num_threads(),
        "skipped": "",
    }
