"""Policy losses over the three policies, with off-policy weights and masks, and their aggregation.

Per token ``t`` (``A`` the advantage, ``w`` the detached IS weight of :func:`compute_correction`,
``sg`` stop-gradient, ratios from log space clamped to [-20, 20]):

* decoupled PPO: ``r = pi_theta / pi_prox``; ``L = -w * min(r A, clip(r, 1-eps_low, 1+eps_high) A)``;
  dual clip for ``A < 0``: ``L = min(L, -w * c * A)``;
* bypass: ``pi_prox := pi_rollout`` (the correction's ``bypass_mode``), so PPO clips against the engine;
* GSPO: the token ratio is replaced by the length-normalised sequence ratio
  ``exp(mean_t log r_t)``, with the gradient of each token's own ``log pi_theta``;
* SAPO: the hard clip is replaced by the soft gate ``(4 / tau) * sigmoid(tau (r - 1))``;
* DPPO (``loss_type="dppo_tv"`` / ``"dppo_kl"``): no clip; ``L = -w * A * r`` except on the tokens
  whose probability moved past a binary TV / KL bound in the direction of their advantage, which
  are masked (:mod:`~lightning_offpolicy.correction.dppo`);
* pure IS: ``L = -sg(clip(pi_theta / pi_rollout, lo, C)) * A * log pi_theta`` per token or per
  sequence (off-policy REINFORCE, no PPO clip);
* CISPO: ``L = -sg(clip(pi_theta / pi_anchor, lo, hi)) * A * log pi_theta``, anchor pi_rollout
  or pi_prox (with pi_prox, times the TIS weight ``w``);
* REINFORCE: ``L = -A * log pi_theta`` per token, no weight (with bypass-mode rejection masks:
  verl's ``bypass_pg_geo_rs``).

OPSM (``opsm_mask``): after the surrogate, the tokens with ``A < 0`` of every sequence whose mean
``log pi_ref - log pi_theta`` over its response tokens exceeds ``opsm_threshold`` leave the numerator too
(:func:`~lightning_offpolicy.correction.masks.off_policy_sequence_mask`).

Aggregation (:mod:`~lightning_offpolicy.correction.aggregation`): rejected tokens leave the numerator,
the denominator keeps the original response token count (or a global count passed in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_offpolicy.correction.aggregation import aggregate, entropy_bonus
from lightning_offpolicy.correction.checks import check_response_values
from lightning_offpolicy.correction.config import check_compatible
from lightning_offpolicy.correction.correction import CorrectionOutput
from lightning_offpolicy.correction.dppo import dppo_surrogate
from lightning_offpolicy.correction.kl import kl_estimate
from lightning_offpolicy.correction.loss_config import PolicyLossConfig
from lightning_offpolicy.correction.masks import off_policy_sequence_mask
from lightning_offpolicy.correction.ratios import finite_logprobs, log_ratio, masked
from lightning_offpolicy.correction.surrogates import current_policy_weighted, ppo_surrogate
from lightning_offpolicy.correction.validation import DPPO_LOSS_TYPES

__all__ = ["PolicyLossInfo", "aggregate", "constants_of_the_step", "entropy_bonus", "policy_loss"]


@dataclass
class PolicyLossInfo:
    """Detached quantities of one :func:`policy_loss` call, as sums (so they add up exactly).

    Attributes:
        policy_loss: the aggregated policy-gradient term.
        rollout_kl: the aggregated rollout KL term before its coefficient (0 when disabled).
        ref_kl: the aggregated reference KL term before its coefficient (0 when disabled).
        kept_tokens: number of tokens that reached the numerator.
        clipped_tokens: kept tokens where the clip (PPO ratio or current-policy weight) was active,
            or that DPPO's trust region masked.
        dual_clipped_tokens: kept tokens where the dual clip was active, or where DPPO's
            ``dppo_ratio_cap`` truncated the ratio.
        approx_kl_sum: sum over kept tokens of ``(r - 1) - log r``, ``r = pi_theta / pi_prox``.
        rollout_kl_sum: sum over response tokens of the rollout KL estimator (reported even when
            its coefficient is 0, whenever rollout logprobs are given).
        response_tokens: number of response tokens.
        entropy: the aggregated entropy term before its coefficient (``None`` when disabled).
        opsm_rejected_tokens: response tokens the OPSM mask removed (``None`` without it).
        opsm_rejected_sequences: sequences in which it removed a token (``None`` without it).
        response_sequences: sequences with at least one response token (``None`` without OPSM).
    """

    policy_loss: torch.Tensor
    rollout_kl: torch.Tensor
    ref_kl: torch.Tensor
    kept_tokens: torch.Tensor
    clipped_tokens: torch.Tensor
    dual_clipped_tokens: torch.Tensor
    approx_kl_sum: torch.Tensor
    rollout_kl_sum: torch.Tensor
    response_tokens: torch.Tensor
    entropy: torch.Tensor | None = None
    opsm_rejected_tokens: torch.Tensor | None = None
    opsm_rejected_sequences: torch.Tensor | None = None
    response_sequences: torch.Tensor | None = None


def policy_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_cfg: PolicyLossConfig | None = None,
    correction: CorrectionOutput | None = None,
    ref_logprobs: torch.Tensor | None = None,
    token_count: float | torch.Tensor | None = None,
    sequence_count: float | torch.Tensor | None = None,
    *,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossInfo]:
    """Total loss ``policy + rollout_kl_coef * rollout_kl + ref_kl_coef * ref_kl - entropy_coef * H`` and its parts.

    The correction enters as one :class:`~lightning_offpolicy.correction.CorrectionOutput`: its
    ``weights``, its ``mask`` and, from its ``config``, the objective. A trainer that slices one
    :func:`compute_correction` output per micro-batch passes
    ``CorrectionOutput(weights[rows], mask[rows], None, config)``.

    Args:
        logprobs: ``[B, T]`` logprobs of the sampled tokens under ``pi_theta`` (with gradient).
        prox_logprobs: ``[B, T]`` under ``pi_prox``; ignored in bypass mode. Like
            ``rollout_logprobs`` and ``ref_logprobs`` it is a constant of the step: a graph it
            carries is detached (:func:`constants_of_the_step`).
        rollout_logprobs: ``[B, T]`` under ``pi_rollout``; needed by bypass, pure IS, CISPO on the
            rollout and the rollout KL loss.
        advantages: ``[B, T]`` per-token advantages, or ``[B]`` per-sequence (broadcast).
        response_mask: ``[B, T]`` 1 on response tokens.
        loss_cfg: the surrogate and aggregation; defaults to :class:`PolicyLossConfig`.
        correction: this batch's detached IS ``weights``, its ``mask`` (``response_mask`` times
            every rejection mask: rejected tokens leave the numerator, not the denominator) and the
            ``config`` whose objective, bypass mode and OPSM mask the loss applies; ``stats`` is
            not read. ``None``: plain decoupled PPO without weights or masks.
        ref_logprobs: ``[B, T]`` under the reference policy, needed when ``ref_kl_coef > 0``.
        token_count: global token denominator (see :func:`aggregate`).
        sequence_count: global sequence denominator (see :func:`aggregate`).
        entropy: ``[B, T]`` per-token entropy of ``pi_theta`` (with gradient), needed when
            ``loss_cfg.entropy_coef > 0`` (``causal_lm_token_logprobs(..., return_entropy=True)``).

    Returns:
        The total loss (with gradient) and its detached parts, as sums (:class:`PolicyLossInfo`).

    Raises:
        ValueError: a ``loss_cfg.loss_type`` the correction's objective replaces
            (:class:`~lightning_offpolicy.correction.CorrectionConfigError`); a shape differs from
            ``response_mask``'s (``advantages``: ``[B]`` or ``[B, T]``; ``correction``: computed for
            this batch), or, at a response token, NaN in a logprob tensor the loss reads, or NaN /
            +-inf in ``logprobs`` or ``advantages`` (the message names the tensor and the first
            ``(row, token)``). Padding may hold anything; +-inf in ``prox`` / ``rollout`` /
            ``ref_logprobs`` gives the clamped loss.
    """
    loss_cfg = loss_cfg if loss_cfg is not None else PolicyLossConfig()
    weights = mask = None
    how = LossObjective()
    if correction is not None:
        check_compatible(correction.config, loss_cfg)
        if correction.mask.shape != response_mask.shape or correction.weights.shape != response_mask.shape:
            shape = correction.mask.shape if correction.mask.shape != response_mask.shape else correction.weights.shape
            raise ValueError(
                f"policy_loss: correction was computed for a batch of shape {tuple(shape)}, "
                f"response_mask is {tuple(response_mask.shape)} (it would be broadcast silently): pass the "
                "compute_correction output of this batch."
            )
        weights, mask = correction.weights, correction.mask
        how = LossObjective(**correction.config.policy_loss_kwargs())
    prox_logprobs, rollout_logprobs, ref_logprobs = constants_of_the_step(prox_logprobs, rollout_logprobs, ref_logprobs)
    advantages, read = checked_loss_inputs(
        logprobs, prox_logprobs, rollout_logprobs, advantages, response_mask, loss_cfg, how, ref_logprobs,
        weights, mask, entropy,
    )  # fmt: skip

    def terms() -> tuple[torch.Tensor, PolicyLossInfo]:
        return policy_loss_terms(
            logprobs, prox_logprobs, rollout_logprobs, advantages, response_mask, loss_cfg, weights, mask, how,
            ref_logprobs, token_count, sequence_count, entropy,
        )  # fmt: skip

    total, info = terms()
    # NaN at a response token of any input reaches the loss or a statistic, so checking those few
    # scalars (one host sync) replaces a pass over every input; the inputs are searched only then.
    if not _all_finite(total, info):
        infinite = check_response_values("policy_loss", response_mask, read)
        if infinite:  # rare: a logprob of -inf at a response token counts as -INFINITE_LOG_RATIO
            rollout_logprobs = finite_logprobs(rollout_logprobs) if "rollout_logprobs" in infinite else rollout_logprobs
            prox_logprobs = finite_logprobs(prox_logprobs) if "prox_logprobs" in infinite else prox_logprobs
            ref_logprobs = finite_logprobs(ref_logprobs) if "ref_logprobs" in infinite else ref_logprobs
            total, info = terms()
    return total, info


def constants_of_the_step(*logprobs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``pi_prox``, ``pi_rollout`` and the reference logprobs detached: constants of the step.

    Passed with a graph (``prox_logprobs`` being pi_theta's own forward, not detached), the PPO
    ratio would be 1 with a zero gradient, or the gradient would flow into them; only ``logprobs``
    (pi_theta) is differentiated.
    """
    return tuple(None if t is None else t.detach() for t in logprobs)


