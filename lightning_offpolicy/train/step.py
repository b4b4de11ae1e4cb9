"""The eager pieces of the decoupled PPO step, shared by :class:`~lightning_offpolicy.OffPolicyRLModule`
and :class:`~lightning_offpolicy.OffPolicyMixin` through :class:`~.update.PPOUpdate`.

1. :func:`rollout_of`: the rollouts a ``RolloutCallback`` attached to the step's ``PromptBatch``;
2. :func:`token_staleness`: how many versions behind the trainer each response token is;
3. :func:`response_logprobs`: one teacher-forced forward (``pi_prox`` without gradient, ``pi_theta`` with);
   with ``prox_method="loglinear"``, :func:`loglinear_prox` interpolates ``pi_prox`` from ``pi_rollout``
   and ``pi_theta`` instead of the forward without gradient;
4. :func:`apply_correction`: :func:`~lightning_offpolicy.correction.compute_correction` on
   ``pi_prox`` vs ``pi_rollout``, its weights and mask stored on the batch, so that any slice of
   it (mini-batch, micro-batch) carries its own;
5. :func:`corrected_loss`: :func:`~lightning_offpolicy.correction.policy_loss` on such a slice;
6. :func:`log_step`: the step's ``rollout_corr/*``, ``ppo/*``, ``train/*`` values, logged once,
   on the batches :func:`~lightning_offpolicy.lightning.log_steps.is_logging_step` names.

The loop over epochs, mini-batches and micro-batches that calls them is :mod:`.update`; the
compiled alternative to 4-5 is :mod:`.micro_step`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_offpolicy.batch import PromptBatch, RolloutBatch
from lightning_offpolicy.correction import (
    CorrectionOutput,
    CorrectionStats,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    PolicyLossInfo,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.correction.prox import loglinear_prox_logprobs
from lightning_offpolicy.logprobs import causal_lm_token_logprobs


def rollout_of(batch: Any, owner: str) -> RolloutBatch:
    """The rollouts to train on: ``batch`` itself, or the ones attached to a ``PromptBatch``.

    Args:
        batch: A ``RolloutBatch``, or a ``PromptBatch`` whose ``rollout`` the callback set.
        owner: Who asks, for the error message (``"OffPolicyRLModule.training_step"``).

    Raises:
        RuntimeError: There are no rollouts (no ``RolloutCallback`` in the Trainer).
    """
    if isinstance(batch, RolloutBatch):
        return batch
    if isinstance(batch, PromptBatch) and batch.rollout is not None:
        return batch.rollout
    raise RuntimeError(
        f"{owner} got a batch without rollouts. Add lightning_offpolicy.lightning.callback.RolloutCallback(...) to the "
        "Trainer's callbacks (it generates the rollouts of each PromptBatch), or feed RolloutBatch objects directly."
    )


def token_staleness(rollout: RolloutBatch, policy_version: int) -> torch.Tensor:
    """Versions behind ``policy_version`` of every response token, flat, float (0 for synchronous rollouts).

    Args:
        rollout: The step's rollouts (``policy_version`` per token).
        policy_version: The trainer's version at this step.
    """
    return (policy_version - rollout.policy_version[rollout.response_mask.bool()]).float()


def response_logprobs(
    model: torch.nn.Module,
    batch: RolloutBatch,
    temperature: float,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    packed: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced ``[B, T]`` logprobs (and entropies) of ``batch``'s response tokens, one forward.

    Under top-k / top-p sampling (``batch.sampling_support``) they are those of the distribution
    renormalized over the tokens the engine kept, as the engine's own logprobs are.

    Args:
        model: A ``transformers``-style causal LM.
        batch: The rows to score.
        temperature: The engine's sampling temperature (the logits are divided by it).
        chunk_size: Rows per chunk of the lean logprob computation.
        return_entropy: Also return the ``[B, T]`` entropy of the tempered distribution.
        packed: Run the rows as one packed, padding-free sequence (the model must allow it:
            :func:`~lightning_offpolicy.logprobs.packed.packing_refusal`); the same values.
    """
    return causal_lm_token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        response_start=batch.prompt_length,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        sampling_support=batch.sampling_support,
        packed=packed,
    )


