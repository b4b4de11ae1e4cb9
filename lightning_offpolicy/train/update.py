"""The PPO update of one rollout batch: epochs x mini-batches x micro-batches, without Lightning.

Read it as cleanrl's ``ppo.py`` update::

    pi_prox = forward(batch) without gradient          # or the first step's own forward, detached
    correct(batch)                                     # IS weights, rejection masks (per micro-batch when compiled)
    for epoch in range(ppo_epochs):
        for minibatch in batch.split(num_minibatches):  # shuffled rows
            for micro in minibatch.micro_batches(max_tokens):
                loss = step(forward(micro), micro)       # MicroBatchStep: correction + surrogate
                backward(loss)                           # gradients accumulate; synced on the last
            optimizer_step()                             # clip, step, zero_grad, scheduler

The loss of every micro-batch is normalised by the mini-batch's global token and sequence counts,
so accumulation over micro-batches and ranks gives the exact global mean. What belongs to the
trainer (the forward, the backward, gradient sync, the optimizer, collectives) comes in through
:class:`UpdateHooks`; what is recorded goes out through :class:`UpdateRecorder`. See
docs/training.md.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.correction import CorrectionStats, PolicyLossInfo
from lightning_offpolicy.correction.fused import Statistics
from lightning_offpolicy.train.micro_step import MicroBatchStep

Forward = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""Teacher-forced ``[B, T]`` logprobs, or ``(logprobs, entropy)``."""


class UpdateHooks(Protocol):
    """What the trainer around the update provides (the Lightning side implements it)."""

    world_size: int
    """Processes the gradients are averaged over."""

    def forward(self, batch: RolloutBatch, return_entropy: bool) -> Forward:
        """The policy's teacher-forced logprobs of ``batch`` (and entropies), with gradient."""

    def no_grad_forward(self, batch: RolloutBatch, reference: bool) -> torch.Tensor:
        """``[B, T]`` logprobs of one micro-batch (called under ``torch.no_grad``): the policy's, or the reference's."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of one micro-batch's loss."""

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[None]:
        """A context in which the backward syncs gradients across ranks only when ``enabled``."""

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step the optimizer and the scheduler, zero the gradients; return the gradient norm."""

    def global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks."""

    def global_max(self, value: int) -> int:
        """``value``'s maximum over ranks."""


class UpdateRecorder(Protocol):
    """Where the update's per-step statistics go (metric states, e.g. torchmetrics)."""

    def entropy(self, values: torch.Tensor) -> None:
        """The entropies of one micro-batch's response tokens (flat; may be empty)."""

    def correction(self, stats: CorrectionStats) -> None:
        """The correction statistics of a batch or a micro-batch."""

    def correction_sums(self, sums: Statistics) -> None:
        """The metric sums a compiled step computed from its correction statistics."""

    def losses(self, info: PolicyLossInfo) -> None:
        """One micro-batch's policy-loss statistics."""


@dataclass(frozen=True)
class Record:
    """What one optimizer step records.

    Attributes:
        losses: The policy-loss statistics of every micro-batch.
        entropy: The entropy of every response token (costs the forward's entropy output).
        correction: The correction statistics (on the first pass, which covers the batch once).
    """

    losses: bool = False
    entropy: bool = False
    correction: bool = False

    @classmethod
    def of_pass(cls, logging: bool, epoch: int) -> Record:
        """On a logging step: the losses of every pass, the entropy and correction of the first."""
        return cls(losses=logging, entropy=logging and epoch == 0, correction=logging and epoch == 0)


@dataclass
class UpdateResult:
    """What one :meth:`PPOUpdate.__call__` did.

    Attributes:
        grad_norms: The gradient norm before clipping of each optimizer step.
        trained_tokens: Response tokens of this rank trained on, over all passes.
    """

    grad_norms: list[torch.Tensor] = field(default_factory=list)
    trained_tokens: int = 0