def checked_loss_inputs(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_cfg: PolicyLossConfig,
    how: LossObjective,
    ref_logprobs: torch.Tensor | None,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor, bool]]]:
    """Shape and presence checks of :func:`policy_loss`'s inputs (no host sync).

    Returns the advantages broadcast to ``[B, T]`` and the ``(name, tensor, finite_required)`` list
    of every tensor the loss reads, for :func:`~lightning_offpolicy.correction.checks.check_response_values`.
    """
    bypass = how.bypass_mode
    _require(logprobs, "logprobs", response_mask)
    if advantages.dim() == 1 and advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"policy_loss: advantages has shape {tuple(advantages.shape)}: one per sequence needs "
            f"{response_mask.shape[0]} values (response_mask is {tuple(response_mask.shape)}), or pass [B, T]."
        )
    if advantages.dim() != 1:
        _require(advantages, "advantages", response_mask)
    for name, tensor in (("weights", weights), ("mask", mask)):
        if tensor is not None:
            _require(tensor, name, response_mask)
    # Every logprob tensor the loss or its statistics read (prox: not in bypass; ref: with its KL term).
    read = [("logprobs", logprobs, True), ("advantages", advantages, True)]
    for name, tensor, used in (
        ("rollout_logprobs", rollout_logprobs, rollout_logprobs is not None),
        ("prox_logprobs", prox_logprobs, prox_logprobs is not None and not bypass),
        ("ref_logprobs", ref_logprobs, ref_logprobs is not None and loss_cfg.ref_kl_coef > 0),
    ):
        if used:
            _require(tensor, name, response_mask)
            read.append((name, tensor, False))  # +-inf allowed: the log ratio is clamped
    anchor_logprobs = rollout_logprobs if bypass else prox_logprobs
    if how.reads_rollout or loss_cfg.rollout_kl_coef > 0:
        _require(rollout_logprobs, "rollout_logprobs", response_mask, hint=_ROLLOUT_HINT)
    if how.objective == "ppo" or (how.objective == "cispo" and how.anchor == "prox"):
        _require(anchor_logprobs, "rollout_logprobs" if bypass else "prox_logprobs", response_mask)
    if how.opsm_mask:
        name = how.opsm_reference_name
        _require(rollout_logprobs if name == "rollout_logprobs" else prox_logprobs, name, response_mask)
    if loss_cfg.entropy_coef > 0:
        _require(entropy, "entropy", response_mask, hint=_ENTROPY_HINT)
        read.append(("entropy", entropy, True))
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    return advantages, read


