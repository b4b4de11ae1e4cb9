"""KL estimators between two policies from per-token log-probabilities.

With ``d = logprobs - other_logprobs`` (the current policy against the rollout or reference
policy), following Schulman's "Approximating KL divergence":

* ``k1 = d``                     unbiased, high variance, can be negative;
* ``abs = |d|``;
* ``k2 = d^2 / 2``               prime-rl's squared log ratio, up to the factor 1/2;
* ``k3 = exp(-d) - 1 + d``       non-negative, low variance (only the ``exp`` argument is clamped);
* ``low_var_kl``                 ``k3`` with ``d`` clamped to [-20, 20] and the result to [-10, 10]
  (verl's spelling).

All carry gradient through ``logprobs``: a KL loss computed under ``no_grad`` is a known peer bug.
"""

from __future__ import annotations

import torch

from lightning_offpolicy.correction.ratios import LOG_RATIO_CLAMP, log_ratio, safe_exp
from lightning_offpolicy.correction.validation import KLEstimator

KL_ESTIMATORS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "low_var_kl")


def kl_of_log_ratio(d: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || other)`` from ``d = log pi - log other`` at samples of ``pi``.

    The one place the estimators are written: the KL loss (:func:`kl_estimate`) and the rejection
    masks' statistic (:func:`~lightning_offpolicy.correction.masks.kl_statistic`) both use it.
    """
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        # Only the exponent is clamped: beyond |d| = 20 the penalty keeps growing (slope 1).
        return safe_exp(-d) - 1.0 + d
    if estimator == "low_var_kl":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(-d) - 1.0 + d).clamp(-10.0, 10.0)
    raise ValueError(f"kl estimator {estimator!r} is not known; allowed: {', '.join(KL_ESTIMATORS)}.")


def kl_estimate(
    logprobs: torch.Tensor,
    other_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: KLEstimator = "k3",
) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (0 at padding), differentiable w.r.t. ``logprobs``."""
    return kl_of_log_ratio(log_ratio(logprobs, other_logprobs, response_mask), estimator)