class PPOUpdate:
    """``ppo_epochs`` x ``num_minibatches`` optimizer steps over one rollout batch.

    Args:
        step: The per-micro-batch correction and loss.
        ppo_epochs: Passes over the batch.
        num_minibatches: Optimizer steps per pass (the rows are split this many ways).
        max_tokens_per_microbatch: Token budget of one forward/backward: real tokens when ``packed``,
            padded ones (``rows x longest``) otherwise (``None``: each mini-batch in one micro-batch).
        shuffle_minibatches: Shuffle the rows before each pass's mini-batch split.
        seed: Seed of the shuffles (with the policy version and the epoch).
        packed: Budget micro-batches by their real tokens, for a forward that packs them
            (``hooks.forward`` runs the rows as one padding-free sequence); the owner sets it once
            it knows the model.
    """

    def __init__(
        self,
        step: MicroBatchStep,
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        max_tokens_per_microbatch: int | None = None,
        shuffle_minibatches: bool = True,
        seed: int = 0,
        packed: bool = False,
    ) -> None:
        self.step = step
        self.ppo_epochs = ppo_epochs
        self.num_minibatches = num_minibatches
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.shuffle_minibatches = shuffle_minibatches
        self.seed = seed
        self.packed = packed

    @property
    def entropy_in_loss(self) -> bool:
        """Whether the loss has an entropy bonus: the forward then returns the entropy every step."""
        return self.step.loss.entropy_coef > 0

    def micro_batch_rows(self, batch: RolloutBatch) -> list[list[int]]:
        """Row indices of each of ``batch``'s micro-batches."""
        if self.max_tokens_per_microbatch is None:
            return [list(range(batch.num_sequences))]
        return batch.micro_batch_rows(self.max_tokens_per_microbatch, packed=self.packed)

    def fits_one_forward(self, batch: RolloutBatch, hooks: UpdateHooks) -> bool:
        """Whether the first optimizer step covers ``batch`` in one micro-batch on every rank.

        Then ``pi_prox`` (the weights at the start of the batch) is that forward's output,
        detached, and the no-gradient forward is skipped, as TRL and verl do when a batch makes a
        single optimizer step.
        """
        return self.num_minibatches == 1 and hooks.global_max(len(self.micro_batch_rows(batch))) == 1

    @torch.no_grad()
    def no_grad_logprobs(self, batch: RolloutBatch, hooks: UpdateHooks, reference: bool) -> torch.Tensor:
        """``[B, T]`` logprobs of the whole ``batch`` without gradient (``pi_prox``, or the reference's with
        ``reference``), micro-batch by micro-batch; every rank runs as many forwards (sharded ones are
        collectives), with padding micro-batches where it has fewer."""
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.device)
        rows = self.micro_batch_rows(batch)
        micro_batches = batch.micro_batches(
            self.max_tokens_per_microbatch or 1, num_micro_batches=hooks.global_max(len(rows)), rows=rows
        )
        for index, micro in enumerate(micro_batches):
            logprobs = hooks.no_grad_forward(micro, reference)
            if index < len(rows):  # a padding micro-batch's forward runs (a collective); its output is dropped
                out[torch.as_tensor(rows[index], device=out.device), : logprobs.shape[1]] = logprobs.float()
        return out

    def __call__(
        self,
        rollout: RolloutBatch,
        hooks: UpdateHooks,
        recorder: UpdateRecorder,
        *,
        logging: bool,
        step_version: int,
    ) -> UpdateResult:
        """Train on one rollout batch.

        Args:
            rollout: The batch, on the policy's device, validated.
            hooks: The trainer's forward, backward, optimizer and collectives.
            recorder: Where the statistics go (only on ``logging`` steps).
            logging: Whether this step's statistics are recorded.
            step_version: The policy version at the start of the step (one per optimizer step).

        Returns:
            The gradient norms and the number of trained tokens.
        """
        correction = self.step.correction
        first_forward = prox = None
        if correction.needs_prox:
            if self.fits_one_forward(rollout, hooks):
                first_forward, prox = prox_from_first_forward(rollout, hooks, logging or self.entropy_in_loss)
            else:
                prox = self.no_grad_logprobs(rollout, hooks, reference=False)
        ref = self.no_grad_logprobs(rollout, hooks, reference=True) if self.step.loss.ref_kl_coef > 0 else None
        rollout, stats = self.step.correct_batch(rollout, prox, ref)
        if logging and stats is not None:
            recorder.correction(stats)
        result = UpdateResult()
        for epoch in range(self.ppo_epochs):
            generator = None
            if self.shuffle_minibatches and self.num_minibatches > 1:
                version = step_version + epoch * self.num_minibatches
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + version * 101 + epoch)
            for minibatch in rollout.split(self.num_minibatches, generator):
                grad_norm = self.optimizer_step(
                    minibatch,
                    hooks,
                    recorder,
                    Record.of_pass(logging, epoch),
                    first_forward if epoch == 0 else None,
                    step_version,
                )
                result.grad_norms.append(grad_norm)
                result.trained_tokens += minibatch.num_response_tokens
        return result

    def optimizer_step(
        self,
        minibatch: RolloutBatch,
        hooks: UpdateHooks,
        recorder: UpdateRecorder,
        record: Record,
        first_forward: Forward | None,
        step_version: int,
    ) -> torch.Tensor:
        """One optimizer step over ``minibatch``, micro-batch by micro-batch.

        Args:
            minibatch: The rows of this step, carrying their correction (:meth:`MicroBatchStep.correct_batch`).
            hooks: The trainer's forward, backward, optimizer and collectives.
            recorder: Where the statistics go.
            record: What this step records.
            first_forward: The forward of the whole mini-batch, already run (``pi_prox`` came from it).
            step_version: The policy version at the start of the step.

        Returns:
            The gradient norm before clipping.

        Raises:
            RuntimeError: ``first_forward`` is given but the mini-batch needs several micro-batches.
        """
        mask = minibatch.response_mask
        counts = torch.tensor([mask.sum(), (mask.sum(-1) > 0).sum()], dtype=torch.float64, device=mask.device)
        # Gradients are averaged over ranks: dividing by count / world gives the exact global mean.
        token_count, sequence_count = (hooks.global_sum(counts) / hooks.world_size).float()
        rows = self.micro_batch_rows(minibatch)
        # Every rank runs as many micro-batches (padding ones where it has fewer); the rows are given,
        # so the token budget is not read again.
        micro_batches = minibatch.micro_batches(
            self.max_tokens_per_microbatch or 1, num_micro_batches=hooks.global_max(len(rows)), rows=rows
        )
        if first_forward is not None and len(micro_batches) != 1:
            raise RuntimeError("PPOUpdate: a precomputed forward needs a single micro-batch.")
        for index, micro in enumerate(micro_batches):
            with hooks.gradient_sync(index == len(micro_batches) - 1):
                forward = first_forward
                if forward is None:
                    forward = hooks.forward(micro, return_entropy=record.entropy or self.entropy_in_loss)
                logprobs, entropy = forward if isinstance(forward, tuple) else (forward, None)
                if record.entropy:
                    # Every rank records, even nothing: the metric's compute() is a collective.
                    recorder.entropy(entropy.detach()[micro.response_mask.bool()].float())
                out = self.step(
                    logprobs,
                    micro,
                    token_count,
                    sequence_count,
                    entropy=entropy if self.entropy_in_loss else None,
                    record_correction=record.correction,
                    step_version=step_version,
                )
                if out.stats is not None:
                    recorder.correction(out.stats)
                if out.sums is not None:
                    recorder.correction_sums(out.sums)
                hooks.backward(out.loss)
            if record.losses:
                recorder.losses(out.info)
        return hooks.optimizer_step()


def prox_from_first_forward(
    rollout: RolloutBatch, hooks: UpdateHooks, with_entropy: bool
) -> tuple[Forward, torch.Tensor]:
    """The first optimizer step's forward (with gradient) and ``pi_prox``, its detached ``[B, T]`` copy.

    Args:
        rollout: The whole batch (one micro-batch, one mini-batch).
        hooks: The trainer's forward.
        with_entropy: Also return the entropy from the forward.
    """
    first_forward = hooks.forward(rollout.trim(), return_entropy=with_entropy)
    logprobs = first_forward[0] if with_entropy else first_forward
    prox = torch.zeros(rollout.response_mask.shape, dtype=torch.float32, device=rollout.device)
    prox[:, : logprobs.shape[1]] = logprobs.detach().float()
    return first_forward, prox
