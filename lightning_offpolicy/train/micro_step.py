"""The correction and the policy loss of one micro-batch, behind one call.

:class:`MicroBatchStep` is what the PPO update (:mod:`.update`) runs between a micro-batch's forward
and its backward. Where the correction runs is chosen once, at construction: once per batch before
the passes (:meth:`MicroBatchStep.correct_batch`, the eager functions of :mod:`.step`), or per
micro-batch after its forward, when it is compiled or reads the current policy. The per-micro-batch
route is :class:`~lightning_offpolicy.correction.fused.FusedCorrectionStep`: correction, loss and
metric sums in one ``torch.compile``'d graph, or, with ``compiled=False``, the same eager functions
it falls back to. See docs/training.md for when the correction runs per micro-batch.
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
        sums: Metric sums of the micro-batch's own correction (``None``: none, or not asked for).
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
        statistics: The metric sums of a correction that runs per micro-batch (e.g.
            ``CorrectionMetrics(correction).sums``), computed with its loss; ``None``: not recorded.
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
        #: The per-micro-batch steps built so far, with and without the metric sums (on first use:
        #: compiled graphs do not pickle).
        self.graphs: dict[bool, FusedCorrectionStep] = {}
        #: Whether the correction runs here, per micro-batch (else once per batch, :meth:`correct_batch`).
        self.per_micro_batch = compiled or correction.correction_reads_current_policy
        #: Plain bypass mode: the ``rollout_corr/*`` metrics compare ``pi_theta`` with ``pi_rollout`` per
        #: micro-batch (``pi_prox := pi_rollout`` would make them 0; with a mask the correction itself
        #: already reads ``pi_theta``).
        self.metrics_from_current_policy = correction.bypass_mode and not correction.masks_read_current_policy
        # The route of every micro-batch, chosen here once.
        self._loss = self._micro_batch_correction_loss if self.per_micro_batch else self._batch_correction_loss
        self._with_prox = self._loglinear_prox if correction.prox_method == "loglinear" else _as_it_is

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
        micro = self._with_prox(micro, logprobs, step_version)
        out = self._loss(logprobs, micro, token_count, sequence_count, entropy, record_correction)
        if record_correction and self.metrics_from_current_policy:
            # The micro-batches of the first pass cover the batch once: their metrics add up to its.
            out.stats = step.current_policy_stats(micro, logprobs)
        return out

    def _micro_batch_correction_loss(
        self,
        logprobs: torch.Tensor,
        micro: RolloutBatch,
        token_count: torch.Tensor | float | None,
        sequence_count: torch.Tensor | float | None,
        entropy: torch.Tensor | None,
        record_correction: bool,
    ) -> MicroStepOutput:
        """The micro-batch's own correction, its loss and gradient (and the metric sums), compiled or eager."""
        with_sums = record_correction and self.statistics is not None and not self.metrics_from_current_policy
        fused = self._graph(with_sums)(
            logprobs, micro.prox_logprobs, micro.rollout_logprobs, micro.advantages, micro.response_mask,
            ref_logprobs=micro.ref_logprobs, token_count=token_count, sequence_count=sequence_count, entropy=entropy,
        )  # fmt: skip
        return MicroStepOutput(fused.loss, fused.info, sums=fused.statistics if with_sums else None)

    def _batch_correction_loss(
        self,
        logprobs: torch.Tensor,
        micro: RolloutBatch,
        token_count: torch.Tensor | float | None,
        sequence_count: torch.Tensor | float | None,
        entropy: torch.Tensor | None,
        record_correction: bool,
    ) -> MicroStepOutput:
        """The loss of a slice of a batch that carries its correction (:meth:`correct_batch`)."""
        loss, info = step.corrected_loss(
            logprobs, micro, self.loss, self.correction, token_count, sequence_count, entropy
        )
        return MicroStepOutput(loss, info)

    def _loglinear_prox(self, micro: RolloutBatch, logprobs: torch.Tensor, step_version: int) -> RolloutBatch:
        prox = step.loglinear_prox(micro, logprobs, step_version, self.steps_per_batch)
        return micro.with_fields(prox_logprobs=prox)

    def _graph(self, with_sums: bool) -> FusedCorrectionStep:
        if with_sums not in self.graphs:
            self.graphs[with_sums] = FusedCorrectionStep(
                self.correction, self.loss, statistics=self.statistics if with_sums else None, compiled=self.compiled
            )
        return self.graphs[with_sums]


def _as_it_is(micro: RolloutBatch, logprobs: torch.Tensor, step_version: int) -> RolloutBatch:
    """The micro-batch unchanged: its ``pi_prox`` came with the batch (or bypass mode has none)."""
    return micro
