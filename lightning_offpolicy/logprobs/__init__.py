"""Memory-lean token log-probabilities (and entropy) from a causal LM's logits.

Why not ``log_softmax(logits.float() / T, -1).gather(-1, targets)``?
---------------------------------------------------------------------

For ``N`` tokens and a vocabulary of ``V`` the logits are an ``[N, V]`` tensor, often the largest
activation of the whole step (``N = 8192``, ``V = 151936``: 2.5 GB in bf16, 5.0 GB in float32).
The naive expression:

1. makes a float32 copy of the logits (``.float()``), and another one for ``/ T``;
2. ``log_softmax`` writes a full ``[N, V]`` float32 output **and saves it for backward** (its
   gradient is ``g - exp(out) * sum(g)``), so one full-vocabulary float32 copy stays alive from
   the forward until the backward, although only ``N`` of its ``N * V`` entries are ever read;
3. the backward then builds a float32 ``[N, V]`` gradient of ``log_softmax``'s output (the
   scatter of ``gather``), one of its input, and finally the gradient of the logits in their own
   dtype.

So the naive path holds about two to four logits-sized float32 tensors at its peak, on top of
the logits themselves.

What :func:`token_logprobs` does instead
----------------------------------------

A custom :class:`torch.autograd.Function` walks the flattened ``[N, V]`` logits in chunks of
``chunk_size`` rows:

* forward, per chunk: ``lse = logsumexp(logits_chunk.float() / T)`` and
  ``logprob = logits[target].float() / T - lse``. Saved for backward: the logits themselves
  (the caller's tensor, not a copy), the targets and ``lse`` (``N`` floats). Extra memory: one
  float32 ``[chunk_size, V]`` temporary (two when the entropy is requested).
* backward, per chunk: ``p = exp(logits_chunk.float() / T - lse)`` and
  ``grad_chunk = (onehot(target) - p) * grad_out[:, None] / T``, written into a single
  preallocated ``grad_logits`` of the logits' dtype (for float32 logits directly into it, with no
  temporary at all; for bf16/fp16 through one float32 ``[chunk_size, V]`` temporary).

Peak extra memory is therefore one gradient-sized tensor (which autograd has to return anyway)
plus ``chunk_size * V`` float32 temporaries. For ``N`` rows of ``s``-byte logits, in units of one
logits tensor: the backward peaks at ``1 + 4 * chunk_size / (s * N)`` for bf16/fp16 (``s = 2``;
1.25 for ``chunk_size = 1024, N = 8192``) and at ~1.0 for float32 logits (computed in place in
the gradient); the forward peaks at ``4 * chunk_size / (s * N)`` (twice that with the entropy) and
keeps only ``N`` floats for the backward. ``benchmarks/logprob_memory.py`` measures it; see
``docs/reports/performance_logprobs.md``.
Values are computed in float32 (float64 for float64 logits), so bf16 logits lose nothing compared
with the naive ``.float()`` path.

Limitations
-----------

* The entropy (``return_entropy=True``) carries its gradient (``dH/dz = -p (log p + H)``, added in
  the same recomputing backward with one more ``[chunk, V]`` temporary, only when the entropy is
  used), so an entropy bonus in the loss trains through it.
* Double backward is not supported (the backward is ``once_differentiable``); nothing in an
  off-policy policy-gradient loss needs it.
* Logits whose leading dimensions cannot be flattened into ``[N, V]`` without a copy (e.g. a
  strided slice ``logits[:, :-1]``) are copied once by ``reshape``; pass contiguous logits to
  stay lean (:func:`causal_lm_token_logprobs` does).

Without the logits at all
-------------------------

:func:`causal_lm_token_logprobs` by default does not even make the logits: where the model allows
it, ``lm_head`` is fused with the logprob (:mod:`lightning_offpolicy.logprobs.fused`), chunk by
chunk from the last hidden states. With ``c = min(chunk_size, max(64, N // 32))`` rows per chunk
its extra memory is ``8 * c * V`` bytes for bf16 (``6 c V`` in the backward), i.e. at most
``N * V / 4`` bytes = 0.125x one bf16 logits tensor for ``N >= 2048``, and neither the logits nor
their gradient exists. ``fused_head=False`` selects the logits path described above.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_offpolicy.argcheck import is_int, is_real

__all__ = ["token_logprobs", "causal_lm_token_logprobs"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the values are computed in: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _TokenLogprobs(torch.autograd.Function):
    """Chunked ``log_softmax(logits / T)[target]`` with a recomputing backward (see module doc)."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, inv_t: float, chunk_size: int, want_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        n = flat.shape[0]
        tgt = targets.reshape(n, _ids_per_row(targets, logits))  # [N, K] (K = 1: one target per row)
        acc = _acc_dtype(logits.dtype)
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
            if want_entropy:
                e = torch.exp(d)  # second temporary, only when the entropy is wanted
                s = e.sum(dim=-1)
                # sum_v e_v * d_v as a batched dot product (no third [c, V] temporary).
                ed = torch.bmm(e.unsqueeze(1), d.unsqueeze(2)).reshape(-1)
                del e
                # H = lse - sum p z = log s - sum(e d) / s, with d = z - max z.
                entropy[start:end] = s.log() - ed / s
            else:
                s = d.exp_().sum(dim=-1)
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
        tgt = targets.reshape(n, _ids_per_row(targets, logits))
        g_all, ge_all = _scaled_grads(grad_out, grad_entropy, entropy, tgt.shape, inv_t, acc)
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
            _logp_to_grad(buf, g.sum(dim=1, keepdim=True), ge_all, entropy, start, end)
            buf.scatter_add_(1, tgt[start:end], g)
            if not direct:
                grad_logits[start:end].copy_(buf)

        return grad_logits.view(logits.shape), None, None, None, None


