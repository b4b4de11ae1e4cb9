"""The correction and the policy loss of one micro-batch, compiled or eager, behind one call.

:class:`MicroBatchStep` is what the PPO update (:mod:`.update`) runs between a micro-batch's forward
and its backward. ``compiled=False`` runs the eager functions of :mod:`.step`
(:func:`~.step.apply_correction`, :func:`~.step.corrected_loss`), the reference;
``compiled=True`` runs the same functions inside one ``torch.compile``'d graph
(:class:`~lightning_offpolicy.correction.fused.FusedCorrectionStep`), metric sums included. See
docs/training.md for when the correction runs per micro-batch and when once per batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.correction import (
    CorrectionStats,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    PolicyLossInfo,
)
from lightning_offpolicy.correction.fused import FusedCorrectionStep, Statistics
from lightning_offpolicy.train import step


@dataclass
class MicroStepOutput:
    """What one :class:`MicroBatchStep` call gives back.

    Attributes:
        loss: The micro-batch's loss, with gradient, normalised by the mini-batch's global counts.
        info: :func:`~lightning_offpolicy.correction.policy_loss`'s statistics of the micro-batch.
        stats: Correction statistics to record (``None``: none computed here, or not asked for).
        sums: Metric sums computed inside the compiled graph (``None``: none, or not asked for).
    """

    loss: torch.Tensor
    info: PolicyLossInfo
    stats: CorrectionStats | None = None
    sums: Statistics | None = None


class MicroBatchStep:
    """Correction (when per micro-batch) -> policy loss -> metric statistics, for one micro-batch.

    Args:
        correction: The off-policy correction.
        loss: The surrogate, its aggregation and the KL penalties (checked against ``correction``
            with ``check_compatible`` by the caller).
        compiled: Run the correction, the loss, its gradient and the metric sums in one compiled
            graph (:class:`~lightning_offpolicy.correction.fused.FusedCorrectionStep`); ``False``:
            the eager functions. The correction then runs per micro-batch, so settings that read
            the whole batch (``correction.whole_batch_settings``) are refused by the caller.
        statistics: The metric sums computed inside the compiled graph (e.g.
            ``CorrectionMetrics(correction).sums``); only read with ``compiled=True``.
        steps_per_batch: Optimizer steps one rollout batch takes (``prox_method="loglinear"``
            interpolates by it).
    """

    def __init__(
        self,
        correction: OffPolicyCorrectionConfig,
        loss: PolicyLossConfig,
        compiled: bool = False,
        statistics: Callable[[CorrectionStats], Statistics] | None = None,
        steps_per_batch: int = 1,
    ) -> None:
        self.correction = correction
        self.loss = loss
        self.compiled = compiled
        self.statistics = statistics
        self.steps_per_batch = steps_per_batch
        # Built on first use (compiled graphs do not pickle): with and without the metric sums.
        self.graphs: dict[bool, FusedCorrectionStep] = {}
        #: Whether the correction runs here, per micro-batch (else once per batch, :meth:`correct_batch`).
        self.per_micro_batch = compiled or correction.correction_reads_current_policy
        #: Plain bypass mode: the ``rollout_corr/*`` metrics compare ``pi_theta`` with ``pi_rollout`` per
        #: micro-batch (``pi_prox := pi_rollout`` would make them 0; with a mask the correction itself
        #: already reads ``pi_theta``).
        self.metrics_from_current_policy = correction.bypass_mode and not correction.masks_read_current_policy
        # The route of every micro-batch, chosen here once: the compiled graph, or the eager functions
        # (after the micro-batch's own correction when it reads the current policy).
        self._loss = self._compiled_loss if compiled else self._eager_loss
        self._prox_from_theta = correction.prox_method == "loglinear"

    def correct_batch(
        self, rollout: RolloutBatch, prox: torch.Tensor | None, ref: torch.Tensor | None
    ) -> tuple[RolloutBatch, CorrectionStats | None]:
        """The batch with its ``prox`` / ``ref`` logprobs, and its correction unless that runs per micro-batch.

        Args:
            rollout: The step's rollouts.
            prox: ``[B, T]`` ``pi_prox`` logprobs (``None``: bypass mode, or computed per micro-batch).
            ref: ``[B, T]`` reference logprobs, when a reference KL loss is on.

        Returns:
            ``(batch, stats)``: ``stats`` of the whole batch's correction to record, else ``None``.
        """
        if self.per_micro_batch:
            return rollout.with_fields(prox_logprobs=prox, ref_logprobs=ref), None
        rollout, stats = step.apply_correction(rollout, prox, self.correction, ref)
        return rollout, None if self.metrics_from_current_policy else stats

    def __call__(
        self,
        logprobs: torch.Tensor,
        micro: RolloutBatch,
        token_count: torch.Tensor | float | None,
        sequence_count: torch.Tensor | float | None,
        entropy: torch.Tensor | None = None,
        record_correction: bool = False,
        step_version: int = 0,
    ) -> MicroStepOutput:
        """The loss of one micro-batch of a :meth:`correct_batch` batch.

        Args:
            logprobs: ``[B, T]`` ``pi_theta`` logprobs of ``micro`` (with gradient).
            micro: The micro-batch.
            token_count: The mini-batch's global token denominator.
            sequence_count: The mini-batch's global sequence denominator.
            entropy: ``[B, T]`` entropy with gradient, for ``loss.entropy_coef > 0``; else ``None``.
            record_correction: Also return the correction statistics (or their sums) to record.
            step_version: The policy version at the start of the step (``prox_method="loglinear"``).

        Returns:
            The loss, its info, and what to record of the correction.
        """
        if self._prox_from_theta:
            prox = step.loglinear_prox(micro, logprobs, step_version, self.steps_per_batch)
            micro = micro.with_fields(prox_logprobs=prox)
        stats = None
        if record_correction and self.metrics_from_current_policy:
            # The micro-batches of the first pass cover the batch once: their metrics add up to its.
            stats = step.current_policy_stats(micro, logprobs)
        return self._loss(logprobs, micro, token_count, sequence_count, entropy, record_correction, stats)

    def _compiled_loss(
        self,
        logprobs: torch.Tensor,
        micro: RolloutBatch,
        token_count: torch.Tensor | float | None,
        sequence_count: torch.Tensor | float | None,
        entropy: torch.Tensor | None,
        record_correction: bool,
        stats: CorrectionStats | None,
    ) -> MicroStepOutput:
        """The correction, the loss, its gradient and the metric sums in one compiled graph."""
        with_sums = record_correction and not self.metrics_from_current_policy
        fused = self._graph(with_sums)(
            logprobs, micro.prox_logprobs, micro.rollout_logprobs, micro.advantages, micro.response_mask,
            ref_logprobs=micro.ref_logprobs, token_count=token_count, sequence_count=sequence_count, entropy=entropy,
        )  # fmt: skip
        return MicroStepOutput(fused.loss, fused.info, stats, fused.statistics if with_sums else None)

    def _eager_loss(
        self,
        logprobs: torch.Tensor,
        micro: RolloutBatch,
        token_count: torch.Tensor | float | None,
        sequence_count: torch.Tensor | float | None,
        entropy: torch.Tensor | None,
        record_correction: bool,
        stats: CorrectionStats | None,
    ) -> MicroStepOutput:
        """The eager functions (:mod:`.step`), the reference; the micro-batch's own correction first when it
        reads the current policy (else the batch carries it, :meth:`correct_batch`)."""
        if self.correction.correction_reads_current_policy:
            numerator = self.correction.ratio_numerator(micro.prox_logprobs, logprobs)
            micro, own = step.apply_correction(micro, numerator, self.correction, micro.ref_logprobs)
            if record_correction:
                stats = own
        loss, info = step.corrected_loss(
            logprobs, micro, self.loss, self.correction, token_count, sequence_count, entropy
        )
        return MicroStepOutput(loss, info, stats)

    def _graph(self, with_sums: bool) -> FusedCorrectionStep:
        if with_sums not in self.graphs:
            self.graphs[with_sums] = FusedCorrectionStep(
                self.correction, self.loss, statistics=self.statistics if with_sums else None
            )
        return self.graphs[with_sums]