def apply_correction(
    rollout: RolloutBatch,
    prox_logprobs: torch.Tensor | None,
    correction: OffPolicyCorrectionConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[RolloutBatch, CorrectionStats]:
    """The batch with its correction's weights and mask (and ``prox`` / ``ref`` logprobs) as fields.

    Args:
        rollout: The step's rollouts, with ``rollout_logprobs``.
        prox_logprobs: ``[B, T]`` ``pi_prox`` logprobs (no gradient); ``None`` in bypass mode.
        correction: The off-policy correction.
        ref_logprobs: ``[B, T]`` reference logprobs, when a reference KL loss is on.

    Returns:
        ``(batch, stats)``: ``stats`` for :class:`~lightning_offpolicy.metrics.correction.CorrectionMetrics`.
    """
    out = compute_correction(prox_logprobs, rollout.rollout_logprobs, rollout.response_mask, correction)
    corrected = rollout.with_fields(
        prox_logprobs=prox_logprobs, ref_logprobs=ref_logprobs, is_weights=out.weights, correction_mask=out.mask
    )
    return corrected, out.stats


def loglinear_prox(
    batch: RolloutBatch, logprobs: torch.Tensor, step_version: int, steps_per_batch: int
) -> torch.Tensor:
    """``pi_prox`` of ``prox_method="loglinear"`` for a slice of the step's batch, after its forward.

    AReaL's interpolation (:func:`~lightning_offpolicy.correction.prox.loglinear_prox_logprobs`)
    with its versions in the kit's units: AReaL's count training steps (one rollout batch each),
    the kit's count optimizer steps, ``steps_per_batch`` per batch. The current version is the
    step's (what a token generated by the step's own weights carries), the proximal one a batch
    earlier, so a token ``s`` batches stale gets ``alpha = (s - 1) / s`` as in AReaL. Under top-k /
    top-p sampling both logprobs are already those of the kept support, so they interpolate as they
    are.

    Args:
        batch: The slice (``rollout_logprobs`` and ``policy_version`` per token).
        logprobs: ``[B, T]`` ``pi_theta`` logprobs of ``batch`` (read detached).
        step_version: The module's ``policy_version`` at the start of the step.
        steps_per_batch: Optimizer steps one batch takes (``ppo_epochs * num_minibatches``).

    Returns:
        ``[B, T]`` float32 ``pi_prox`` logprobs, detached.
    """
    return loglinear_prox_logprobs(
        batch.rollout_logprobs,
        logprobs,
        batch.policy_version,
        current_version=step_version,
        proximal_version=step_version - steps_per_batch,
    )


def current_policy_stats(batch: RolloutBatch, logprobs: torch.Tensor) -> CorrectionStats:
    """The mismatch metrics of ``pi_theta`` (``logprobs``, detached) against ``pi_rollout``.

    What bypass mode logs: there ``pi_prox := pi_rollout``, so the metrics of
    :func:`apply_correction` read 0 by construction. On the first mini-batch of a step
    ``pi_theta`` is ``pi_prox``; on a later one it has moved by the steps taken since.
    """
    return compute_correction(
        logprobs.detach(), batch.rollout_logprobs, batch.response_mask, OffPolicyCorrectionConfig.disabled()
    ).stats


def corrected_loss(
    logprobs: torch.Tensor,
    batch: RolloutBatch,
    loss: PolicyLossConfig,
    correction: OffPolicyCorrectionConfig,
    token_count: float | torch.Tensor | None = None,
    sequence_count: float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossInfo]:
    """:func:`~lightning_offpolicy.correction.policy_loss` of a slice of an :func:`apply_correction` batch.

    Args:
        logprobs: ``[B, T]`` ``pi_theta`` logprobs of ``batch`` (with gradient).
        batch: The slice, carrying its ``is_weights`` and ``correction_mask``.
        loss: The surrogate, its aggregation and the KL penalties (checked against the correction
            once, with ``check_compatible``, by the caller).
        correction: The correction ``batch``'s weights and mask were computed with (its objective
            settings are the loss's).
        token_count: Global token denominator (``None``: this slice's).
        sequence_count: Global sequence denominator (``None``: this slice's).
        entropy: ``[B, T]`` entropy of ``pi_theta`` with gradient, for ``loss.entropy_coef > 0``.
    """
    return policy_loss(
        logprobs,
        batch.prox_logprobs,
        batch.rollout_logprobs,
        batch.advantages,
        batch.response_mask,
        loss,
        CorrectionOutput(batch.is_weights, batch.correction_mask, None, correction),
        ref_logprobs=batch.ref_logprobs,
        token_count=token_count,
        sequence_count=sequence_count,
        entropy=entropy,
    )


def log_step(module: Any, values: Mapping[str, torch.Tensor | float], progress_bar: Mapping[str, str]) -> None:
    """Log a step's values once (one ``log_dict``: each ``self.log`` has a fixed cost) and the progress-bar short names.

    Args:
        module: The LightningModule.
        values: Key -> scalar; every rank passes the values it logs (no sync here).
        progress_bar: Short name shown in the progress bar -> key in ``values`` (not sent to the logger).
    """
    values = {k: (v.float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))) for k, v in values.items()}
    module.log_dict(values, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
    for name, key in progress_bar.items():
        module.log(name, values[key], prog_bar=True, batch_size=1, logger=False)
