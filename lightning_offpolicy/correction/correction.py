"""``compute_correction``: importance weights and rejection masks from pi_prox vs pi_rollout.

Order of application, and the token set each step reads:

1. ``log_rho_t = prox_t - rollout_t`` on response tokens (0 at padding, whatever padding holds).
2. Token-level masks (IcePop ``token_mask``; ``kl_reject`` at level ``"token"``; M2PO's
   ``m2po_mask``, which ranks the response tokens of the whole batch) each act on the response
   tokens. Their survivors are the *token-kept* set.
3. Sequence statistics are taken over the token-kept set: ``S_i = sum_t log_rho_t``, ``n_i``,
   the geometric mean ``exp(S_i / n_i)``, the outlier test and the sequence KL statistics. Tokens
   already removed do not condemn their sequence a second time.
4. Sequence masks (``geo_mask``, ``product_mask``, ``outlier_token_veto``, sequence
   ``kl_reject``) drop whole sequences. ``mask = response_mask * token_keep * seq_keep``.
5. TIS weights: token ``clamp(rho_t, lo, C)``, or sequence ``clamp(exp(S_i), lo, C)`` broadcast
   over the sequence; detached; 1.0 outside the response.
6. Optional batch normalisation: weights divided by their mean over the kept tokens (token level)
   or kept sequences (sequence level), summed over all ranks when ``torch.distributed`` runs;
   every response token (kept or not) is divided by the same mean.

Rows with no valid token get ``S_i = 0``, are never rejected, never produce NaN and are excluded
from every per-sequence count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_offpolicy.correction.checks import check_response_values
from lightning_offpolicy.correction.config import OffPolicyCorrectionConfig
from lightning_offpolicy.correction.distributed import global_sum
from lightning_offpolicy.correction.masks import (
    geometric_mask,
    kl_reject_sequence_mask,
    kl_reject_token_mask,
    m2po_mask,
    outlier_veto_mask,
    product_mask,
    token_ratio_mask,
)
from lightning_offpolicy.correction.ratios import (
    finite_logprobs,
    log_ratio,
    safe_exp,
    sequence_count,
    sequence_sum,
)


@dataclass
class CorrectionStats:
    """Detached per-token / per-sequence quantities the metrics accumulate.

    Attributes:
        response_mask: ``[B, T]`` bool, the response tokens.
        log_rho: ``[B, T]`` float32 ``prox - rollout`` on response tokens, 0 elsewhere.
        seq_log_rho: ``[B]`` sum of ``log_rho`` over each sequence's response tokens.
        seq_tokens: ``[B]`` number of response tokens per sequence.
        seq_valid: ``[B]`` bool, sequences with at least one response token.
        kept: ``[B, T]`` bool, response tokens that survive every mask.
        weights: ``[B, T]`` applied IS weights (1.0 where no weight applies).
        weight_clipped: ``[B, T]`` bool, response tokens whose weight was truncated.
        weight_level: ``"token"``, ``"sequence"`` or ``None``.
        token_rejected: per mask name, ``[B, T]`` bool of the response tokens that mask removed.
        seq_rejected: per mask name, ``[B]`` bool of the valid sequences that mask touched.
    """

    response_mask: torch.Tensor
    log_rho: torch.Tensor
    seq_log_rho: torch.Tensor
    seq_tokens: torch.Tensor
    seq_valid: torch.Tensor
    kept: torch.Tensor
    weights: torch.Tensor
    weight_clipped: torch.Tensor
    weight_level: str | None
    token_rejected: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_rejected: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class CorrectionOutput:
    """Result of :func:`compute_correction`.

    Attributes:
        weights: ``[B, T]`` float32, detached IS weights (1.0 where no weight applies).
        mask: ``[B, T]`` float32, ``response_mask`` times every rejection mask.
        stats: :class:`CorrectionStats` for the metrics; ``None`` in a slice of rows built for
            :func:`~lightning_offpolicy.correction.policy_loss`, which does not read it.
        config: the configuration that produced it (the loss reads its objective from here).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    stats: CorrectionStats | None
    config: OffPolicyCorrectionConfig