@dataclass(frozen=True)
class LossObjective:
    """The objective settings :func:`policy_loss` reads (``OffPolicyCorrectionConfig``'s names)."""

    objective: str = "ppo"
    bypass_mode: bool = False
    anchor: str = "rollout"
    objective_level: str = "token"
    is_clip_low: float | None = None
    is_clip_high: float | None = None
    opsm_mask: bool = False
    opsm_threshold: float = 0.5
    opsm_reference: str = "rollout"

    @property
    def opsm_reference_name(self) -> str:
        """The tensor OPSM compares ``pi_theta`` with (in bypass mode ``pi_prox`` is ``pi_rollout``)."""
        return "rollout_logprobs" if self.opsm_reference == "rollout" or self.bypass_mode else "prox_logprobs"

    @property
    def reads_rollout(self) -> bool:
        """Whether the surrogate itself divides by ``pi_rollout``."""
        return (
            self.bypass_mode or self.objective == "pure_is" or (self.objective == "cispo" and self.anchor == "rollout")
        )


def loss_scalars(total: torch.Tensor, info: PolicyLossInfo) -> list[torch.Tensor]:
    """The loss and the sums of ``info`` that NaN or +-inf at a response token of any input reaches."""
    return [total.detach(), info.policy_loss, info.rollout_kl, info.ref_kl, info.approx_kl_sum, info.rollout_kl_sum]


