"""Token log-probabilities (and entropy) from logits, chunk by chunk, without a full-vocabulary copy.

:func:`token_logprobs` is ``log_softmax(logits / T, -1).gather(-1, targets)`` in a custom autograd
Function that walks the ``[N, V]`` logits ``chunk_size`` rows at a time and recomputes the softmax
in the backward, so it keeps only ``N`` floats between the two (docs/logprobs.md, "The logits
path": the memory, and why the naive expression holds several logits-sized copies).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_offpolicy.logprobs.checks import check_targets, check_temperature_and_chunk
from lightning_offpolicy.logprobs.softmax import (
    acc_dtype,
    exp_sum_and_entropy,
    ids_per_row,
    logp_to_grad,
    scaled_grads,
)

__all__ = ["token_logprobs"]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked ``log_softmax(logits / T)[target]`` with a recomputing backward (docs/logprobs.md)."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, inv_t: float, chunk_size: int, want_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        n = flat.shape[0]
        tgt = targets.reshape(n, ids_per_row(targets, logits))  # [N, K] (K = 1: one target per row)
        acc = acc_dtype(logits.dtype)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        logprobs = torch.empty(tgt.shape, dtype=acc, device=logits.device)
        entropy = torch.empty(n if want_entropy else 0, dtype=acc, device=logits.device)

        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            x = flat[start:end]
            t = tgt[start:end]
            m = x.amax(dim=-1).to(acc)  # [c]
            # d = (x - max) / T in the accumulation dtype: the one [c, V] temporary. bf16/fp16 x is
            # upcast first and then shifted in place: a mixed-dtype torch.sub(x, m) would, on CPU,
            # materialise a float32 copy of x besides its output (TensorIterator promotes inputs).
            if x.dtype == acc:
                d = torch.sub(x, m[:, None])
            else:
                d = x.to(acc)
                d.sub_(m[:, None])
            if inv_t != 1.0:
                d.mul_(inv_t)
            s, chunk_entropy = exp_sum_and_entropy(d, want_entropy)
            if chunk_entropy is not None:
                entropy[start:end] = chunk_entropy
            del d
            chunk_lse = m * inv_t + s.log()
            lse[start:end] = chunk_lse
            tgt_logit = x.gather(1, t).to(acc) * inv_t
            logprobs[start:end] = tgt_logit - chunk_lse[:, None]

        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.inv_t = inv_t
        ctx.chunk_size = chunk_size
        # An output nobody differentiates reaches backward as None, not as zeros: an entropy that is
        # only logged costs the backward nothing.
        ctx.set_materialize_grads(False)
        logprobs = logprobs.view(targets.shape)
        if want_entropy:
            entropy = entropy.view(logits.shape[:-1])
        else:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, targets, lse, entropy = ctx.saved_tensors
        inv_t: float = ctx.inv_t
        chunk_size: int = ctx.chunk_size
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        acc = lse.dtype
        n = flat.shape[0]
        tgt = targets.reshape(n, ids_per_row(targets, logits))
        g_all, ge_all = scaled_grads(grad_out, grad_entropy, entropy, tgt.shape, inv_t, acc)
        grad_logits = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
        direct = grad_logits.dtype == acc
        tmp: Tensor | None = None

        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            x = flat[start:end]
            g = g_all[start:end]  # [c, K]
            if direct:  # float32 / float64 logits: compute in place in the gradient, no temporary
                buf = grad_logits[start:end]
                if inv_t != 1.0:
                    torch.mul(x, inv_t, out=buf)
                else:
                    buf.copy_(x)
            else:  # bf16 / fp16 logits: one float32 [chunk, V] temporary, reused across chunks
                if tmp is None:
                    tmp = torch.empty((min(chunk_size, n), vocab), dtype=acc, device=logits.device)
                buf = tmp[: end - start]  # leading rows: contiguous
                buf.copy_(x)  # exact upcast
                if inv_t != 1.0:
                    buf.mul_(inv_t)
            # p = exp(z - lse); grad = (onehot - p) * grad_out / T (+ the entropy's term)
            buf.sub_(lse[start:end, None])
            logp_to_grad(buf, g.sum(dim=1, keepdim=True), ge_all, entropy, start, end)
            buf.scatter_add_(1, tgt[start:end], g)
            if not direct:
                grad_logits[start:end].copy_(buf)

        return grad_logits.view(logits.shape), None, None, None, None


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(logits / temperature, -1)[..., target]`` without a full-vocabulary copy.

    Args:
        logits: ``[..., V]`` floating-point logits, any dtype (bf16, fp16, fp32, fp64). Not copied
            (unless its leading dimensions cannot be flattened as a view); saved for the backward.
        targets: ``[...]`` integer token ids in ``[0, V)``, the shape of ``logits`` without its
            last dimension; or ``[..., K]``: ``K`` ids per row, whose logprobs all come back (the
            sampled token and the kept support of a sampling mask, :func:`causal_lm_token_logprobs`).
        temperature: sampling temperature ``T > 0``; the logits are divided by it.
        chunk_size: number of rows (tokens) processed at once. Temporaries are
            ``chunk_size x V`` float32 tensors; smaller saves memory, larger saves Python overhead.
            With bf16/fp16 logits of ``N`` rows the backward peaks at about
            ``1 + 2 * chunk_size / N`` logits tensors, so for them the chunk is capped at
            ``max(64, N // 20)`` rows (peak <= ~1.1); float32 logits peak at ~1.0 whatever the chunk.
        return_entropy: also return the entropy of ``softmax(logits / T)`` per token.

    Returns:
        ``logprobs`` of the shape of ``targets`` in float32 (float64 for float64 logits), differentiable
        w.r.t. ``logits`` (the gradient has the logits' dtype); with ``return_entropy`` a tuple
        ``(logprobs, entropy)``, both with gradient.

    Double backward (gradients of the gradient) is not supported.

    Raises:
        TypeError / ValueError: for a bad argument; the message names it.
    """
    temperature = check_temperature_and_chunk(temperature, chunk_size)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor.")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V > 0, got {tuple(logits.shape)}.")
    targets = check_targets(targets, tuple(logits.shape[:-1]), logits.device, logits.shape[-1], "logits")
    inv_t = 1.0 / temperature
    chunk_size = int(chunk_size)
    if logits.element_size() < 4:
        # Half-precision logits: float32 chunk temporaries cost 2 * chunk / N logits tensors.
        chunk_size = min(chunk_size, max(64, targets.numel() // 20))
    logprobs, entropy = _TokenLogprobs.apply(logits, targets, inv_t, chunk_size, return_entropy)
    if return_entropy:
        return logprobs, entropy
    return logprobs