def compute_correction(
    prox_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: OffPolicyCorrectionConfig | None = None,
) -> CorrectionOutput:
    """Importance weights, rejection masks and statistics for one batch.

    Args:
        prox_logprobs: ``[B, T]`` trainer logprobs of the sampled tokens at the start of the step
            (``pi_prox``); ``None`` in bypass mode (``pi_prox := pi_rollout``), except with a
            rejection mask: then the current policy's logprobs (``pi_theta``, detached), which the
            masks compare with ``pi_rollout`` as verl's bypass mode does
            (``cfg.ratio_numerator(prox, logprobs)`` picks the right one).
        rollout_logprobs: ``[B, T]`` engine logprobs of the same tokens (``pi_rollout``).
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding.
        cfg: the correction; ``None`` means :meth:`OffPolicyCorrectionConfig.disabled`.

    Returns:
        :class:`CorrectionOutput`; nothing in it carries gradient.

    Raises:
        ValueError: A shape differs from ``response_mask``'s, or a logprob the correction reads is
            NaN at a response token (the message names the tensor and the first ``(row, token)``; in
            bypass mode no logprob is read here: ``policy_loss`` checks ``rollout_logprobs``).
            Padding may hold anything; +-inf at a response token is accepted (it counts as
            ``-INFINITE_LOG_RATIO`` = -1e6: clamped weights, rejected by every mask, finite metrics).

    Note:
        With ``normalize_weights`` under ``torch.distributed`` this is a collective: every rank
        must call it for the same batch index.
    """
    cfg = cfg if cfg is not None else OffPolicyCorrectionConfig.disabled()
    check_inputs(prox_logprobs, rollout_logprobs, response_mask, cfg)
    with torch.no_grad():
        valid = response_mask.bool()
        if prox_logprobs is None or (cfg.bypass_mode and not cfg.masks_read_current_policy):
            log_rho = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        else:
            log_rho = log_ratio(prox_logprobs.detach(), rollout_logprobs.detach(), valid).float()
            # NaN / +-inf at a response token of either input shows in the sum of log_rho (padding is
            # 0 there): one read and one host sync, before any collective; the inputs are searched
            # only then.
            if not bool(torch.isfinite(log_rho.sum())):
                check_response_values(
                    "compute_correction",
                    response_mask,
                    [("prox_logprobs", prox_logprobs, False), ("rollout_logprobs", rollout_logprobs, False)],
                )
                # No NaN: a logprob of -inf at a response token, counted as -INFINITE_LOG_RATIO.
                prox, rollout = finite_logprobs(prox_logprobs.detach()), finite_logprobs(rollout_logprobs.detach())
                log_rho = log_ratio(prox, rollout, valid).float()

        return correct_log_ratio(log_rho, valid, cfg)


def correct_log_ratio(log_rho: torch.Tensor, valid: torch.Tensor, cfg: OffPolicyCorrectionConfig) -> CorrectionOutput:
    """Steps 2-6 of :func:`compute_correction` from checked inputs, with no host sync.

    Args:
        log_rho: ``[B, T]`` float32 ``prox - rollout``, finite, 0 outside the response.
        valid: ``[B, T]`` bool response mask.
        cfg: the correction.

    The fused step (:mod:`~lightning_offpolicy.correction.fused`) compiles this same function,
    so the two paths cannot drift apart.
    """
    token_rejected: dict[str, torch.Tensor] = {}
    token_keep = valid.clone()
    if cfg.token_mask:
        keep = token_ratio_mask(log_rho, valid, cfg.token_mask_low, cfg.token_mask_high)
        token_rejected["token_mask"] = valid & ~keep
        token_keep &= keep
    if cfg.kl_reject is not None and cfg.kl_reject_level == "token":
        keep = kl_reject_token_mask(log_rho, valid, cfg.kl_reject, cfg.kl_reject_threshold)
        token_rejected["kl_reject"] = valid & ~keep
        token_keep &= keep
    if cfg.m2po_mask:
        keep = m2po_mask(log_rho, valid, cfg.m2po_threshold)
        token_rejected["m2po_mask"] = valid & ~keep
        token_keep &= keep

    kept_log_rho = sequence_sum(log_rho, token_keep)
    kept_tokens = sequence_count(token_keep)
    seq_decisions: dict[str, torch.Tensor] = {}
    if cfg.geo_mask:
        seq_decisions["geo_mask"] = geometric_mask(kept_log_rho, kept_tokens, cfg.geo_mask_low, cfg.geo_mask_high)
    if cfg.product_mask:
        seq_decisions["product_mask"] = product_mask(kept_log_rho, cfg.product_mask_low, cfg.product_mask_high)
    if cfg.outlier_token_veto:
        seq_decisions["outlier_veto"] = outlier_veto_mask(log_rho, token_keep, cfg.outlier_low, cfg.outlier_high)
    if cfg.kl_reject is not None and cfg.kl_reject_level != "token":
        seq_decisions["kl_reject"] = kl_reject_sequence_mask(
            log_rho, token_keep, cfg.kl_reject, cfg.kl_reject_level, cfg.kl_reject_threshold
        )
    seq_keep = torch.ones(valid.shape[:-1], dtype=torch.bool, device=valid.device)
    for name, keep in seq_decisions.items():
        # A sequence mask only removes what is still there: rejection counts read the token-kept set.
        token_rejected[name] = token_keep & ~keep.unsqueeze(-1)
        seq_keep &= keep
    kept = token_keep & seq_keep.unsqueeze(-1)

    weights, clipped = _tis_weights(cfg, log_rho, kept_log_rho, valid)
    if cfg.normalize_weights and cfg.tis_level is not None:
        weights = _normalize(weights, kept, valid, cfg.tis_level)

    seq_valid = valid.any(dim=-1)
    stats = CorrectionStats(
        response_mask=valid,
        log_rho=log_rho,
        seq_log_rho=sequence_sum(log_rho, valid),
        seq_tokens=sequence_count(valid),
        seq_valid=seq_valid,
        kept=kept,
        weights=weights,
        weight_clipped=clipped,
        weight_level=cfg.tis_level,
        token_rejected=token_rejected,
        seq_rejected={name: seq_valid & rejected.any(dim=-1) for name, rejected in token_rejected.items()},
    )
    return CorrectionOutput(weights=weights, mask=kept.float(), stats=stats, config=cfg)


