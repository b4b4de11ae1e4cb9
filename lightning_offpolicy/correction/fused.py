"""The correction, the policy loss and the batch statistics as one compiled step.

:func:`~lightning_offpolicy.correction.compute_correction` followed by
:func:`~lightning_offpolicy.correction.policy_loss` and a metric update touches some 80 ``[B, T]``
tensors in eager mode, each written to memory and read back. :class:`FusedCorrectionStep` runs the
same functions (:func:`~lightning_offpolicy.correction.correction.correct_log_ratio`, the loss
terms, and a statistics function such as ``CorrectionMetrics.sums``) under ``torch.compile``:
inductor fuses them into a few loops over the batch, the backward is compiled with them, and no
``[B, T]`` intermediate survives the step. The eager functions stay the reference: the fused step
calls them, and ``compiled=False`` runs them unchanged.

Only the rare inputs take the eager path: a NaN or an infinite logprob at a response token (the
finite check of the step's scalars sees it; the eager functions then raise the error that names the
tensor and token, or apply their infinite-logprob rule), and ``normalize_weights`` under
``torch.distributed`` (its batch mean is a collective between the correction and the loss).

>>> import torch
>>> from lightning_offpolicy.correction import OffPolicyCorrectionConfig
>>> step = FusedCorrectionStep(OffPolicyCorrectionConfig.token_tis(), compiled=False)
>>> logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
>>> out = step(logprobs, torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.2, -2.0]]), torch.tensor([1.0]),
...            torch.ones(1, 2))
>>> out.loss.backward(); logprobs.grad
tensor([[-0.6107, -0.5000]])
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from lightning_offpolicy.correction.config import OffPolicyCorrectionConfig, PolicyLossConfig, check_compatible
from lightning_offpolicy.correction.correction import (
    CorrectionStats,
    check_inputs,
    compute_correction,
    correct_log_ratio,
)
from lightning_offpolicy.correction.distributed import is_distributed
from lightning_offpolicy.correction.losses import (
    LossObjective,
    PolicyLossInfo,
    checked_loss_inputs,
    constants_of_the_step,
    entropy_bonus,
    loss_scalars,
    policy_loss,
    policy_loss_terms,
)
from lightning_offpolicy.correction.ratios import log_ratio

Statistics = dict[str, tuple[torch.Tensor, ...]]
"""Named tuples of scalar tensors computed from a batch's :class:`CorrectionStats` (e.g. metric sums)."""


@dataclass
class FusedStepOutput:
    """Result of one :class:`FusedCorrectionStep` call.

    Attributes:
        loss: the total loss (``policy_loss``'s first result), with gradient.
        info: ``policy_loss``'s :class:`~lightning_offpolicy.correction.PolicyLossInfo`.
        statistics: what the ``statistics`` function returned for this batch (``{}`` without one).
        compiled: whether the compiled graph produced it (``False``: the eager functions did).
    """

    loss: torch.Tensor
    info: PolicyLossInfo
    statistics: Statistics
    compiled: bool


