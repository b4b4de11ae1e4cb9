"""What both chunked autograd Functions share: a chunk's softmax sum and entropy, the softmax gradient,
and the dtype they accumulate in.

For ``z`` the logits of one row divided by the temperature, ``p = softmax(z)`` and ``H`` its entropy,
``d log p_t / dz = onehot(t) - p`` and ``dH / dz = -p * (log p + H)``. :func:`logp_to_grad` turns a
chunk of ``log p`` into that gradient in place (without the one-hot term, which the caller scatters),
so the logits path (:mod:`~lightning_offpolicy.logprobs.chunked`) and the fused head
(:mod:`~lightning_offpolicy.logprobs.fused`) differentiate the same way. docs/logprobs.md explains
the memory this saves.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["acc_dtype", "ids_per_row", "logp_to_grad", "scaled_grads"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the values are computed in: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ids_per_row(targets: Tensor, source: Tensor) -> int:
    """``K``: targets of ``source``'s shape without its last dimension hold one id per row, else their last size."""
    return targets.shape[-1] if targets.dim() == source.dim() else 1


def exp_sum_and_entropy(shifted: Tensor, want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Per row of a chunk of max-shifted logits ``d = z - max z``: ``s = sum exp(d)`` and the entropy.

    Without the entropy ``shifted`` is overwritten by ``exp(d)`` (no second ``[c, V]`` temporary);
    with it, one temporary ``exp(d)`` is made and ``sum_v exp(d_v) d_v`` is a batched dot product
    (no third).

    Args:
        shifted: ``[c, V]`` logits minus their row maximum, in the accumulation dtype.
        want_entropy: Also return ``H = log s - sum(exp(d) d) / s`` (``= lse - sum p z``).

    Returns:
        ``(s, entropy)``, each ``[c]``; ``entropy`` is ``None`` unless wanted.
    """
    if not want_entropy:
        return shifted.exp_().sum(dim=-1), None
    e = torch.exp(shifted)
    s = e.sum(dim=-1)
    ed = torch.bmm(e.unsqueeze(1), shifted.unsqueeze(2)).reshape(-1)
    del e
    return s, s.log() - ed / s


def scaled_grads(
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


def logp_to_grad(buf: Tensor, g: Tensor, ge_all: Tensor | None, entropy: Tensor, start: int, end: int) -> None:
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
