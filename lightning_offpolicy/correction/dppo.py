"""DPPO: a trust region on a divergence of the sampled token's probability, in place of PPO's ratio clip.

"Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al., arXiv 2602.04879) argues
that PPO's clip on the ratio ``r = pi_theta / pi_anchor`` over-restricts rare tokens (a small
change in a small probability is a large ratio) and under-restricts likely ones. DPPO bounds a
divergence between the two policies instead, approximated on the sampled token alone: with
``p = pi_theta(y_t)`` and ``q = pi_anchor(y_t)``, the Bernoulli distributions "this token / any
other token" under each policy give

* binary TV (``loss_type="dppo_tv"``): ``D = |p - q|``;
* binary KL (``loss_type="dppo_kl"``): ``D = q log(q / p) + (1 - q) log((1 - q) / (1 - p))``,
  ``KL(Bernoulli(q) || Bernoulli(p))`` (each ``1 - x`` plus ``1e-8``, as every peer writes it).

A token leaves the update (no gradient) only when the update already moved it past the bound in
the direction its advantage pushes: ``A > 0`` with ``p > q`` and ``D > delta_high``, or ``A < 0``
with ``p < q`` and ``D > delta_low`` (for TV: ``p - q > delta_high``, ``q - p > delta_low``). A
token with ``A = 0`` is never masked (it carries no gradient anyway). Every other token keeps the
unclipped surrogate ``L_t = -A_t r_t`` (gradient ``-A_t r_t grad log pi_theta``), ``r`` from the
clamped log ratio. An optional cap ``C`` truncates the ratio as verl does (its ``clip_ratio_c``):
``L_t = -A_t min(r_t, C)``, gradient ``-A_t min(r_t, C) grad log pi_theta``.

The anchor is the policy PPO would clip against: ``pi_prox`` (verl's ``dppo_tv`` / ``dppo_kl``,
decoupled), or ``pi_rollout`` in bypass mode (prime-rl's default loss, SkyRL's ``dppo``).
Probabilities come from logprobs capped at 0, so a logprob rounded above 0 cannot make
``1 - p`` negative.
"""

from __future__ import annotations

from typing import Literal

import torch

from lightning_offpolicy.correction.ratios import log_ratio, masked, safe_exp

DPPODivergence = Literal["tv", "kl"]

#: Added to both ``1 - q`` and ``1 - p`` in the binary KL (verl's, SkyRL's and the paper's constant).
BINARY_KL_EPS = 1e-8


def binary_divergence(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    divergence: DPPODivergence = "tv",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token divergence between ``Bernoulli(p)`` and ``Bernoulli(q)`` and the sign of ``p - q``.

    Args:
        logprobs: ``[B, T]`` logprobs of the sampled tokens under ``pi_theta`` (read detached).
        anchor_logprobs: ``[B, T]`` under the anchor policy (``pi_prox``, or ``pi_rollout`` in bypass mode).
        response_mask: ``[B, T]`` 1 on response tokens; padding may hold anything and gives 0.
        divergence: ``"tv"`` (``|p - q|``) or ``"kl"`` (``KL(Bernoulli(q) || Bernoulli(p))``).

    Returns:
        ``(D, p - q)``, both ``[B, T]`` in at least float32, detached, 0 at padding.

    Raises:
        ValueError: ``divergence`` is neither ``"tv"`` nor ``"kl"``.
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"binary_divergence: divergence={divergence!r} is not one of 'tv', 'kl'.")
    valid = response_mask.bool()
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, anchor_logprobs.dtype), torch.float32)
    with torch.no_grad():
        # Padding becomes logprob 0 (p = q = 1, D = 0); a response logprob rounded above 0 is a
        # probability of 1, not more (1 - p must stay >= 0 for the binary KL's logarithm).
        log_p = masked(logprobs.detach().to(dtype), valid).clamp(max=0.0)
        log_q = masked(anchor_logprobs.detach().to(dtype), valid).clamp(max=0.0)
        p, q = torch.exp(log_p), torch.exp(log_q)
        diff = p - q
        if divergence == "tv":
            return diff.abs(), diff
        # q log(q / p): 0 where q = 0 (an anchor logprob of -inf), not 0 * inf.
        own = torch.where(q > 0, q * (log_q - log_p), torch.zeros((), dtype=dtype, device=q.device))
        rest = (1.0 - q) * torch.log((1.0 - q + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))
        return masked(own + rest, valid), diff