def _ids_per_row(targets: Tensor, source: Tensor) -> int:
    """``K``: targets of ``source``'s shape without its last dimension hold one id per row, else their last size."""
    return targets.shape[-1] if targets.dim() == source.dim() else 1


def _scaled_grads(
    grad_out: Tensor | None,
    grad_entropy: Tensor | None,
    entropy: Tensor,
    shape: tuple[int, int],
    inv_t: float,
    acc: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """``[N, K]`` ``grad_out / T`` (zeros when the logprobs get no gradient) and ``[N]`` ``grad_entropy / T``
    (``None`` when the entropy gets none: its term is then skipped)."""
    device = entropy.device
    if grad_out is None:
        g_all = torch.zeros(shape, dtype=acc, device=device)
    else:
        g_all = grad_out.reshape(shape).to(acc) * inv_t
    if grad_entropy is None or entropy.numel() == 0:
        return g_all, None
    return g_all, grad_entropy.reshape(-1).to(acc) * inv_t


def _logp_to_grad(buf: Tensor, g: Tensor, ge_all: Tensor | None, entropy: Tensor, start: int, end: int) -> None:
    """In place: ``buf`` = ``log p`` of rows ``start:end`` -> their gradient w.r.t. ``z``, without the one-hot term.

    ``d logprob / dz = onehot - p`` and ``dH / dz = -p * (log p + H)`` (``H = lse - sum p z``), so
    the chunk's gradient is ``-p * (g + ge * (log p + H)) + g * onehot``; the caller adds the one-hot.
    """
    if ge_all is None:
        buf.exp_().mul_(g.neg())
        return
    p = torch.exp(buf)  # a second [c, V] temporary, only when the entropy has a gradient
    buf.add_(entropy.reshape(-1)[start:end, None]).mul_(ge_all[start:end, None]).add_(g).mul_(p).neg_()
    del p


def _check_common(temperature: Any, chunk_size: Any) -> float:
    if not is_real(temperature):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}.")
    temperature = float(temperature)
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}.")
    if not is_int(chunk_size):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}.")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}.")
    return temperature


