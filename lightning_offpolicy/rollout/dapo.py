"""DAPO's sampling and length handling (Yu et al. 2025, "DAPO"; verl's ``filter_groups`` and
``overlong_buffer``): dynamic sampling, overlong filtering and the soft overlong punishment.

* **Dynamic sampling.** A group whose rewards all equal each other (all correct, all wrong) has
  zero advantage under every group estimator: it costs a forward and backward and teaches nothing.
  Such groups are dropped and the batch is refilled, up to its number of groups, with groups
  sampled from further prompts, at most ``max_refill_batches`` extra generation calls per batch.
* **Overlong filtering.** A completion cut at ``max_new_tokens`` (finish reason ``"length"``) is
  left out of the loss: its reward still counts in its group's baseline, but none of its tokens
  reaches the numerator or the denominator.
* **Soft overlong punishment.** Within the last ``overlong_buffer`` tokens before
  ``max_new_tokens`` the reward is lowered linearly, down to ``-overlong_penalty_factor`` at the
  limit: ``penalty = -factor * (L - (L_max - buffer)) / buffer`` for ``L > L_max - buffer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_offpolicy.argcheck import is_int, is_number

__all__ = ["DAPOSettings", "informative_rows", "overlong_penalty"]


@dataclass(frozen=True)
class DAPOSettings:
    """What of DAPO a rollout uses (all off by default).

    Args:
        dynamic_sampling: Drop the groups whose rewards all equal each other and refill the batch
            from further train prompts (``rollout/groups_dropped``).
        max_refill_batches: Most extra generation calls per batch to refill it.
        overlong_filter: Leave completions cut at ``max_new_tokens`` out of the loss.
        overlong_buffer: Tokens before ``max_new_tokens`` where the reward is lowered linearly (0: off).
        overlong_penalty_factor: The punishment at ``max_new_tokens`` (subtracted from the reward).

    Raises:
        ValueError: A setting is out of range; the message names it and what is allowed.
    """

    dynamic_sampling: bool = False
    max_refill_batches: int = 4
    overlong_filter: bool = False
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("dynamic_sampling", "overlong_filter"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DAPOSettings.{name}={getattr(self, name)!r} must be True or False.")
        if not is_int(self.max_refill_batches) or self.max_refill_batches < 0:
            raise ValueError(
                f"DAPOSettings.max_refill_batches={self.max_refill_batches!r} must be an int >= 0 (extra generation "
                "calls per batch to refill the groups dynamic sampling dropped)."
            )
        if not is_int(self.overlong_buffer) or self.overlong_buffer < 0:
            raise ValueError(
                f"DAPOSettings.overlong_buffer={self.overlong_buffer!r} must be an int >= 0 (the tokens before "
                "max_new_tokens where the reward is lowered; 0: off)."
            )
        if not is_number(self.overlong_penalty_factor) or self.overlong_penalty_factor < 0:
            raise ValueError(
                f"DAPOSettings.overlong_penalty_factor={self.overlong_penalty_factor!r} must be a number >= 0."
            )

    def check(self, max_new_tokens: int, samples_per_prompt: int) -> None:
        """Check the settings against the sampling's.

        Raises:
            ValueError: ``overlong_buffer`` exceeds ``max_new_tokens``, or dynamic sampling meets
                groups of one sample.
        """
        if self.overlong_buffer > max_new_tokens:
            raise ValueError(
                f"DAPOSettings.overlong_buffer={self.overlong_buffer!r} must be an int in [0, max_new_tokens="
                f"{max_new_tokens}] (the tokens before the limit where the reward is lowered; 0: off)."
            )
        if self.dynamic_sampling and samples_per_prompt < 2:
            raise ValueError(
                "DAPOSettings.dynamic_sampling=True needs samples_per_prompt >= 2: a group of one sample "
                "always has equal rewards, so every group would be dropped."
            )


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per completion (``<= 0``), float64.

    0 up to ``max_new_tokens - buffer`` tokens, then linear down to ``-factor`` at ``max_new_tokens``.
    """
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_new_tokens - buffer
    return -factor * ((lengths - start).clamp(min=0.0) / buffer).clamp(max=1.0)


def informative_rows(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the rows whose group's rewards are not all equal (a group of one is not informative)."""
    keep = torch.zeros(rewards.shape, dtype=torch.bool)
    for group in group_ids.unique():
        rows = group_ids == group
        values = rewards[rows]
        keep[rows] = bool((values != values[0]).any())
    return keep
