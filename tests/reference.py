"""Independent float64 re-derivation of the off-policy correction math (tests only).

Written from docs/off_policy_correction.md (section 4, "Order of application and edge cases", and
section 5, "The math") and the module docstrings of ``lightning_offpolicy/correction``; it never calls a
function of the package. Everything is a plain
Python loop over sequences ``i`` and tokens ``t`` in float64 (NumPy arrays only as containers).

Conventions (from the spec):

* ``log_rho_t = prox_t - rollout_t`` on response tokens, 0 elsewhere; safe exp is
  ``exp(clamp(x, -20, 20))``.
* Order (correction.py docstring): token masks (IcePop, token ``kl_reject``) on the response
  tokens -> sequence statistics over the token-kept set -> sequence masks (geo, product, outlier
  veto, sequence ``kl_reject``) -> TIS weights (token, or sequence from the token-kept sum) ->
  optional normalisation to mean 1 over the kept tokens / kept sequences; weights are 1.0 outside
  the response.
* Mask bounds are compared in log space (masks.py docstring).
* Rejection statistics (masks.py): ``k1 = |log_rho|``, ``k2 = log_rho^2 / 2``,
  ``k3 = rho - 1 - log_rho`` per token, then summed / averaged / maxed over the token-kept set.
* KL loss estimators (kl.py) with ``d = logprobs - other``: ``k1 = d``, ``abs = |d|``,
  ``k2 = d^2 / 2``, ``k3 = exp(-d) - 1 + d`` (exp is the safe exp), ``low_var_kl`` = k3 with ``d``
  clamped to [-20, 20] and the value clamped to [-10, 10].
* Aggregation: rejected tokens leave the numerator, denominators count the original response
  tokens / the sequences with at least one response token (or the counts passed in).

* DPPO (``loss_type`` ``"dppo_tv"`` / ``"dppo_kl"``), from the peers' code (prime-rl's
  ``default_loss_fn``, SkyRL's ``dppo_policy_loss``, verl's ``compute_policy_loss_dppo_tv`` /
  ``_kl``): ``p = exp(logprobs)``, ``q = exp(anchor)`` (capped at 1); a token is masked when
  ``A > 0``, ``p > q`` and the divergence exceeds ``delta_high``, or ``A < 0``, ``p < q`` and it
  exceeds ``delta_low``; TV is ``|p - q|``, KL ``q log(q/p) + (1-q) log((1-q+1e-8)/(1-p+1e-8))``.
  Unmasked tokens: ``-A * r`` (gradient ``-A * r``), or with a cap ``C < r``: ``-A * C`` (gradient
  ``-A * C``, verl's truncated score function).

* M2PO (``m2po_mask``), from AReaL's ``_apply_m2po_masking``: a token mask over every response
  token of the batch; rank them by ``log_rho^2``, largest first, and reject the ``k`` largest, ``k``
  the smallest count that leaves a mean ``log_rho^2`` below ``m2po_threshold`` (else all but one).
* OPSM (``opsm_mask``), from slime's ``compute_opsm_mask`` and TRL's ``get_off_policy_mask``: after
  the surrogate, token ``t`` of sequence ``i`` leaves the numerator when ``A_{i,t} < 0`` and the mean
  over the response tokens of ``log pi_ref - log pi_theta`` exceeds ``opsm_threshold`` (``pi_ref``: the
  rollout logprobs, or the prox ones unless in bypass mode).

Besides values, :func:`ref_policy_loss` returns the analytic gradient of the total loss with
respect to ``logprobs`` (weights are stop-gradient, so only the surrogate's own dependence counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CLAMP = 20.0


# --------------------------------------------------------------------------------------- helpers
def to_np(x: Any) -> np.ndarray | None:
    """float64 NumPy copy of a tensor / array (``None`` stays ``None``)."""
    if x is None:
        return None
    if hasattr(x, "detach"):
        import torch

        return x.detach().cpu().to(torch.float64).numpy().copy()
    return np.array(x, dtype=np.float64)


def safe_exp(x: float) -> float:
    return math.exp(min(max(float(x), -CLAMP), CLAMP))


def d_safe_exp(x: float) -> float:
    """Derivative of ``safe_exp`` (0 where the clamp is active)."""
    return math.exp(x) if -CLAMP < x < CLAMP else 0.0


def clamp(x: float, low: float | None, high: float | None) -> float:
    if low is not None and x < low:
        x = low
    if high is not None and x > high:
        x = high
    return x


def in_bounds(log_value: float, low: float | None, high: float | None) -> bool:
    """``low <= exp(log_value) <= high`` decided in log space."""
    if low is not None and not log_value >= math.log(low):
        return False
    if high is not None and not log_value <= math.log(high):
        return False
    return True


def reject_statistic(log_rho: float, estimator: str) -> float:
    if estimator == "k1":
        return abs(log_rho)
    if estimator == "k2":
        return 0.5 * log_rho * log_rho
    if estimator == "k3":
        return safe_exp(log_rho) - 1.0 - log_rho
    raise ValueError(estimator)


def kl_value_and_grad(d: float, estimator: str) -> tuple[float, float]:
    """KL loss estimator at ``d = logprobs - other`` and its derivative w.r.t. ``logprobs``."""
    if estimator == "k1":
        return d, 1.0
    if estimator == "abs":
        return abs(d), (1.0 if d > 0 else (-1.0 if d < 0 else 0.0))
    if estimator == "k2":
        return 0.5 * d * d, d
    if estimator == "k3":
        # exp(-d) through the safe exp; the linear term is not clamped.
        return safe_exp(-d) - 1.0 + d, 1.0 - d_safe_exp(-d)
    if estimator == "low_var_kl":
        dc = clamp(d, -CLAMP, CLAMP)
        inside = -CLAMP < d < CLAMP
        v = math.exp(-dc) - 1.0 + dc
        g = (1.0 - math.exp(-dc)) if inside else 0.0
        if v > 10.0:
            v, g = 10.0, 0.0
        if v < -10.0:
            v, g = -10.0, 0.0
        return v, g
    raise ValueError(estimator)


def _cfg(obj: Any, name: str, default: Any) -> Any:
    return getattr(obj, name, default) if obj is not None else default


# ------------------------------------------------------------------------------------ correction
@dataclass
class RefCorrection:
    weights: np.ndarray  # [B, T]
    mask: np.ndarray  # [B, T] 0/1 float
    kept: np.ndarray  # [B, T] bool
    token_keep: np.ndarray  # [B, T] bool, survivors of the token-level masks
    log_rho: np.ndarray  # [B, T], 0 at padding
    seq_log_rho: np.ndarray  # [B], over response tokens
    seq_tokens: np.ndarray  # [B]
    seq_valid: np.ndarray  # [B] bool
    weight_clipped: np.ndarray  # [B, T] bool
    token_rejected: dict[str, np.ndarray] = field(default_factory=dict)
    seq_rejected: dict[str, np.ndarray] = field(default_factory=dict)


def ref_correction(prox: Any, rollout: Any, response_mask: Any, cfg: Any = None) -> RefCorrection:
    """Weights / masks / statistics of ``compute_correction``, loop by loop in float64."""
    m = to_np(response_mask)
    B, T = m.shape
    valid = m != 0
    bypass = bool(_cfg(cfg, "bypass_mode", False))
    masks = ("token_mask", "geo_mask", "product_mask", "outlier_token_veto")
    has_mask = any(bool(_cfg(cfg, name, False)) for name in masks) or _cfg(cfg, "kl_reject", None) is not None
    # In bypass mode the masks compare the current policy (passed as ``prox``) with the rollout
    # (verl's bypass semantics); without a mask bypass reads no logprob at all.
    p = to_np(prox) if prox is not None and (not bypass or has_mask) else None
    r = to_np(rollout)

    log_rho = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if valid[i, t] and p is not None:
                log_rho[i, t] = p[i, t] - r[i, t]

    token_mask = bool(_cfg(cfg, "token_mask", False))
    kl_reject = _cfg(cfg, "kl_reject", None)
    kl_level = _cfg(cfg, "kl_reject_level", "seq_mean")
    kl_thr = _cfg(cfg, "kl_reject_threshold", None)

    # 2. token-level masks on the response tokens
    token_keep = valid.copy()
    token_rejected: dict[str, np.ndarray] = {}
    if token_mask:
        rej = np.zeros((B, T), dtype=bool)
        for i in range(B):
            for t in range(T):
                if valid[i, t] and not in_bounds(log_rho[i, t], cfg.token_mask_low, cfg.token_mask_high):
                    rej[i, t] = True
        token_rejected["token_mask"] = rej
    if kl_reject is not None and kl_level == "token":
        rej = np.zeros((B, T), dtype=bool)
        for i in range(B):
            for t in range(T):
                if valid[i, t] and not reject_statistic(log_rho[i, t], kl_reject) <= kl_thr:
                    rej[i, t] = True
        token_rejected["kl_reject"] = rej
    if _cfg(cfg, "m2po_mask", False):
        # AReaL's _apply_m2po_masking / _get_m2po_loss_mask: rank every response token of the batch by
        # log_rho^2, largest first (ties: row-major order); reject the k largest, k the first count
        # whose remaining mean is below the threshold, else all but one.
        cells = [(i, t) for i in range(B) for t in range(T) if valid[i, t]]
        m2 = [log_rho[i, t] * log_rho[i, t] for i, t in cells]
        ranked = sorted(range(len(cells)), key=lambda c: -m2[c])
        n = len(cells)
        rejected_count = max(n - 1, 0)
        for k in range(n):
            rest = [m2[ranked[j]] for j in range(k, n)]
            if sum(rest) / len(rest) < cfg.m2po_threshold:
                rejected_count = k
                break
        rej = np.zeros((B, T), dtype=bool)
        for j in range(rejected_count):
            rej[cells[ranked[j]]] = True
        token_rejected["m2po_mask"] = rej
    for rej in token_rejected.values():
        token_keep &= ~rej

    # 3. sequence statistics over the token-kept set, 4. sequence masks
    S = np.zeros(B)
    n = np.zeros(B)
    seq_keep_by_mask: dict[str, list[bool]] = {}
    for i in range(B):
        kept_lr = [log_rho[i, t] for t in range(T) if token_keep[i, t]]
        S[i] = sum(kept_lr)
        n[i] = len(kept_lr)
        decisions = {}
        if _cfg(cfg, "geo_mask", False):
            decisions["geo_mask"] = in_bounds(S[i] / max(n[i], 1.0), cfg.geo_mask_low, cfg.geo_mask_high)
        if _cfg(cfg, "product_mask", False):
            decisions["product_mask"] = in_bounds(S[i], cfg.product_mask_low, cfg.product_mask_high)
        if _cfg(cfg, "outlier_token_veto", False):
            decisions["outlier_veto"] = all(in_bounds(x, cfg.outlier_low, cfg.outlier_high) for x in kept_lr)
        if kl_reject is not None and kl_level != "token":
            stats = [reject_statistic(x, kl_reject) for x in kept_lr]
            if kl_level == "seq_sum":
                value = sum(stats)
            elif kl_level == "seq_mean":
                value = sum(stats) / max(len(stats), 1)
            elif kl_level == "seq_max":
                value = max(stats) if stats else 0.0
            else:
                raise ValueError(kl_level)
            decisions["kl_reject"] = value <= kl_thr
        for name, keep in decisions.items():
            seq_keep_by_mask.setdefault(name, [True] * B)[i] = keep

    seq_keep = np.ones(B, dtype=bool)
    for name, keeps in seq_keep_by_mask.items():
        rej = np.zeros((B, T), dtype=bool)
        for i in range(B):
            if not keeps[i]:
                seq_keep[i] = False
                for t in range(T):
                    rej[i, t] = bool(token_keep[i, t])
        token_rejected[name] = rej
    kept = token_keep & seq_keep[:, None]

    # 5. TIS weights
    tis_level = _cfg(cfg, "tis_level", None)
    weights = np.ones((B, T))
    clipped = np.zeros((B, T), dtype=bool)
    if tis_level is not None:
        lo, hi = cfg.tis_clip_low, cfg.tis_clip_high
        for i in range(B):
            for t in range(T):
                if not valid[i, t]:
                    continue
                raw = safe_exp(log_rho[i, t] if tis_level == "token" else S[i])
                w = clamp(raw, lo, hi)
                weights[i, t] = w
                clipped[i, t] = w != raw
        # 6. normalisation to mean 1 over kept tokens / kept sequences
        if _cfg(cfg, "normalize_weights", False):
            if tis_level == "token":
                vals = [weights[i, t] for i in range(B) for t in range(T) if kept[i, t]]
            else:
                vals = [weights[i, kept[i].argmax()] for i in range(B) if kept[i].any()]
            if vals and sum(vals) > 0:
                mean = sum(vals) / len(vals)
                for i in range(B):
                    for t in range(T):
                        if valid[i, t]:
                            weights[i, t] /= mean

    seq_valid = valid.any(axis=1)
    seq_rejected = {name: seq_valid & rej.any(axis=1) for name, rej in token_rejected.items()}
    return RefCorrection(
        weights=weights,
        mask=kept.astype(np.float64),
        kept=kept,
        token_keep=token_keep,
        log_rho=log_rho,
        seq_log_rho=np.array([sum(log_rho[i, t] for t in range(T) if valid[i, t]) for i in range(B)]),
        seq_tokens=valid.sum(axis=1).astype(np.float64),
        seq_valid=seq_valid,
        weight_clipped=clipped,
        token_rejected=token_rejected,
        seq_rejected=seq_rejected,
    )


# ------------------------------------------------------------------------------------ aggregation
def ref_denominators(
    valid: np.ndarray,
    mode: str,
    token_count: float | None = None,
    sequence_count: float | None = None,
    norm_constant: float | None = None,
) -> np.ndarray:
    """Per-token factor ``D[i, t]`` with ``loss = sum_{kept} per_token * D``."""
    B, T = valid.shape
    D = np.zeros((B, T))
    n_tok = float(valid.sum()) if token_count is None else float(token_count)
    n_seq = float(sum(1 for i in range(B) if valid[i].any())) if sequence_count is None else float(sequence_count)
    for i in range(B):
        n_i = float(valid[i].sum())
        for t in range(T):
            if mode == "token-mean":
                D[i, t] = 1.0 / (n_tok if n_tok > 0 else 1.0)
            elif mode == "seq-mean-token-mean":
                D[i, t] = 1.0 / (max(n_i, 1.0) * (n_seq if n_seq > 0 else 1.0))
            elif mode == "seq-mean-token-sum-norm":
                c = float(norm_constant) if norm_constant else float(T)
                D[i, t] = 1.0 / (c * (n_seq if n_seq > 0 else 1.0))
            else:
                raise ValueError(mode)
    return D


def ref_aggregate(per_token: Any, kept: Any, response_mask: Any, mode: str = "token-mean", **counts) -> float:
    """Aggregate a per-token loss; values outside ``kept`` are never read."""
    x = to_np(per_token)
    k = to_np(kept) != 0
    valid = to_np(response_mask) != 0
    D = ref_denominators(valid, mode, **counts)
    total = 0.0
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if k[i, t]:
                total += x[i, t] * D[i, t]
    return total


# ---------------------------------------------------------------------------------- policy loss
@dataclass
class RefLoss:
    total: float
    policy_loss: float
    rollout_kl: float
    ref_kl: float
    kept_tokens: int
    clipped_tokens: int
    dual_clipped_tokens: int
    approx_kl_sum: float
    rollout_kl_sum: float  # sum over response tokens of the rollout KL estimator (0 without rollout logprobs)
    response_tokens: int
    grad: np.ndarray  # d total / d logprobs, [B, T]
    scale: float  # sum of |terms|: for a tolerance that survives float32 cancellation
    per_token: np.ndarray  # [B, T] surrogate per token (times weight), 0 where not kept
    correction: RefCorrection | None = None
    opsm_rejected_tokens: int | None = None  # response tokens OPSM removed (None without OPSM)
    opsm_rejected_sequences: int | None = None


_LOSS_DEFAULTS = dict(
    loss_type="ppo",
    eps_clip_low=0.2,
    eps_clip_high=0.2,
    dual_clip=None,
    tau_pos=1.0,
    tau_neg=1.05,
    aggregation="token-mean",
    loss_norm_constant=None,
    rollout_kl_coef=0.0,
    rollout_kl_estimator="k2",
    ref_kl_coef=0.0,
    ref_kl_estimator="low_var_kl",
    dppo_delta_low=0.2,
    dppo_delta_high=0.2,
    dppo_ratio_cap=None,
)


def ref_policy_loss(
    logprobs: Any,
    prox: Any,
    rollout: Any,
    advantages: Any,
    response_mask: Any,
    loss_cfg: Any = None,
    corr_cfg: Any = None,
    ref_logprobs: Any = None,
    token_count: float | None = None,
    sequence_count: float | None = None,
) -> RefLoss:
    """The total loss of ``policy_loss`` (with ``correction=compute_correction(..., corr_cfg)``)."""
    L = {k: _cfg(loss_cfg, k, v) for k, v in _LOSS_DEFAULTS.items()}
    lp = to_np(logprobs)
    B, T = lp.shape
    m = to_np(response_mask)
    valid = m != 0
    a = to_np(advantages)
    if a.ndim == 1:
        a = np.repeat(a[:, None], T, axis=1)
    p = to_np(prox)
    r = to_np(rollout)
    ref = to_np(ref_logprobs)

    corr = ref_correction(prox, rollout, response_mask, corr_cfg) if corr_cfg is not None else None
    kept = corr.kept if corr is not None else valid.copy()
    w_tis = corr.weights if corr is not None else np.ones((B, T))
    objective = _cfg(corr_cfg, "objective", "ppo")
    bypass = bool(_cfg(corr_cfg, "bypass_mode", False))
    anchor = r if bypass else p

    per_token = np.zeros((B, T))
    dper_token = np.zeros((B, T))
    clipped = np.zeros((B, T), dtype=bool)
    dual = np.zeros((B, T), dtype=bool)

    if objective == "ppo":
        for i in range(B):
            kept_x = [lp[i, t] - anchor[i, t] for t in range(T) if kept[i, t]]
            seq_mean = sum(kept_x) / max(len(kept_x), 1)
            for t in range(T):
                if not valid[i, t]:
                    continue
                A = a[i, t]
                x = seq_mean if L["loss_type"] == "gspo" else lp[i, t] - anchor[i, t]
                ratio = safe_exp(x)
                dratio = d_safe_exp(x)  # d ratio / d logprobs_t (GSPO: straight-through, 1 per token)
                if L["loss_type"] in ("dppo_tv", "dppo_kl"):
                    val, grad, clipped[i, t], dual[i, t] = _ref_dppo(lp[i, t], anchor[i, t], A, L)
                elif L["loss_type"] == "sapo":
                    tau = L["tau_pos"] if A > 0 else L["tau_neg"]
                    sig = 1.0 / (1.0 + math.exp(-tau * (ratio - 1.0)))
                    val = -(4.0 / tau) * sig * A
                    grad = -4.0 * sig * (1.0 - sig) * dratio * A
                else:
                    unclipped = -A * ratio
                    clipped_loss = -A * clamp(ratio, 1.0 - L["eps_clip_low"], 1.0 + L["eps_clip_high"])
                    if clipped_loss > unclipped:
                        val, grad, clipped[i, t] = clipped_loss, 0.0, True
                    else:
                        val, grad = unclipped, -A * dratio
                    if L["dual_clip"] is not None and A < 0:
                        bound = -A * L["dual_clip"]
                        if val > bound:
                            val, grad, dual[i, t] = bound, 0.0, True
                per_token[i, t] = val * w_tis[i, t]
                dper_token[i, t] = grad * w_tis[i, t]
    else:
        anchored_on_rollout = objective == "pure_is" or corr_cfg.anchor == "rollout"
        base = r if anchored_on_rollout else p
        level = corr_cfg.objective_level if objective == "pure_is" else "token"
        lo, hi = corr_cfg.is_clip_low, corr_cfg.is_clip_high
        for i in range(B):
            seq_sum = sum(lp[i, t] - base[i, t] for t in range(T) if kept[i, t])
            for t in range(T):
                if not valid[i, t]:
                    continue
                raw = safe_exp(seq_sum if level == "sequence" else lp[i, t] - base[i, t])
                w = clamp(raw, lo, hi)
                clipped[i, t] = w != raw
                A = a[i, t]
                per_token[i, t] = -w * A * lp[i, t] * w_tis[i, t]
                dper_token[i, t] = -w * A * w_tis[i, t]

    opsm_rejected = None
    if _cfg(corr_cfg, "opsm_mask", False):
        reference = r if (corr_cfg.opsm_reference == "rollout" or bypass) else p
        opsm_rejected = np.zeros((B, T), dtype=bool)
        for i in range(B):
            tokens = [t for t in range(T) if valid[i, t]]
            kl = sum(reference[i, t] - lp[i, t] for t in tokens) / max(len(tokens), 1)
            for t in tokens:
                opsm_rejected[i, t] = a[i, t] < 0 and kl > corr_cfg.opsm_threshold
        kept = kept & ~opsm_rejected

    kw = dict(token_count=token_count, sequence_count=sequence_count, norm_constant=L["loss_norm_constant"])
    D = ref_denominators(valid, L["aggregation"], **kw)
    pg = 0.0
    grad = np.zeros((B, T))
    scale = 0.0
    for i in range(B):
        for t in range(T):
            if kept[i, t]:
                pg += per_token[i, t] * D[i, t]
                grad[i, t] += dper_token[i, t] * D[i, t]
                scale += abs(per_token[i, t] * D[i, t])
            else:
                per_token[i, t] = 0.0
    total = pg

    def kl_term(other: np.ndarray, estimator: str, coef: float) -> float:
        nonlocal scale
        value = 0.0
        for i in range(B):
            for t in range(T):
                if valid[i, t]:
                    v, g = kl_value_and_grad(lp[i, t] - other[i, t], estimator)
                    value += v * D[i, t]
                    grad[i, t] += coef * g * D[i, t]
                    scale += abs(coef * v * D[i, t])
        return value

    rollout_kl = ref_kl = 0.0
    if L["rollout_kl_coef"] > 0:
        rollout_kl = kl_term(r, L["rollout_kl_estimator"], L["rollout_kl_coef"])
        total += L["rollout_kl_coef"] * rollout_kl
    if L["ref_kl_coef"] > 0:
        ref_kl = kl_term(ref, L["ref_kl_estimator"], L["ref_kl_coef"])
        total += L["ref_kl_coef"] * ref_kl

    approx = 0.0
    if anchor is not None:
        for i in range(B):
            for t in range(T):
                if kept[i, t]:
                    x = clamp(lp[i, t] - anchor[i, t], -CLAMP, CLAMP)
                    approx += (math.exp(x) - 1.0) - x

    rollout_kl_sum = 0.0
    if r is not None:
        for i in range(B):
            for t in range(T):
                if valid[i, t]:
                    rollout_kl_sum += kl_value_and_grad(lp[i, t] - r[i, t], L["rollout_kl_estimator"])[0]

    return RefLoss(
        total=total,
        policy_loss=pg,
        rollout_kl=rollout_kl,
        ref_kl=ref_kl,
        kept_tokens=int(kept.sum()),
        clipped_tokens=int((clipped & kept).sum()),
        dual_clipped_tokens=int((dual & kept).sum()),
        approx_kl_sum=approx,
        rollout_kl_sum=rollout_kl_sum,
        response_tokens=int(valid.sum()),
        grad=grad,
        scale=scale,
        per_token=per_token,
        correction=corr,
        opsm_rejected_tokens=None if opsm_rejected is None else int(opsm_rejected.sum()),
        opsm_rejected_sequences=None if opsm_rejected is None else int(opsm_rejected.any(axis=1).sum()),
    )


def _ref_dppo(logprob: float, anchor: float, A: float, L: dict[str, Any]) -> tuple[float, float, bool, bool]:
    """One token of DPPO: ``(loss, d loss / d logprob, masked, capped)``."""
    log_p, log_q = min(logprob, 0.0), min(anchor, 0.0)
    p, q = math.exp(log_p), math.exp(log_q)
    if L["loss_type"] == "dppo_tv":
        div = abs(p - q)
    else:
        own = q * (log_q - log_p) if q > 0 else 0.0
        div = own + (1.0 - q) * math.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    if (A > 0 and p > q and div > L["dppo_delta_high"]) or (A < 0 and p < q and div > L["dppo_delta_low"]):
        return 0.0, 0.0, True, False
    x = logprob - anchor
    ratio, dratio = safe_exp(x), d_safe_exp(x)
    cap = L["dppo_ratio_cap"]
    if cap is not None and ratio > cap:
        return -A * cap, -A * cap, False, True
    return -A * ratio, -A * dratio, False, False


def ref_kl_loss(
    logprobs: Any, other: Any, response_mask: Any, estimator: str, mode: str = "token-mean"
) -> tuple[float, np.ndarray]:
    """A KL loss term alone (coefficient 1): value and gradient w.r.t. ``logprobs``."""
    lp, o = to_np(logprobs), to_np(other)
    valid = to_np(response_mask) != 0
    D = ref_denominators(valid, mode)
    value, grad = 0.0, np.zeros(lp.shape)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if valid[i, t]:
                v, g = kl_value_and_grad(lp[i, t] - o[i, t], estimator)
                value += v * D[i, t]
                grad[i, t] = g * D[i, t]
    return value, grad


# ------------------------------------------------------------------------------------- test data
GARBAGE = (float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 12345.0)


def make_batch(
    seed: int,
    batch: int = 8,
    length: int = 12,
    spread: float = 0.1,
    policy_spread: float = 0.15,
    huge: bool = False,
    holes: bool = False,
    garbage: bool = True,
) -> dict[str, np.ndarray]:
    """A random float32 batch: row 0 has no response token, row 1 is full, padding holds garbage.

    ``huge`` puts log ratios of about +-1000 into some rows (one sign per quantity and row, so
    float32 sums do not cancel): a rollout logprob of -1000 (log_rho ~ +999), a prox logprob of -1000
    (log_rho ~ -999, logprobs - prox ~ +999) or a current logprob of -1000.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, batch)
    lengths[0] = 0
    if batch > 1:
        lengths[1] = length
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    if holes:
        mask *= rng.random((batch, length)) > 0.25
    rollout = -rng.exponential(1.0, (batch, length)) - 0.05
    prox = rollout + rng.normal(0.0, spread, (batch, length))
    logprobs = prox + rng.normal(0.0, policy_spread, (batch, length))
    ref_logprobs = prox + rng.normal(0.0, policy_spread, (batch, length))
    adv = rng.normal(0.0, 1.0, (batch, length))
    if huge:
        for i in range(2, batch, 2):
            kind = rng.integers(0, 3)
            cols = rng.choice(length, size=min(2, length), replace=False)
            for t in cols:
                if kind == 0:
                    rollout[i, t] = -1000.0
                elif kind == 1:
                    prox[i, t] = -1000.0
                else:
                    logprobs[i, t] = -1000.0
    out = {
        "logprobs": logprobs,
        "prox": prox,
        "rollout": rollout,
        "ref": ref_logprobs,
        "adv": adv,
        "mask": mask,
    }
    out = {k: v.astype(np.float32) for k, v in out.items()}
    if garbage:
        pad = out["mask"] == 0
        for name in ("logprobs", "prox", "rollout", "ref", "adv"):
            fill = rng.choice(np.array(GARBAGE, dtype=np.float32), size=out[name].shape)
            out[name] = np.where(pad, fill, out[name]).astype(np.float32)
    return out