def _check_targets(targets: Any, shape: tuple[int, ...], device: torch.device, vocab: int, source: str) -> Tensor:
    """``targets`` as a long tensor after checking its type, shape, device and range.

    Args:
        targets: the caller's token ids: one per row (``shape``) or ``K`` per row (``shape + (K,)``).
        shape: the shape of one id per row (``source``'s without its last dimension).
        device: the device they must be on.
        vocab: ids must lie in ``[0, vocab)``.
        source: name of the tensor they go with (``"logits"``, ``"hidden"``), for the messages.
    """
    if not isinstance(targets, Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError("targets must be an integer torch.Tensor of token ids.")
    if targets.dtype == torch.bool:
        raise TypeError("targets must be an integer torch.Tensor of token ids, got bool.")
    if tuple(targets.shape) != shape and tuple(targets.shape[:-1]) != shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal {source} shape without its last dimension {shape} "
            f"(one id per row), or that shape plus a last dimension (K ids per row)."
        )
    if targets.device != device:
        raise ValueError(f"targets are on {targets.device} but {source} on {device}.")
    targets = targets.long()
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"targets must lie in [0, {vocab}) (the vocabulary), got values in [{lo}, {hi}]")
    return targets


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
    temperature = _check_common(temperature, chunk_size)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor.")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V > 0, got {tuple(logits.shape)}.")
    targets = _check_targets(targets, tuple(logits.shape[:-1]), logits.device, logits.shape[-1], "logits")
    inv_t = 1.0 / temperature
    chunk_size = int(chunk_size)
    if logits.element_size() < 4:
        # Half-precision logits: float32 chunk temporaries cost 2 * chunk / N logits tensors.
        chunk_size = min(chunk_size, max(64, targets.numel() // 20))
    logprobs, entropy = _TokenLogprobs.apply(logits, targets, inv_t, chunk_size, return_entropy)
    if return_entropy:
        return logprobs, entropy
    return logprobs


def causal_lm_token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    fused_head: bool | None = None,
    sampling_support: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of the response tokens under a Hugging Face causal LM.

    The sequences are laid out as ``[left-padded prompt | right-padded response]``, ``L`` columns
    in all, the response starting at column ``response_start`` for every row. Position ids are
    ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``, so a row's first real token has position 0
    whatever its padding, as in an unpadded run.

    Two paths give the same values and gradients (tests/test_fused_logprobs.py):

    * **fused head** (the default where possible): the decoder (``model.base_model``) returns the
      last hidden states, and :func:`~lightning_offpolicy.logprobs.fused.fused_linear_token_logprobs`
      applies ``lm_head`` chunk by chunk to positions ``response_start - 1 .. L - 2`` only, so no
      ``[B, T, V]`` logits tensor is ever made (:mod:`lightning_offpolicy.logprobs.fused`: at most
      0.125x one bf16 logits tensor of temporaries). Used when
      :func:`~lightning_offpolicy.logprobs.fused.fused_head_parts` accepts the model: a
      transformers class of ``FUSED_HEAD_ARCHITECTURES`` (Llama, Qwen2/3, Mistral, ...) with a
      plain ``nn.Linear`` head (tied or not), no logit soft-capping or scaling, no hooks on the
      model or its head, not FSDP-sharded; peft LoRA models qualify, LoRA on ``lm_head`` included
      (plain LoRA: the adapters become low-rank terms of the fused head; DoRA and other variants
      fall back).
    * **logits**: the model is called with ``logits_to_keep = L - response_start + 1``
      (transformers >= 4.45), i.e. positions ``response_start - 1 .. L - 1``; the last kept
      position predicts nothing and is given a dummy target whose result is dropped (its gradient
      is zero). Keeping it keeps the logits contiguous, so :func:`token_logprobs` reads them without
      a copy (slicing ``logits[:, :-1]`` would force one).

    Args:
        model: a transformers causal LM (``model(input_ids=..., attention_mask=...,
            position_ids=..., logits_to_keep=..., use_cache=False).logits``).
        input_ids: ``[B, L]`` token ids.
        attention_mask: ``[B, L]``, 1 for real tokens, 0 for padding.
        response_start: column where the responses start, ``1 <= response_start < L``.
        temperature, chunk_size, return_entropy: as in :func:`token_logprobs`.
        fused_head: ``None`` (default) uses the fused head when the model qualifies and the
            logits path otherwise; ``False`` always takes the logits path; ``True`` requires the
            fused head (also for a class outside ``FUSED_HEAD_ARCHITECTURES`` whose structure
            fits) and raises ``ValueError`` saying why when the model does not allow it.
        sampling_support: ``[B, L - response_start, K]`` ids the engine's top-k / top-p kept at
            each response position, padded with -1 (``RolloutBatch.sampling_support``). The
            logprobs are then those of the distribution renormalized over that support,
            ``z_t / T - logsumexp_{v in S}(z_v / T)``, and the entropy that of the renormalized
            distribution: what the engine sampled from. A position whose ids are all -1 keeps the
            whole vocabulary. Costs ``K + 1`` gathered columns per position, never a ``[.., V]``
            mask (docs/off_policy_correction.md, "Sampling masks").

    Returns:
        ``[B, L - response_start]`` float32 log-probabilities of the response tokens (and the
        entropy, with its gradient, with ``return_entropy``). Columns of right padding hold the
        log-probability of the pad token; mask them with ``attention_mask[:, response_start:]``.
    """
    temperature = _check_common(temperature, chunk_size)
    if fused_head is not None and not isinstance(fused_head, bool):
        raise TypeError(f"fused_head must be None, True or False, got {fused_head!r}.")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [B, L] torch.Tensor.")
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must be a tensor of the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask)}."
        )
    seq_len = input_ids.shape[1]
    if not is_int(response_start):
        raise TypeError(f"response_start must be an int, got {type(response_start).__name__}.")
    if not 1 <= response_start < seq_len:
        raise ValueError(
            f"response_start must satisfy 1 <= response_start < L = {seq_len} (at least one prompt "
            f"column and one response column), got {response_start}."
        )
    response_start = int(response_start)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    response_ids = input_ids[:, response_start:]
    targets, full_entropy = response_ids, return_entropy
    if sampling_support is not None:
        _check_support(sampling_support, tuple(response_ids.shape))
        targets = torch.cat([response_ids.unsqueeze(-1), sampling_support.clamp(min=0)], dim=-1)
        # The full distribution's entropy is needed only where a response position kept everything.
        uncut = ~(sampling_support >= 0).any(-1) & attention_mask[:, response_start:].bool()
        full_entropy = return_entropy and bool(uncut.any())

    parts: Any = "fused_head=False"
    if fused_head is not False:
        # Imported here: fused_logprobs imports this module's argument checks.
        from lightning_offpolicy.logprobs.fused import fused_head_parts, fused_head_token_logprobs

        parts = fused_head_parts(model, force=fused_head is True)
        if fused_head is True and isinstance(parts, str):
            raise ValueError(f"fused_head=True, but the head of this model cannot be fused: {parts}.")
    if not isinstance(parts, str):
        decoder, head = parts
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"the decoder returned hidden states of shape {tuple(hidden.shape)}; expected [B, L, H] "
                f"with [B, L] = {tuple(input_ids.shape)}."
            )
        # Positions response_start - 1 .. L - 2 predict the response tokens; the slice is copied
        # once by the reshape inside ([B, T, H]: small next to the logits it replaces).
        result = fused_head_token_logprobs(
            head,
            hidden[:, response_start - 1 : -1],
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=full_entropy,
        )
        return _over_support(result, sampling_support, return_entropy, full_entropy)

    keep = seq_len - response_start + 1
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=keep,
        use_cache=False,
    )
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits.dim() != 3 or logits.shape[0] != input_ids.shape[0] or logits.shape[1] < keep:
        raise RuntimeError(
            f"model returned logits of shape {tuple(logits.shape)}; expected [B, >= {keep}, V] (logits_to_keep={keep})."
        )
    if logits.shape[1] > keep:  # a model that ignores logits_to_keep: correct, but not lean (copy)
        logits = logits[:, -keep:]
    padded = targets.new_zeros((targets.shape[0], keep, *targets.shape[2:]))
    padded[:, :-1] = targets
    res = token_logprobs(logits, padded, temperature, chunk_size, full_entropy)
    if full_entropy:
        lp, ent = res
        result: Tensor | tuple[Tensor, Tensor] = (lp[:, :-1].contiguous(), ent[:, :-1].contiguous())
    else:
        result = res[:, :-1].contiguous()
    return _over_support(result, sampling_support, return_entropy, full_entropy)


def _check_support(support: Any, response_shape: tuple[int, int]) -> None:
    """``sampling_support`` must be a ``[B, T, K]`` integer tensor of ids >= -1 (the targets' check bounds V)."""
    if not isinstance(support, Tensor) or support.is_floating_point() or support.dtype == torch.bool:
        raise TypeError("sampling_support must be an integer torch.Tensor of token ids (-1: padding).")
    if support.dim() != 3 or tuple(support.shape[:2]) != response_shape:
        raise ValueError(
            f"sampling_support must have shape {response_shape} + (K,) (the response columns), "
            f"got {tuple(support.shape)}."
        )
    if support.numel() and int(support.min()) < -1:
        raise ValueError("sampling_support holds ids below -1; -1 is the only padding value.")


def _over_support(
    result: Tensor | tuple[Tensor, Tensor], support: Tensor | None, return_entropy: bool, full_entropy: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """The sampled token's logprob (and entropy) under the distribution renormalized over ``support``.

    ``result`` holds the full-vocabulary logprobs of ``[sampled, *support]`` per position
    (``[B, T, 1 + K]``), and the full entropy when ``full_entropy``. Where a position kept a set,
    ``log p_S(t) = log p(t) - logsumexp_{v in S} log p(v)`` and ``H_S = -sum_{v in S} p_S(v) log p_S(v)``;
    where it kept everything (all -1), the full values. Built from ``where`` / ``masked_fill`` so that
    no ``-inf`` of a padding slot reaches a gradient as NaN.
    """
    if support is None:
        return result
    columns, entropy = result if full_entropy else (result, None)
    sampled = columns[..., 0]
    kept = support >= 0
    if kept.shape[-1] == 0:  # no position was cut
        if not return_entropy:
            return sampled
        return sampled, entropy if entropy is not None else torch.zeros_like(sampled)
    cut = kept.any(-1)
    candidates = columns[..., 1:].masked_fill(~kept, float("-inf"))
    # An uncut position sums one 0 (log 1): its kept mass is the whole distribution.
    first_slot = torch.zeros_like(kept)
    first_slot[..., 0] = True
    candidates = candidates.masked_fill(~cut.unsqueeze(-1) & first_slot, 0.0)
    log_mass = torch.logsumexp(candidates, dim=-1)
    logprobs = sampled - log_mass
    if not return_entropy:
        return logprobs
    log_p = torch.where(kept, candidates - log_mass.unsqueeze(-1), torch.zeros_like(candidates))
    truncated = -(torch.exp(log_p) * kept * log_p).sum(-1)
    if entropy is None:
        return logprobs, truncated
    return logprobs, torch.where(cut, truncated, entropy)