def _all_finite(total: torch.Tensor, info: PolicyLossInfo) -> bool:
    return bool(torch.isfinite(torch.stack([s.to(torch.float64) for s in loss_scalars(total, info)])).all())


def policy_loss_terms(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_cfg: PolicyLossConfig,
    weights: torch.Tensor | None,
    mask: torch.Tensor | None,
    how: LossObjective,
    ref_logprobs: torch.Tensor | None,
    token_count: float | torch.Tensor | None,
    sequence_count: float | torch.Tensor | None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossInfo]:
    """:func:`policy_loss` once its arguments are checked (``entropy``: ``None`` leaves its term out)."""
    objective = how.objective
    valid = response_mask.bool()
    kept = valid if mask is None else valid & mask.bool()
    weights = torch.ones_like(logprobs, dtype=torch.float32) if weights is None else weights
    adv = masked(advantages.detach().float(), valid)
    anchor = rollout_logprobs if how.bypass_mode else prox_logprobs

    if objective == "ppo" and loss_cfg.loss_type in DPPO_LOSS_TYPES:
        per_token, clipped, dual = dppo_surrogate(
            logprobs, anchor, adv, valid, "tv" if loss_cfg.loss_type == "dppo_tv" else "kl",
            loss_cfg.dppo_delta_low, loss_cfg.dppo_delta_high, loss_cfg.dppo_ratio_cap,
        )  # fmt: skip
    elif objective == "ppo":
        per_token, clipped, dual = ppo_surrogate(logprobs, anchor, adv, valid, kept, loss_cfg)
    elif objective == "reinforce":
        per_token = -adv * masked(logprobs, valid)
        clipped = dual = torch.zeros_like(valid)
    else:
        base = rollout_logprobs if (objective == "pure_is" or how.anchor == "rollout") else prox_logprobs
        level = how.objective_level if objective == "pure_is" else "token"
        per_token, clipped = current_policy_weighted(
            logprobs, base, adv, valid, kept, level, how.is_clip_low, how.is_clip_high
        )
        dual = torch.zeros_like(valid)
    per_token = per_token * weights
    opsm_rejected = None
    if how.opsm_mask:
        # Decided here, not in compute_correction: it reads pi_theta (at this call) and the advantages.
        # After the surrogate, as the peers multiply their loss by it: a GSPO or sequence IS ratio
        # still spans the tokens the correction kept.
        reference = rollout_logprobs if how.opsm_reference_name == "rollout_logprobs" else prox_logprobs
        opsm_rejected = valid & ~off_policy_sequence_mask(logprobs, reference, adv, valid, how.opsm_threshold)
        kept = kept & ~opsm_rejected

    aggregate_kwargs = dict(
        mode=loss_cfg.aggregation,
        token_count=token_count,
        sequence_count=sequence_count,
        norm_constant=loss_cfg.loss_norm_constant,
    )
    pg = aggregate(per_token, kept, valid, **aggregate_kwargs)
    total = pg
    zero = pg.new_zeros(())
    rollout_kl = ref_kl = zero
    if loss_cfg.rollout_kl_coef > 0:
        rollout_kl = aggregate(
            kl_estimate(logprobs, rollout_logprobs, valid, loss_cfg.rollout_kl_estimator),
            valid,
            valid,
            **aggregate_kwargs,
        )
        total = total + loss_cfg.rollout_kl_coef * rollout_kl
    if loss_cfg.ref_kl_coef > 0:
        _require(ref_logprobs, "ref_logprobs", response_mask, hint="compute the reference forward pass")
        ref_kl = aggregate(
            kl_estimate(logprobs, ref_logprobs, valid, loss_cfg.ref_kl_estimator),
            valid,
            valid,
            **aggregate_kwargs,
        )
        total = total + loss_cfg.ref_kl_coef * ref_kl
    entropy_term = None
    if entropy is not None and loss_cfg.entropy_coef > 0:
        entropy_term = entropy_bonus(entropy, valid, loss_cfg, token_count, sequence_count)
        total = total - loss_cfg.entropy_coef * entropy_term

    with torch.no_grad():
        if anchor is not None:
            log_r = log_ratio(logprobs.detach(), anchor, kept).clamp(-20, 20)
            approx_kl = masked(torch.expm1(log_r) - log_r, kept).double().sum()
        else:
            approx_kl = zero.detach()
        if rollout_logprobs is not None:
            rollout_kl_sum = (
                kl_estimate(logprobs.detach(), rollout_logprobs, valid, loss_cfg.rollout_kl_estimator).double().sum()
            )
        else:
            rollout_kl_sum = zero.detach()
        info = PolicyLossInfo(
            policy_loss=pg.detach(),
            rollout_kl=rollout_kl.detach(),
            ref_kl=ref_kl.detach(),
            kept_tokens=kept.sum().to(torch.float64),
            clipped_tokens=(clipped & kept).sum().to(torch.float64),
            dual_clipped_tokens=(dual & kept).sum().to(torch.float64),
            approx_kl_sum=approx_kl.to(torch.float64),
            rollout_kl_sum=rollout_kl_sum.to(torch.float64),
            response_tokens=valid.sum().to(torch.float64),
            entropy=None if entropy_term is None else entropy_term.detach(),
        )
        if opsm_rejected is not None:
            info.opsm_rejected_tokens = opsm_rejected.sum().to(torch.float64)
            info.opsm_rejected_sequences = opsm_rejected.any(dim=-1).sum().to(torch.float64)
            info.response_sequences = valid.any(dim=-1).sum().to(torch.float64)
    return total, info


_ROLLOUT_HINT = "turn on logprob return in the rollout engine (vLLM: SamplingParams(logprobs=0))"
_ENTROPY_HINT = "entropy_coef > 0 needs the per-token entropy with its gradient (return_entropy=True in the forward)"


def _require(tensor: torch.Tensor | None, name: str, response_mask: torch.Tensor, hint: str | None = None) -> None:
    if tensor is None:
        raise ValueError(f"policy_loss needs {name} for this configuration" + (f"; {hint}." if hint else "."))
    if tensor.shape != response_mask.shape:
        raise ValueError(
            f"policy_loss: {name} has shape {tuple(tensor.shape)}, response_mask {tuple(response_mask.shape)}."
        )
