"""Token log-probabilities straight from the last hidden state: ``lm_head`` fused with the logprob.

Why
---

:func:`lightning_offpolicy.logprobs.token_logprobs` never copies the logits, but the logits
themselves still exist: the model's ``lm_head`` writes the full ``[N, V]`` tensor (``N`` tokens,
``V`` vocabulary; 2.5 GB in bf16 at ``N = 8192, V = 151936``), it stays alive until the backward
(``token_logprobs`` saves it), and the backward writes a gradient of the same size. Here the head
is applied chunk by chunk inside one :class:`torch.autograd.Function`, so no tensor with ``N * V``
elements is ever made:

* forward, per chunk of ``c`` rows: ``z = (hidden_chunk @ W.T + b) / T`` in float32 (float64 for
  float64 inputs; on CUDA the bf16/fp16 product is written as float32 directly; on CPU the
  bf16/fp16 weight is upcast in blocks of rows and multiplied in float32, because CPU
  half-precision matmuls are slow; elsewhere the product is rounded to the input dtype first, as
  ``lm_head`` does, then upcast), ``lse = logsumexp(z)``,
  ``logprob = z[target] - lse`` and optionally the entropy. Saved for backward: ``hidden``,
  ``W`` and ``b`` (the caller's tensors, no copies), the targets and ``lse`` (``N`` floats).
* backward, per chunk: ``z`` is recomputed, turned in place into
  ``dz = (onehot(target) - softmax(z)) * grad_out / T``, and then
  ``grad_hidden[chunk] = dz @ W`` and ``grad_W += dz.T @ hidden_chunk`` (``grad_b += dz.sum(0)``).
  ``grad_W`` is accumulated in ``W``'s dtype (one rounding per chunk for bf16 weights; see the
  tolerance in :func:`fused_linear_token_logprobs`).

Memory
------

Extra memory besides the inputs and the gradients autograd has to return anyway (``grad_hidden``
``[N, H]`` and ``grad_W`` ``[V, H]``, which the unfused path returns too) is, in bytes, with
``a = 4`` (float32 accumulation; 8 for float64) and ``s`` the element size of the inputs:

* forward: ``a * c * V`` (one chunk of float32 logits), ``2 * a * c * V`` with the entropy,
  plus ``s * c * V`` where the bf16 product is not written in float32 directly (on CPU: the
  float32 weight block, at most that size, plus a ``[c, block]`` product);
* backward: ``a * c * V`` plus, for bf16/fp16 inputs, ``s * c * V`` (the chunk's gradient cast
  to the weight's dtype for the two matmuls; on CPU the float32 weight block or the block's
  ``grad_W`` product instead, at most that size).

The chunk is ``c = min(chunk_size, max(64, N // 32))``, so for bf16 (``s = 2``) the peak is
``8 c V <= N V / 4`` bytes: at most **0.125x one bf16 logits tensor** (``2 N V`` bytes) whenever
``N >= 2048``, which leaves room within 0.25x for the gradient of the head's weight at common
widths; for float32 inputs it is at most 0.0625x of their float32 logits. At
``N = 8192, V = 151936`` (bf16): ``c = 256``, forward 233 MB (311 MB with the entropy,
0.125x), backward 233 MB (0.094x), against 2.49 GB for the logits and as much again for their
gradient. ``benchmarks/logprob_memory.py`` measures it (``docs/reports/performance_logprobs.md``).

Limits: there is no double backward (the entropy, as in ``token_logprobs``, carries its gradient),
and the head must be linear: ``lm_head`` as a plain ``nn.Linear``, or with plain peft LoRA adapters
(``low_rank`` terms, below), with no soft-capping or scaling after it
(:func:`lightning_offpolicy.logprobs.causal_lm_token_logprobs` checks and falls back otherwise).

LoRA on the head
----------------

peft's ``lora.Linear`` computes ``base(x) + sum_k lora_B_k(lora_A_k(dropout_k(x))) * s_k``. The
fused head takes the adapters as low-rank terms: ``u_k = lora_A_k(dropout_k(x))`` (``[N, r]``)
is computed outside with ordinary autograd, and the Function adds ``s_k * u_k @ B_k.T`` to each
float32 logits chunk in place (``addmm_``) and returns ``grad_u_k = s_k * dz @ B_k`` and
``grad_B_k = s_k * dz.T @ u_k``. The memory bound above is unchanged (the terms add ``[N, r]``
and ``[V, r]`` float32 tensors, small).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_offpolicy.argcheck import is_real
from lightning_offpolicy.logprobs import (
    _acc_dtype,
    _check_common,
    _check_targets,
    _ids_per_row,
    _logp_to_grad,
    _scaled_grads,
)

__all__ = [
    "FUSED_HEAD_ARCHITECTURES",
    "fused_head_parts",
    "fused_head_token_logprobs",
    "fused_linear_token_logprobs",
]

#: Smallest chunk the automatic cap goes down to (tiny chunks only add Python overhead).
MIN_CHUNK = 64
#: ``c <= N // CHUNK_DIVISOR`` keeps the chunk temporaries <= 0.125x one bf16 logits tensor.
CHUNK_DIVISOR = 32


def chunk_rows(num_tokens: int, chunk_size: int) -> int:
    """Rows per chunk for ``num_tokens`` tokens: ``min(chunk_size, max(MIN_CHUNK, num_tokens // CHUNK_DIVISOR))``."""
    return min(int(chunk_size), max(MIN_CHUNK, num_tokens // CHUNK_DIVISOR))


#: transformers causal-LM classes whose forward is ``lm_head(last_hidden_state[:, keep])`` with
#: nothing after it other than what a config attribute in ``_LOGIT_TRANSFORMS`` announces (checked
#: in transformers 5.x). Other classes use the fused head only when asked (``fused_head=True``).
FUSED_HEAD_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Olmo2ForCausalLM",
    }
)

#: Config attributes of a model that changes its logits after ``lm_head`` (name -> the value
#: that means "no change"): soft-capping (Gemma 2/3), scaling (Cohere, Granite, Falcon-H1).
_LOGIT_TRANSFORMS: dict[str, Any] = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
    "output_multiplier": 1.0,
}

# Whether ``torch.mm(a, b, out_dtype=float32)`` works on a device type (CUDA: yes, CPU: no in
# torch 2.13). Probed once per device type.
_MM_OUT_DTYPE: dict[str, bool] = {}


def _cpu_half(weight: Tensor) -> bool:
    """bf16/fp16 weight on CPU: its matmuls run blockwise in float32 (see :func:`_weight_blocks`)."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)


def _block_rows(weight: Tensor, rows: int, acc: torch.dtype) -> int:
    """Rows ``b`` of the float32 weight blocks: ``b * H * a <= 2 * rows * V`` bytes.

    CPU half-precision matmuls are slow and, for some layouts, very slow (``dz @ W`` with a bf16
    ``[V, H]`` weight ran at 0.3-0.5 GFLOP/s on the 2-core benchmark machine, float32 at ~27).
    The weight is therefore upcast in blocks no larger than the half-precision ``[rows, V]``
    buffer the CUDA path uses, so the memory bound is unchanged.
    """
    vocab, width = weight.shape
    return max(1, min(vocab, (2 * rows * vocab) // (width * torch.finfo(acc).bits // 8)))


def _weight_blocks(weight: Tensor, rows: int, acc: torch.dtype):
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
        acc = _acc_dtype(hidden.dtype)
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
                if want_entropy:
                    e = torch.exp(z)  # second temporary, only with the entropy
                    s = e.sum(dim=-1)
                    # sum_v e_v * d_v as a batched dot product (no third [c, V] temporary).
                    ed = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
                    del e
                    entropy[start:end] = s.log() - ed / s
                else:
                    s = z.exp_().sum(dim=-1)
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
        g_all, ge_all = _scaled_grads(grad_out, grad_entropy, entropy, targets.shape, inv_t, acc)
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
                _logp_to_grad(z, g.sum(dim=1, keepdim=True), ge_all, entropy, start, end)
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
    ``hidden @ weight.T + bias + sum_k s_k * u_k @ B_k.T``: a LoRA adapter on the head, with
    ``u_k = lora_A_k(dropout_k(hidden))`` computed by the caller (``[..., r]``, small, ordinary
    autograd) and ``B_k = lora_B_k.weight`` (``[V, r]``). The terms are accumulated into each
    float32 logits chunk in place (no extra ``[c, V]`` temporary), and the backward returns
    ``grad_u_k = s_k * dz @ B_k`` and ``grad_B_k = s_k * dz.T @ u_k``, accumulated chunk by chunk
    in float32 (float64 for float64 inputs) and cast to their dtypes once.

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
            logits tensor (module docstring, "Memory").
        return_entropy: also return the entropy of ``softmax(logits / T)`` per token (with gradient).
        low_rank: ``(u, B, scale)`` triples: ``u`` of shape ``[..., r]`` (``hidden``'s leading
            dimensions), ``B`` of shape ``[V, r]``, ``scale`` a finite real number; ``u`` and
            ``B`` floating point, of any dtype (computed in float32, float64 for float64 hidden).

    Returns:
        ``logprobs`` of the shape of ``targets`` in float32 (float64 for float64 inputs), differentiable
        w.r.t. ``hidden``, ``weight``, ``bias`` and every ``u`` and ``B``; with ``return_entropy`` a tuple
        ``(logprobs, entropy)``, the entropy with its gradient too.

    Inside ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``nn.Linear``
    would be. With float32/float64 inputs values and gradients equal the unfused expression to
    rounding; with bf16 inputs the logits are computed in float32 (on CUDA and CPU; elsewhere
    rounded to bf16 as ``lm_head`` does) and ``grad_weight`` is accumulated in bf16 once per
    chunk, so it differs from the unfused bf16 gradient by a few bf16 ulps
    (tests/test_fused_logprobs.py: every output and gradient within 1% of its norm of a float64
    reference, and within 1.25x the unfused bf16 path's error; measured on CPU 0.29% vs 0.48% for
    ``grad_weight``).

    Raises:
        TypeError / ValueError: for a bad argument; the message names it.
    """
    temperature = _check_common(temperature, chunk_size)
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
    targets = _check_targets(targets, tuple(hidden.shape[:-1]), hidden.device, vocab, "hidden")
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
    flat_t = targets.reshape(n, _ids_per_row(targets, hidden))  # [N, K] (K = 1: one target per row)
    chunk = chunk_rows(n, chunk_size)
    lp, ent = _FusedLinearLogprobs.apply(
        flat_h, weight, bias, flat_t, 1.0 / temperature, chunk, return_entropy, tuple(scales), *flat_terms
    )
    lp = lp.view(out_shape)
    if return_entropy:
        return lp, ent.view(hidden.shape[:-1])
    return lp


def _is_sharded(module: nn.Module, head: nn.Module) -> bool:
    """True for FSDP2 / DTensor models: their root hooks must run, i.e. the model's own forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule) or isinstance(head.weight, DTensor)


def _no_hooks(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _peft_lora_linear_type() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # peft not installed
        return None
    return Linear


def _head_adapters(head: nn.Module) -> tuple[nn.Linear, list[tuple[nn.Module, nn.Linear, nn.Linear, float]]] | str:
    """The plain ``nn.Linear`` and the LoRA adapters ``(dropout, lora_A, lora_B, scaling)`` of a head.

    A plain ``nn.Linear`` has no adapters. A peft ``lora.Linear`` around one is taken apart the
    way its forward reads it (peft 0.17 - 0.21): adapters disabled -> the base layer alone;
    merged -> the base layer alone (its weight already holds ``B A * scaling``); otherwise
    ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` for each active adapter. Anything
    else (DoRA and other LoRA variants, ``lora_bias``, ``fan_in_fan_out``, a disabled adapter on
    merged weights, which the forward unmerges first, hooks) is refused with the reason.
    """
    if type(head) is nn.Linear:
        return (head, []) if _no_hooks(head) else "lm_head has forward hooks or a patched forward"
    lora_linear = _peft_lora_linear_type()
    if lora_linear is None or type(head) is not lora_linear:
        return (
            f"the output embedding is {type(head).__name__}, not a torch.nn.Linear or a peft LoRA "
            "Linear around one (e.g. a quantized head)"
        )
    base = head.base_layer
    if type(base) is not nn.Linear:
        return f"LoRA on lm_head wraps a {type(base).__name__}, not a plain torch.nn.Linear"
    if not (_no_hooks(head) and _no_hooks(base)):
        return "lm_head (LoRA) has forward hooks or a patched forward"
    if getattr(head, "fan_in_fan_out", False):
        return "LoRA on lm_head has fan_in_fan_out=True"
    if head.disable_adapters:
        if head.merged:
            return "LoRA on lm_head is merged but disabled (its forward unmerges the weights first)"
        return base, []
    if head.merged:
        return base, []
    adapters: list[tuple[nn.Module, nn.Linear, nn.Linear, float]] = []
    for name in head.active_adapters:
        if name not in head.lora_A.keys():
            continue
        variants = getattr(head, "lora_variant", {})
        if name in variants or getattr(head, "use_dora", {}).get(name, False):
            variant = type(variants.get(name)).__name__
            return f"LoRA adapter {name!r} on lm_head is a LoRA variant ({variant}, e.g. DoRA), not plain LoRA"
        if getattr(head, "lora_bias", {}).get(name, False):
            return f"LoRA adapter {name!r} on lm_head has lora_bias=True"
        lora_a, lora_b, dropout = head.lora_A[name], head.lora_B[name], head.lora_dropout[name]
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None:
            return f"LoRA adapter {name!r} on lm_head: lora_A / lora_B are not plain bias-free nn.Linear"
        if type(dropout) not in (nn.Dropout, nn.Identity):
            return f"LoRA adapter {name!r} on lm_head has a {type(dropout).__name__} dropout"
        if not all(_no_hooks(m) for m in (lora_a, lora_b, dropout)):
            return f"LoRA adapter {name!r} on lm_head has forward hooks"
        scaling = head.scaling[name]
        if not is_real(scaling) or not math.isfinite(float(scaling)):
            return f"LoRA adapter {name!r} on lm_head has a non-scalar scaling"
        adapters.append((dropout, lora_a, lora_b, float(scaling)))
    return base, adapters


def fused_head_token_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`fused_linear_token_logprobs` of a head that :func:`fused_head_parts` accepted.

    For a plain ``nn.Linear`` its weight and bias; for peft LoRA on the head, the base layer's
    weight and bias plus one low-rank term per active adapter,
    ``u = lora_A(dropout(hidden))`` (``hidden`` cast to ``lora_A``'s dtype first, as peft does),
    ``B = lora_B.weight``, ``scale = scaling``. The adapters' dropout runs here, on the hidden
    states the head sees, as in the model's own forward.

    Rounding differs from peft's forward only where it rounds: peft adds the float32 adapter
    output to the bf16 base output and rounds the sum to bf16; here both are summed in float32.

    Raises:
        ValueError: the head cannot be fused (the reason).
    """
    parts = _head_adapters(head)
    if isinstance(parts, str):
        raise ValueError(f"the head cannot be fused: {parts}.")
    base, adapters = parts
    low_rank = []
    for dropout, lora_a, lora_b, scaling in adapters:
        x = head._cast_input_dtype(hidden, lora_a.weight.dtype)
        low_rank.append((lora_a(dropout(x)), lora_b.weight, scaling))
    return fused_linear_token_logprobs(
        hidden,
        base.weight,
        targets,
        bias=base.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        low_rank=low_rank,
    )


def fused_head_parts(model: nn.Module, force: bool = False) -> tuple[nn.Module, nn.Module] | str:
    """The ``(decoder, lm_head)`` of a transformers causal LM whose head can be fused, or why not.

    The decoder (``model.base_model``, e.g. ``LlamaModel``) returns the final-normed hidden
    states; the head must be a plain ``nn.Linear`` without hooks, or a peft LoRA ``Linear``
    around one with plain LoRA adapters (see :func:`fused_head_token_logprobs`; DoRA and other
    variants are refused). A peft model with adapters injected into its layers (LoRA) is
    unwrapped (its layers keep the adapters); prompt learning is not (the peft forward adds
    virtual tokens).

    Args:
        model: the causal LM (or a peft model around one).
        force: accept a class outside :data:`FUSED_HEAD_ARCHITECTURES` when the structure fits
            (the caller vouches that its forward applies nothing after ``lm_head``).

    Returns:
        ``(decoder, head)`` (give ``head`` to :func:`fused_head_token_logprobs`), or a sentence
        saying why the head cannot be fused.
    """
    base = model
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and hasattr(model, "get_base_model"):
        if getattr(peft_config, "is_prompt_learning", False):
            return "a peft prompt-learning model (its forward adds virtual tokens)"
        base = model.get_base_model()
    for m in {id(model): model, id(base): base}.values():
        if not _no_hooks(m):
            return f"{type(m).__name__} has forward hooks or a patched forward, which the fused path would skip"
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        return f"the output embedding is {type(head).__name__}, not a torch.nn.Linear"
    parts = _head_adapters(head)
    if isinstance(parts, str):
        return parts
    linear, adapters = parts
    if not linear.weight.is_floating_point() or not all(b.weight.is_floating_point() for _, _, b, _ in adapters):
        return "lm_head's weight is not floating point"
    if _is_sharded(model, linear) or _is_sharded(base, linear):
        return "the model is sharded (FSDP / DTensor): its own forward must run"
    config = getattr(base, "config", None)
    for attr, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, attr, neutral)
        if value is not None and value != neutral and not (neutral is None and value == 0):
            return f"config.{attr} = {value!r} changes the logits after lm_head"
    if not force and type(base).__name__ not in FUSED_HEAD_ARCHITECTURES:
        return f"{type(base).__name__} is not in FUSED_HEAD_ARCHITECTURES (pass fused_head=True to force)"
    decoder = getattr(base, "base_model", None)
    if not isinstance(decoder, nn.Module) or decoder is base:
        return f"{type(base).__name__} has no separate decoder (base_model)"
    return decoder, head
