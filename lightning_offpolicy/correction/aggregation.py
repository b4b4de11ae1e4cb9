"""Reduction of a per-token loss to a scalar: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm.

Rejected tokens leave the numerator; the denominator keeps the original response token count (or
a global count passed in, for exactness under gradient accumulation and DDP; docs/off_policy_correction.md).
"""

from __future__ import annotations

import torch

from lightning_offpolicy.correction.loss_config import PolicyLossConfig
from lightning_offpolicy.correction.ratios import masked


def aggregate(
    per_token: torch.Tensor,
    kept_mask: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    token_count: float | torch.Tensor | None = None,
    sequence_count: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        per_token: ``[B, T]`` loss per token (padding may hold anything).
        kept_mask: ``[B, T]`` tokens that enter the numerator.
        response_mask: ``[B, T]`` response tokens: the denominator counts these, rejected or not.
        mode: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``.
        token_count: denominator of ``token-mean``; defaults to this batch's response tokens. Pass
            the global count (divided by the number of gradient-averaging ranks) for exactness.
        sequence_count: denominator of the ``seq-mean-*`` modes; defaults to this batch's
            sequences with at least one response token.
        norm_constant: per-sequence divisor of ``seq-mean-token-sum-norm`` (default ``T``).
    """
    numerator = masked(per_token, kept_mask)
    response = response_mask.to(numerator.dtype)
    if mode == "token-mean":
        count = response.sum() if token_count is None else _given_count(token_count, numerator)
        return numerator.sum() / count.clamp(min=_MIN_COUNT if token_count is not None else 1.0)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        if mode == "seq-mean-token-mean":
            per_seq = numerator.sum(dim=-1) / response.sum(dim=-1).clamp(min=1.0)
        else:
            per_seq = numerator.sum(dim=-1) / float(norm_constant or per_token.shape[-1])
        if sequence_count is None:
            count = (response.sum(dim=-1) > 0).to(numerator.dtype).sum().clamp(min=1.0)
        else:
            count = _given_count(sequence_count, numerator).clamp(min=_MIN_COUNT)
        return per_seq.sum() / count
    raise ValueError(f"aggregation mode {mode!r} is not known.")


# A count passed in may be a global count divided by the number of ranks (below 1); only 0 is guarded.
_MIN_COUNT = 1e-12


def _given_count(count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device)


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_cfg: PolicyLossConfig,
    token_count: float | torch.Tensor | None = None,
    sequence_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The entropy term (before ``-entropy_coef``): ``entropy`` aggregated like the loss over the response."""
    valid = response_mask.bool()
    return aggregate(
        entropy, valid, valid, mode=loss_cfg.aggregation, token_count=token_count,
        sequence_count=sequence_count, norm_constant=loss_cfg.loss_norm_constant,
    )  # fmt: skip
