"""Value checks of the pure-torch API's inputs: NaN never passes through a response token.

The contract (``docs/off_policy_correction.md``):

* **padding** (``response_mask == 0``) may hold anything, NaN and +-inf included: it is replaced
  before any arithmetic (:func:`~lightning_offpolicy.correction.ratios.masked`);
* **NaN at a response token** of a logprob tensor or of the advantages raises ``ValueError``
  naming the tensor and the first bad position ``(row, token)``: a NaN there would otherwise turn
  the loss, every weight and every metric state into NaN, silently;
* **+-inf at a response token** of ``rollout_logprobs`` / ``prox_logprobs`` / ``ref_logprobs`` is
  accepted (a logprob of -inf is a token one policy calls impossible): the log ratio becomes
  ``+-INFINITE_LOG_RATIO`` (clamped in every ``exp``, rejected by every mask), so the loss stays the
  clamped one and the metrics stay finite. The policy's own ``logprobs`` and the ``advantages``
  must be finite: an infinite one has no clamped loss (``-A * log pi`` is infinite).

Cost: one masked float64 sum per tensor and a single host synchronisation for all of them; the
position is searched only when a sum is not finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_offpolicy.correction.ratios import masked

#: ``(name, tensor or None, whether +-inf is also refused)``.
Checked = tuple[str, torch.Tensor | None, bool]


def check_response_values(who: str, response_mask: torch.Tensor, tensors: Sequence[Checked]) -> None:
    """Raise ``ValueError`` if a tensor holds NaN (or, where refused, +-inf) at a response token.

    Args:
        who: The function checked, for the message (``"policy_loss"``).
        response_mask: ``[B, T]``, non-zero at response tokens.
        tensors: ``(name, tensor, refuse_inf)``; a tensor is ``[B, T]`` (per token) or ``[B]``
            (per sequence: checked where the sequence has a response token); ``None`` is skipped.
            Shapes must have been checked already.
    """
    valid = response_mask.bool()
    present = [(name, t, refuse_inf) for name, t, refuse_inf in tensors if t is not None]
    if not present:
        return
    # A float64 sum over the response tokens is finite iff none of them is NaN or +-inf (a float32
    # tensor cannot overflow it): one reduction per tensor, one host sync for the lot.
    sums = torch.stack([masked(t.detach(), _where(t, valid)).sum(dtype=torch.float64) for _, t, _ in present])
    if bool(torch.isfinite(sums).all()):
        return
    for name, t, refuse_inf in present:
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


def _where(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The positions of ``tensor`` that are real: response tokens, or sequences with one (``[B]``)."""
    return valid.any(dim=-1) if tensor.dim() == 1 else valid
