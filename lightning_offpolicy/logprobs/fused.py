"""Token log-probabilities straight from the last hidden state: a linear head fused with the logprob.

:func:`fused_linear_token_logprobs` applies ``hidden @ W.T + b`` (plus low-rank LoRA terms) chunk by
chunk inside one autograd Function, takes the logprob of each chunk and drops it, and recomputes it
in the backward, so no tensor of ``N * V`` elements (neither the logits nor their gradient) is ever
made. docs/logprobs.md, "The fused head", gives the memory bound, the CPU half-precision path and
how LoRA adapters on the head enter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_offpolicy.argcheck import is_real
from lightning_offpolicy.logprobs.checks import check_targets, check_temperature_and_chunk
from lightning_offpolicy.logprobs.softmax import (
    acc_dtype,
    exp_sum_and_entropy,
    ids_per_row,
    logp_to_grad,
    scaled_grads,
)

__all__ = ["CHUNK_DIVISOR", "MIN_CHUNK", "chunk_rows", "fused_linear_token_logprobs"]

#: Smallest chunk the automatic cap goes down to (tiny chunks only add Python overhead).
MIN_CHUNK = 64


#: ``c <= N // CHUNK_DIVISOR`` keeps the chunk temporaries <= 0.125x one bf16 logits tensor.
CHUNK_DIVISOR = 32


def chunk_rows(num_tokens: int, chunk_size: int) -> int:
    """Rows per chunk for ``num_tokens`` tokens: ``min(chunk_size, max(MIN_CHUNK, num_tokens // CHUNK_DIVISOR))``."""
    return min(int(chunk_size), max(MIN_CHUNK, num_tokens // CHUNK_DIVISOR))


# Whether ``torch.mm(a, b, out_dtype=float32)`` works on a device type (CUDA: yes, CPU: no in
# torch 2.13). Probed once per device type.
_MM_OUT_DTYPE: dict[str, bool] = {}


def _cpu_half(weight: Tensor) -> bool:
    """bf16/fp16 weight on CPU: its matmuls run blockwise in float32 (see :func:`_weight_blocks`)."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)


def _block_rows(weight: Tensor, rows: int, acc: torch.dtype) -> int:
    """Rows ``b`` of the float32 weight blocks: ``b * H * a <= 2 * rows * V`` bytes.

    CPU half-precision matmuls are slow (docs/logprobs.md, "Half precision on CPU"), so the weight
    is upcast in blocks no larger than the half-precision ``[rows, V]`` buffer the CUDA path uses,
    which leaves the memory bound unchanged.
    """
    vocab, width = weight.shape
    return max(1, min(vocab, (2 * rows * vocab) // (width * torch.finfo(acc).bits // 8)))


def _weight_blocks(weight: Tensor, rows: int, acc: torch.dtype) -> Iterator[tuple[slice, Tensor]]:
    """``(slice, block)`` over the vocabulary: ``block`` is ``weight[slice]`` in ``acc``.

    The blocks are views of one workspace, reused (allocating each block anew churns the CPU
    allocator, which then keeps the freed memory mapped).
    """
    vocab, width = weight.shape
    step = _block_rows(weight, rows, acc)
    buf = torch.empty(step * width, dtype=acc, device=weight.device)
    for start in range(0, vocab, step):
        end = min(start + step, vocab)
        block = buf[: (end - start) * width].view(end - start, width)
        block.copy_(weight[start:end])
        yield slice(start, end), block


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, acc: torch.dtype) -> Tensor:
    """``h @ weight.T + bias`` as a new ``[c, V]`` tensor of dtype ``acc``."""
    if h.dtype == acc:
        z = torch.mm(h, weight.t())
    elif _cpu_half(weight):  # float32 products by weight blocks (no half-precision [c, V] temporary)
        z = torch.empty((h.shape[0], weight.shape[0]), dtype=acc, device=h.device)
        hf = h.to(acc)
        prod = torch.empty(h.shape[0] * _block_rows(weight, h.shape[0], acc), dtype=acc, device=h.device)
        for sl, wb in _weight_blocks(weight, h.shape[0], acc):
            p = prod[: h.shape[0] * wb.shape[0]].view(h.shape[0], wb.shape[0])
            z[:, sl] = torch.mm(hf, wb.t(), out=p)
    else:
        dev = h.device.type
        z = None
        if _MM_OUT_DTYPE.get(dev, True):
            try:  # float32 output of a bf16 product: no bf16 [c, V] temporary, no rounding
                z = torch.mm(h, weight.t(), out_dtype=acc)
                _MM_OUT_DTYPE[dev] = True
            except (RuntimeError, TypeError, NotImplementedError):
                _MM_OUT_DTYPE[dev] = False
        if z is None:
            z = torch.mm(h, weight.t()).to(acc)
    if bias is not None:
        z.add_(bias)
    return z


class _FusedLinearLogprobs(torch.autograd.Function):
    """Chunked ``log_softmax((hidden @ W.T + b) / T)[target]`` with a recomputing backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        inv_t: float,
        chunk_size: int,
        want_entropy: bool,
        scales: tuple[float, ...],
        *terms: Tensor,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        acc = acc_dtype(hidden.dtype)
        dev = hidden.device
        # Low-rank terms (u_k [N, r], B_k [V, r]) in the accumulation dtype: small copies at most.
        low_rank = [(terms[2 * k].to(acc), terms[2 * k + 1].to(acc), s) for k, s in enumerate(scales)]
        lse = torch.empty(n, dtype=acc, device=dev)
        logprobs = torch.empty(targets.shape, dtype=acc, device=dev)  # [N, K]
        entropy = torch.empty(n if want_entropy else 0, dtype=acc, device=dev)
        # The dtypes are settled by the caller; an enclosing autocast must not recast the chunks.
        with torch.autocast(dev.type, enabled=False):
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                z = _chunk_logits(hidden[start:end], weight, bias, acc)  # the one [c, V] temporary
                for u, b_k, scale in low_rank:  # + scale * u @ B.T, accumulated in place
                    z.addmm_(u[start:end], b_k.t(), alpha=scale)
                if inv_t != 1.0:
                    z.mul_(inv_t)
                tgt_z = z.gather(1, targets[start:end])
                m = z.amax(dim=-1)
                z.sub_(m[:, None])
                s, chunk_entropy = exp_sum_and_entropy(z, want_entropy)
                if chunk_entropy is not None:
                    entropy[start:end] = chunk_entropy
                del z
                chunk_lse = m + s.log()
                lse[start:end] = chunk_lse
                logprobs[start:end] = tgt_z - chunk_lse[:, None]

        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, *terms)
        ctx.inv_t = inv_t
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)  # an entropy that is only logged reaches backward as None
        ctx.scales = scales
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy, *terms = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scales: tuple[float, ...] = ctx.scales
        need_terms = ctx.needs_input_grad[8:]
        inv_t: float = ctx.inv_t
        chunk_size: int = ctx.chunk_size
        n = hidden.shape[0]
        vocab = weight.shape[0]
        acc = lse.dtype
        dev = hidden.device
        g_all, ge_all = scaled_grads(grad_out, grad_entropy, entropy, targets.shape, inv_t, acc)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(vocab, dtype=acc, device=dev) if (need_b and bias is not None) else None
        low: Tensor | None = None  # reused bf16/fp16 buffer for the chunk's gradient
        # Low-rank terms in the accumulation dtype, and their gradients (accumulated in it: [N, r]
        # and [V, r], small), cast back to the inputs' dtypes at the end.
        low_rank = [(terms[2 * k].to(acc), terms[2 * k + 1].to(acc), s) for k, s in enumerate(scales)]
        grad_terms: list[Tensor | None] = []
        for k, (u, b_k, _) in enumerate(low_rank):
            grad_terms.append(torch.empty_like(u) if need_terms[2 * k] else None)
            grad_terms.append(torch.zeros_like(b_k) if need_terms[2 * k + 1] else None)
        with torch.autocast(dev.type, enabled=False):
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                h = hidden[start:end]
                g = g_all[start:end]  # [c, K]
                z = _chunk_logits(h, weight, bias, acc)
                for u, b_k, scale in low_rank:
                    z.addmm_(u[start:end], b_k.t(), alpha=scale)
                if inv_t != 1.0:
                    z.mul_(inv_t)
                # dz = (onehot - p) * grad_out / T (+ the entropy's term), in place: p = exp(z - lse).
                z.sub_(lse[start:end, None])
                logp_to_grad(z, g.sum(dim=1, keepdim=True), ge_all, entropy, start, end)
                z.scatter_add_(1, targets[start:end], g)
                if grad_b is not None:
                    grad_b += z.sum(dim=0)
                for k, (u, b_k, scale) in enumerate(low_rank):  # d/du = s dz @ B, d/dB = s dz.T @ u
                    gu, gb_k = grad_terms[2 * k], grad_terms[2 * k + 1]
                    if gu is not None:
                        torch.mm(z, b_k, out=gu[start:end])
                        if scale != 1.0:
                            gu[start:end].mul_(scale)
                    if gb_k is not None:
                        gb_k.addmm_(z.t(), u[start:end], alpha=scale)
                if z.dtype != weight.dtype and _cpu_half(weight):  # CPU bf16/fp16: float32 blocks
                    gh = torch.zeros((end - start, weight.shape[1]), dtype=acc, device=dev) if need_h else None
                    hf = h.to(acc) if need_w else None
                    for sl, wb in _weight_blocks(weight, end - start, acc):
                        if gh is not None:
                            gh.addmm_(z[:, sl], wb)
                        if grad_w is not None:  # the block's grad_weight, in the block's workspace
                            grad_w[sl] += torch.mm(z[:, sl].t(), hf, out=wb)
                    if grad_h is not None:
                        grad_h[start:end] = gh
                    del z, gh, hf
                    continue
                if z.dtype != weight.dtype:  # bf16/fp16: the matmuls run in the weight's dtype
                    if low is None:
                        low = torch.empty((min(chunk_size, n), vocab), dtype=weight.dtype, device=dev)
                    dz = low[: end - start]  # leading rows: contiguous
                    dz.copy_(z)
                    del z
                else:
                    dz = z
                if grad_h is not None:
                    torch.mm(dz, weight, out=grad_h[start:end])
                if grad_w is not None:
                    grad_w.addmm_(dz.t(), h)
                del dz
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        grads_out = [g.to(t.dtype) if g is not None else None for g, t in zip(grad_terms, terms, strict=True)]
        return grad_h, grad_w, grad_b, None, None, None, None, None, *grads_out


def fused_linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    low_rank: Sequence[tuple[Tensor, Tensor, float]] = (),
) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax((hidden @ weight.T + bias) / temperature, -1)[..., target]`` without the logits.

    With ``low_rank`` terms ``(u_k, B_k, s_k)`` the logits are
    ``hidden @ weight.T + bias + sum_k s_k * u_k @ B_k.T``: LoRA adapters on the head, with
    ``u_k = lora_A_k(dropout_k(hidden))`` computed by the caller and ``B_k = lora_B_k.weight``
    (docs/logprobs.md, "LoRA on the head").

    Args:
        hidden: ``[..., H]`` floating-point hidden states (the input of ``lm_head``). Saved for
            the backward (not copied, unless its leading dimensions cannot be flattened as a view).
        weight: ``[V, H]`` head weight (``lm_head.weight``; a tied embedding works: its gradient
            from this use is added to the one from the embedding lookup by autograd).
        targets: ``[...]`` integer token ids in ``[0, V)``, the shape of ``hidden`` without its
            last dimension; or ``[..., K]``: ``K`` ids per row, whose logprobs all come back.
        bias: optional ``[V]`` head bias.
        temperature: sampling temperature ``T > 0``; the logits are divided by it.
        chunk_size: most rows (tokens) computed at once. The chunk used is
            ``min(chunk_size, max(64, N // 32))`` so that the temporaries stay <= 0.125x one bf16
            logits tensor (docs/logprobs.md, "The fused head").
        return_entropy: also return the entropy of ``softmax(logits / T)`` per token (with gradient).
        low_rank: ``(u, B, scale)`` triples: ``u`` of shape ``[..., r]`` (``hidden``'s leading
            dimensions), ``B`` of shape ``[V, r]``, ``scale`` a finite real number; ``u`` and
            ``B`` floating point, of any dtype (computed in float32, float64 for float64 hidden).

    Returns:
        ``logprobs`` of the shape of ``targets`` in float32 (float64 for float64 inputs), differentiable
        w.r.t. ``hidden``, ``weight``, ``bias`` and every ``u`` and ``B``; with ``return_entropy`` a tuple
        ``(logprobs, entropy)``, the entropy with its gradient too.

    Inside ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``nn.Linear``
    would be. Values and gradients equal the unfused expression's to rounding (docs/logprobs.md,
    "Precision").

    Raises:
        TypeError / ValueError: for a bad argument; the message names it.
    """
    temperature = check_temperature_and_chunk(temperature, chunk_size)
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor.")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got {tuple(weight.shape)}.")
    vocab, width = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != width:
        raise ValueError(f"hidden must have shape [..., H] with H = {width} (weight's), got {tuple(hidden.shape)}.")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (vocab,)):
        raise ValueError(f"bias must be None or a tensor of shape ({vocab},).")
    targets = check_targets(targets, tuple(hidden.shape[:-1]), hidden.device, vocab, "hidden")
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type):
        # What nn.Linear gets under autocast: both operands in the autocast dtype (differentiable casts).
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(
            f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share a dtype (outside autocast)."
        )
    scales: list[float] = []
    flat_terms: list[Tensor] = []
    for k, term in enumerate(low_rank):
        if not isinstance(term, (tuple, list)) or len(term) != 3:
            raise TypeError(f"low_rank[{k}] must be a (u, B, scale) triple.")
        u, b_k, scale = term
        if not all(isinstance(t, Tensor) and t.is_floating_point() for t in (u, b_k)):
            raise TypeError(f"low_rank[{k}]: u and B must be floating-point torch.Tensors.")
        if b_k.dim() != 2 or b_k.shape[0] != vocab:
            raise ValueError(f"low_rank[{k}]: B must have shape [V, r] with V = {vocab}, got {tuple(b_k.shape)}.")
        if tuple(u.shape) != tuple(hidden.shape[:-1]) + (b_k.shape[1],):
            raise ValueError(
                f"low_rank[{k}]: u must have shape {tuple(hidden.shape[:-1]) + (b_k.shape[1],)} "
                f"(hidden's leading dimensions, B's rank), got {tuple(u.shape)}."
            )
        if not is_real(scale) or not math.isfinite(float(scale)):
            raise TypeError(f"low_rank[{k}]: scale must be a finite real number, got {scale!r}.")
        if u.device != hidden.device or b_k.device != hidden.device:
            raise ValueError(f"low_rank[{k}]: u and B must be on hidden's device ({hidden.device}).")
        if torch.is_autocast_enabled(dev_type):
            dt = torch.get_autocast_dtype(dev_type)
            u, b_k = u.to(dt), b_k.to(dt)
        scales.append(float(scale))
        flat_terms += [u.reshape(-1, b_k.shape[1]), b_k]
    out_shape = targets.shape
    flat_h = hidden.reshape(-1, width)
    n = flat_h.shape[0]
    flat_t = targets.reshape(n, ids_per_row(targets, hidden))  # [N, K] (K = 1: one target per row)
    chunk = chunk_rows(n, chunk_size)
    lp, ent = _FusedLinearLogprobs.apply(
        flat_h, weight, bias, flat_t, 1.0 / temperature, chunk, return_entropy, tuple(scales), *flat_terms
    )
    lp = lp.view(out_shape)
    if return_entropy:
        return lp, ent.view(hidden.shape[:-1])
    return lp
