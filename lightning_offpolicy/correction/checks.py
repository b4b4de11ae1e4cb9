"""Value checks of the pure-torch API's inputs: NaN never passes through a response token.

The contract (``docs/off_policy_correction.md``):

* **padding** (``response_mask == 0``) may hold anything, NaN and +-inf included: it is replaced
  before any arithmetic (:func:`~lightning_offpolicy.correction.ratios.masked`);
* **NaN at a response token** of a logprob tensor or of the advantages raises ``ValueError``
  naming the tensor and the first bad position ``(row, token)``: a NaN there would otherwise turn
  the loss, every weight and every metric state into NaN, silently;
* **+-inf at a response token** of ``rollout_logprobs`` / ``prox_logprobs`` / ``ref_logprobs`` is
  accepted (a logprob of -inf is a token one policy calls impossible): it counts as
  ``-INFINITE_LOG_RATIO`` (-1e6), so the log ratio is about +-1e6 (clamped in every ``exp``,
  rejected by every mask), the loss stays the clamped one and the metrics stay finite. The
  policy's own ``logprobs`` and the ``advantages`` must be finite: an infinite one has no clamped
  loss (``-A * log pi`` is infinite).

Cost: the callers do not scan their inputs. ``compute_correction`` checks the sum of its log
ratios, ``policy_loss`` the loss and its statistics: a NaN (or infinity) at a response token shows
there, for one host synchronisation per call. Only then does :func:`check_response_values` search
the inputs, raise or report the infinities, and the caller recomputes with
:func:`~lightning_offpolicy.correction.ratios.finite_logprobs`. (A NaN in ``logprobs`` or the
advantages at a token a rejection mask removed reaches nothing, so it is not searched for.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: ``(name, tensor or None, whether +-inf is also refused)``.
Checked = tuple[str, torch.Tensor | None, bool]


def check_response_values(who: str, response_mask: torch.Tensor, tensors: Sequence[Checked]) -> set[str]:
    """Raise ``ValueError`` if a tensor holds NaN (or, where refused, +-inf) at a response token (the slow path).

    Args:
        who: The function checked, for the message (``"policy_loss"``).
        response_mask: ``[B, T]``, non-zero at response tokens.
        tensors: ``(name, tensor, refuse_inf)``; a tensor is ``[B, T]`` (per token) or ``[B]``
            (per sequence: checked where the sequence has a response token); ``None`` is skipped.
            Shapes must have been checked already.

    Returns:
        The names of the (accepted) tensors holding +-inf at a response token: the caller makes
        them finite (:func:`~lightning_offpolicy.correction.ratios.finite_logprobs`).
    """
    valid = response_mask.bool()
    infinite = set()
    for name, t, refuse_inf in tensors:
        if t is None:
            continue
        t = t.detach()
        where = _where(t, valid)
        bad = (~torch.isfinite(t) if refuse_inf else torch.isnan(t)) & where
        if bool(bad.any()):
            position = tuple(int(i) for i in bad.nonzero()[0])
            value = float(t[position])
            at = f"row {position[0]}" if len(position) == 1 else f"row {position[0]}, token {position[1]}"
            allowed = "finite values" if refuse_inf else "no NaN (+-inf is clamped)"
            raise ValueError(
                f"{who}: {name} is {value} at a response token ({at}; response_mask is 1 there). Response tokens "
                f"need {allowed}; only padding (response_mask 0) may hold anything. Check what produced {name} "
                "(the engine's logprobs, the trainer's forward pass, the reward / advantage computation)."
            )
        if bool((torch.isinf(t) & where).any()):
            infinite.add(name)
    return infinite


def _where(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The positions of ``tensor`` that are real: response tokens, or sequences with one (``[B]``)."""
    return valid.any(dim=-1) if tensor.dim() == 1 else valid