def dppo_mask(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    divergence: DPPODivergence = "tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
) -> torch.Tensor:
    """The response tokens DPPO's trust region removes from the update.

    Args:
        logprobs: ``[B, T]`` under ``pi_theta`` (read detached).
        anchor_logprobs: ``[B, T]`` under the anchor (``pi_prox``, or ``pi_rollout`` in bypass mode).
        advantages: ``[B, T]`` per-token advantages (only their sign is read).
        response_mask: ``[B, T]`` 1 on response tokens.
        divergence: ``"tv"`` or ``"kl"`` (:func:`binary_divergence`).
        delta_low: bound for tokens with ``A < 0`` whose probability fell.
        delta_high: bound for tokens with ``A > 0`` whose probability rose.

    Returns:
        ``[B, T]`` bool, ``True`` where the token is masked (never at padding or where ``A = 0``).

    Raises:
        ValueError: an unknown ``divergence``.
    """
    div, diff = binary_divergence(logprobs, anchor_logprobs, response_mask, divergence)
    with torch.no_grad():
        adv = advantages.detach()
        # For TV, D > delta with the sign of p - q is exactly p - q > delta_high / q - p > delta_low.
        rose_too_far = (diff > 0) & (div > delta_high)
        fell_too_far = (diff < 0) & (div > delta_low)
        return response_mask.bool() & (((adv > 0) & rose_too_far) | ((adv < 0) & fell_too_far))


def dppo_surrogate(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    divergence: DPPODivergence = "tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    ratio_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token DPPO loss ``-A * r`` outside the trust region's mask, 0 on masked tokens and padding.

    Args:
        logprobs: ``[B, T]`` under ``pi_theta``, with gradient.
        anchor_logprobs: ``[B, T]`` under the anchor (``pi_prox``, or ``pi_rollout`` in bypass mode).
        advantages: ``[B, T]`` advantages, 0 at padding (detached by the caller).
        response_mask: ``[B, T]`` 1 on response tokens.
        divergence: ``"tv"`` or ``"kl"``.
        delta_low: bound for negative-advantage tokens (:func:`dppo_mask`).
        delta_high: bound for positive-advantage tokens.
        ratio_cap: truncate the ratio at this value, value and gradient (verl's ``clip_ratio_c``);
            ``None``: no cap (prime-rl, SkyRL).

    Returns:
        ``(loss, masked, capped)``: the ``[B, T]`` loss per token, the bool tokens the trust region
        masked, and the bool unmasked response tokens whose ratio the cap truncated.
    """
    valid = response_mask.bool()
    masked_out = dppo_mask(logprobs, anchor_logprobs, advantages, valid, divergence, delta_low, delta_high)
    ratio = safe_exp(log_ratio(logprobs, anchor_logprobs, valid))
    capped = torch.zeros_like(valid)
    if ratio_cap is not None:
        capped = valid & ~masked_out & (ratio.detach() > ratio_cap)
        # The value C with the gradient C * grad log pi_theta (verl's -A * sg(min(r, C)) * log pi_theta
        # differentiated), also beyond the log-ratio clamp; padding is 0 first, so its exp stays 1.
        own = masked(logprobs, valid)
        at_cap = ratio_cap * torch.exp(own - own.detach()).to(ratio.dtype)
        ratio = torch.where(capped, at_cap, ratio)
    loss = torch.where(masked_out, torch.zeros((), dtype=ratio.dtype, device=ratio.device), -advantages * ratio)
    return loss, masked_out, capped