class FusedCorrectionStep:
    """``compute_correction`` -> ``policy_loss`` -> statistics, compiled into one graph.

    Args:
        config: the correction (``None``: :meth:`OffPolicyCorrectionConfig.disabled`).
        loss_config: the surrogate and its aggregation (``None``: ``PolicyLossConfig()``).
        statistics: a function of the batch's :class:`CorrectionStats` returning named tuples of
            scalar tensors, computed inside the same graph, e.g. ``CorrectionMetrics(config).sums``
            (feed the result to ``CorrectionMetrics.update_from_sums``). It must not change state.
        compiled: ``False`` runs the eager functions, the reference the compiled graph is tested
            against.
        dynamic: passed to ``torch.compile``: ``None`` (default) compiles for the first shape and
            turns dynamic at the first new one, so batches of varying length reuse one graph.
        backend: ``torch.compile``'s backend: ``"inductor"`` (default: the fused loops) or e.g.
            ``"aot_eager"`` (the same traced graph run op by op: fast to build, for tests).

    Raises:
        CorrectionConfigError: ``config`` and ``loss_config`` do not combine (as ``policy_loss``).
    """

    def __init__(
        self,
        config: OffPolicyCorrectionConfig | None = None,
        loss_config: PolicyLossConfig | None = None,
        statistics: Callable[[CorrectionStats], Statistics] | None = None,
        compiled: bool = True,
        dynamic: bool | None = None,
        backend: str = "inductor",
    ) -> None:
        self.config = config if config is not None else OffPolicyCorrectionConfig.disabled()
        self.loss_config = loss_config if loss_config is not None else PolicyLossConfig()
        check_compatible(self.config, self.loss_config)
        self.statistics = statistics
        self.compiled = compiled
        self._objective = LossObjective(**self.config.policy_loss_kwargs())
        self._graph = torch.compile(_own_code(self._step), dynamic=dynamic, backend=backend) if compiled else None

    def __call__(
        self,
        logprobs: torch.Tensor,
        prox_logprobs: torch.Tensor | None,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        ref_logprobs: torch.Tensor | None = None,
        token_count: float | torch.Tensor | None = None,
        sequence_count: float | torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> FusedStepOutput:
        """One step; the arguments are :func:`policy_loss`'s (``prox_logprobs`` may be ``None``
        where the config needs no proximal forward).

        Raises:
            ValueError: as :func:`compute_correction` and :func:`policy_loss` (a shape, a missing
                tensor, or NaN at a response token, naming the tensor and the token).
        """
        cfg = self.config
        prox_logprobs, rollout_logprobs, ref_logprobs = constants_of_the_step(
            prox_logprobs, rollout_logprobs, ref_logprobs
        )
        # In bypass mode with a mask, the correction compares the current policy with pi_rollout.
        prox = cfg.ratio_numerator(prox_logprobs, logprobs)
        if self._graph is None:  # the eager functions check their inputs themselves
            return self._eager(
                logprobs, prox, rollout_logprobs, advantages, response_mask, ref_logprobs,
                token_count, sequence_count, entropy,
            )  # fmt: skip
        check_inputs(prox, rollout_logprobs, response_mask, cfg)
        # Advantages come back broadcast to [B, T].
        advantages, _ = checked_loss_inputs(
            logprobs, prox, rollout_logprobs, advantages, response_mask, self.loss_config, self._objective,
            ref_logprobs, entropy=entropy,
        )  # fmt: skip
        inputs = (logprobs, prox, rollout_logprobs, advantages, response_mask, ref_logprobs)
        if cfg.normalize_weights and is_distributed():
            return self._eager(*inputs, token_count, sequence_count, entropy)
        # Python numbers would be baked into the graph (one compilation per value): pass tensors.
        counts = [
            None if count is None else torch.as_tensor(count, dtype=torch.float32, device=logprobs.device)
            for count in (token_count, sequence_count)
        ]
        with torch.no_grad():
            detached = tuple(None if t is None else t.detach() for t in inputs)
            loss, grad, info, statistics, log_rho_sum = self._graph(*detached, *counts)
        if not _finite(loss, info, statistics, log_rho_sum):
            # NaN or an infinite logprob at a response token: the eager functions raise the error
            # that names it, or apply their rule for -inf.
            return self._eager(*inputs, token_count, sequence_count, entropy)
        if logprobs.requires_grad:
            loss = _LossWithGradient.apply(logprobs, loss, grad)
        if entropy is not None and self.loss_config.entropy_coef > 0:
            # Its gradient flows through the entropy, not the logprobs: added outside the graph.
            term = entropy_bonus(entropy, response_mask, self.loss_config, token_count, sequence_count)
            loss = loss - self.loss_config.entropy_coef * term
            info.entropy = term.detach()
        return FusedStepOutput(loss, info, statistics, compiled=True)

    def _step(
        self,
        logprobs: torch.Tensor,
        prox_logprobs: torch.Tensor | None,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        token_count: torch.Tensor | None,
        sequence_count: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, PolicyLossInfo, Statistics, torch.Tensor]:
        """The graph that is compiled: the eager functions minus their host-synchronising checks.

        The gradient with respect to ``logprobs`` is computed here too (``torch.func``), in the same
        graph: nothing is saved for a backward pass but that one ``[B, T]`` tensor.
        """
        valid = response_mask.bool()
        log_rho = (
            torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
            if prox_logprobs is None
            else log_ratio(prox_logprobs, rollout_logprobs, valid).float()
        )
        correction = correct_log_ratio(log_rho, valid, self.config)
        statistics = self.statistics(correction.stats) if self.statistics is not None else {}

        def loss_of(theta: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
            loss, info = policy_loss_terms(
                theta, prox_logprobs, rollout_logprobs, advantages, response_mask, self.loss_config,
                correction.weights, correction.mask, self._objective, ref_logprobs, token_count, sequence_count,
            )  # fmt: skip
            # torch.func carries plain containers of tensors only.
            return loss, (
                loss,
                {f.name: getattr(info, f.name) for f in fields(info) if getattr(info, f.name) is not None},
            )

        grad, (loss, info) = torch.func.grad(loss_of, has_aux=True)(logprobs)
        return loss, grad, PolicyLossInfo(**info), statistics, log_rho.sum()

    def _eager(
        self,
        logprobs: torch.Tensor,
        prox_logprobs: torch.Tensor | None,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        token_count: float | torch.Tensor | None,
        sequence_count: float | torch.Tensor | None,
        entropy: torch.Tensor | None = None,
    ) -> FusedStepOutput:
        correction = compute_correction(prox_logprobs, rollout_logprobs, response_mask, self.config)
        loss, info = policy_loss(
            logprobs, prox_logprobs, rollout_logprobs, advantages, response_mask, self.loss_config,
            correction=correction, ref_logprobs=ref_logprobs, token_count=token_count, sequence_count=sequence_count,
            entropy=entropy,
        )  # fmt: skip
        with torch.no_grad():
            statistics = self.statistics(correction.stats) if self.statistics is not None else {}
        return FusedStepOutput(loss, info, statistics, compiled=False)


class _LossWithGradient(torch.autograd.Function):
    """``loss`` as a function of ``logprobs`` whose gradient was computed with it: backward is one multiply."""

    @staticmethod
    def forward(ctx, logprobs: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


def _finite(loss: torch.Tensor, info: PolicyLossInfo, statistics: Statistics, log_rho_sum: torch.Tensor) -> bool:
    """One host sync: the loss, its sums and ``sum(log_rho)`` finite, and no statistic NaN.

    A NaN or an infinity at a response token of ``logprobs``, ``advantages`` or a logprob the loss
    reads reaches the loss or a sum of ``info``; one in ``prox`` / ``rollout`` reaches the sum of
    ``log_rho``. Statistics that are maxima or minima may be +-inf legitimately (an empty batch), so
    only NaN is refused there.
    """
    scalars = [*loss_scalars(loss, info), log_rho_sum]
    others = [value for values in statistics.values() for value in values]
    finite = torch.isfinite(torch.stack([s.to(torch.float64) for s in scalars])).all()
    if others:
        finite = finite & ~torch.isnan(torch.stack([o.to(torch.float64).reshape(()) for o in others])).any()
    return bool(finite)


def _own_code(method: Callable) -> Callable:
    """``method`` with a code object of its own.

    Dynamo keeps compiled graphs on the code object, up to a small recompile limit: one code
    object per step (per configuration) keeps every preset's graph in its own cache.
    """
    function = method.__func__
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(copy, method.__self__)