def _tis_weights(
    cfg: OffPolicyCorrectionConfig, log_rho: torch.Tensor, kept_log_rho: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ones = torch.ones(valid.shape, dtype=torch.float32, device=valid.device)
    if cfg.tis_level is None:
        return ones, torch.zeros_like(valid)
    log_w = log_rho if cfg.tis_level == "token" else kept_log_rho.unsqueeze(-1).expand_as(log_rho)
    raw = safe_exp(log_w)
    truncated = raw.clamp(min=cfg.tis_clip_low, max=cfg.tis_clip_high)
    clipped = valid & (truncated != raw)
    return torch.where(valid, truncated, ones), clipped


def _normalize(weights: torch.Tensor, kept: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    kept64 = kept.double()
    if level == "token":
        totals = torch.stack([(weights.double() * kept64).sum(), kept64.sum()])
    else:
        # A sequence weight is constant over its tokens: its token mean is the sequence weight.
        per_seq_tokens = kept64.sum(dim=-1)
        seq_weight = (weights.double() * kept64).sum(dim=-1) / per_seq_tokens.clamp(min=1.0)
        totals = torch.stack([seq_weight.sum(), (per_seq_tokens > 0).double().sum()])
    totals = global_sum(totals)
    if totals[1] <= 0 or totals[0] <= 0:
        return weights
    mean = (totals[0] / totals[1]).to(weights.dtype)
    return torch.where(valid, weights / mean, torch.ones_like(weights))


def check_inputs(
    prox_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    cfg: OffPolicyCorrectionConfig,
) -> None:
    """Shape and presence checks of :func:`compute_correction`'s inputs (no host sync), shared with the fused step.

    Raises:
        ValueError: ``rollout_logprobs`` is missing, a shape does not match ``response_mask``, or
            ``cfg`` needs ``prox_logprobs`` and it is missing.
    """
    if rollout_logprobs is None:
        raise ValueError(
            "compute_correction needs rollout_logprobs (the engine's per-token logprobs); turn on "
            "logprob return in the rollout engine (vLLM: SamplingParams(logprobs=0))."
        )
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T]; got shape {tuple(response_mask.shape)}.")
    if rollout_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"rollout_logprobs shape {tuple(rollout_logprobs.shape)} != response_mask shape "
            f"{tuple(response_mask.shape)}."
        )
    if prox_logprobs is None:
        if not cfg.bypass_mode:
            raise ValueError(
                "compute_correction got prox_logprobs=None but bypass_mode=False; run the proximal "
                "forward pass, or use OffPolicyCorrectionConfig.bypass()."
            )
        if cfg.masks_read_current_policy:
            raise ValueError(
                f"compute_correction: in bypass mode the rejection masks ({', '.join(cfg.mask_names)}) compare "
                "the current policy with pi_rollout; pass the current policy's logprobs, detached, as "
                "prox_logprobs (cfg.ratio_numerator(prox, logprobs) gives them), per micro-batch after its forward."
            )
    elif prox_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"prox_logprobs shape {tuple(prox_logprobs.shape)} != response_mask shape {tuple(response_mask.shape)}."
        )
