"""Check that a weight sync arrived: the engine's logprobs of a fixed probe sequence against the trainer's.

:class:`SyncCheck` raises when they disagree by more than the engine's precision explains
(:class:`SyncTolerance`), or when the engine's did not move while the trainer's did (a sync that
silently never arrived: a known failure of LoRA syncs in peer frameworks). Exporting the weights
is :mod:`~lightning_offpolicy.rollout.vllm.sync.export` (and :mod:`~lightning_offpolicy.rollout.vllm.sync.peft_export`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

__all__ = [
    "SyncCheck",
    "SyncTolerance",
    "check_received",
    "probe_ids",
    "sync_tolerance",
    "trainer_probe_logprobs",
    "weights_dtype",
]

#: Length of the self-check's probe sequence (tokens).
PROBE_LENGTH = 32
_PROBE_SEED = 20240611


@dataclass(frozen=True)
class SyncTolerance:
    """The probe check's per-token bound: ``|engine_t - trainer_t| <= atol + rtol * |trainer_t|``.

    The relative part is there because an engine in reduced precision differs from a float32
    trainer in proportion to the size of the logits, not by a fixed amount: docs/metrics.md
    (``rollout/sync_probe_diff``) gives the measured differences and why the bound sits where it does.

    Attributes:
        atol: Absolute part (nats): the whole bound when engine and trainer are both float32.
        rtol: Relative part: ``16 * eps`` of the coarsest dtype of engine and trainer (bfloat16:
            0.125, float16: 0.0156), 0 when both are float32.
    """

    atol: float
    rtol: float = 0.0

    def bound(self, trainer: torch.Tensor) -> torch.Tensor:
        """The largest accepted |engine - trainer| of each probe token."""
        return self.atol + self.rtol * trainer.abs()

    def __str__(self) -> str:
        return f"{self.atol:g}" if self.rtol == 0 else f"{self.atol:g} + {self.rtol:g} * |trainer logprob|"


def weights_dtype(module: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most of ``module``'s parameter elements (a peft model: its base's).

    What an engine should compute in to sample the policy the trainer trains: a LoRA model's float32
    adapters around a bfloat16 base count as bfloat16.
    """
    counts: dict[torch.dtype, int] = {}
    for param in module.parameters():
        if param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    if not counts:
        raise ValueError(f"{type(module).__name__} has no floating-point parameters.")
    return max(counts, key=counts.__getitem__)


#: Safety factor over the machine epsilon of a reduced-precision dtype: an order of magnitude above
#: what a correct sync needs, far below what a wrong or partial sync moves.
_RTOL_EPS_FACTOR = 16.0


def sync_tolerance(engine_dtype: torch.dtype | None, module: torch.nn.Module, atol: float | None) -> SyncTolerance:
    """The probe check's bound for an engine computing in ``engine_dtype`` against ``module``.

    Args:
        engine_dtype: The engine's compute dtype (``None``: unknown, taken as bfloat16).
        module: The trainer's module (its parameters' dtype counts too).
        atol: The user's ``weight_sync.tolerance``; ``None``: ``1e-3`` when engine and trainer
            are both float32, else ``1.0``.
    """
    dtypes = [engine_dtype or torch.bfloat16, next(module.parameters()).dtype]
    reduced = [d for d in dtypes if d.is_floating_point and torch.finfo(d).bits < 32]
    if not reduced:
        return SyncTolerance(atol=1e-3 if atol is None else float(atol))
    eps = max(torch.finfo(d).eps for d in reduced)
    return SyncTolerance(atol=1.0 if atol is None else float(atol), rtol=_RTOL_EPS_FACTOR * eps)


def probe_ids(vocab_size: int, max_model_len: int) -> list[int]:
    """The fixed probe sequence of the sync self-check (same for every engine of a vocabulary)."""
    rng = random.Random(_PROBE_SEED)
    return [rng.randrange(vocab_size) for _ in range(min(PROBE_LENGTH, max_model_len - 1))]


@torch.no_grad()
def trainer_probe_logprobs(module: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    """The module's temperature-1 logprob of each probe token given the ones before it (float64, CPU)."""
    from lightning_offpolicy.logprobs import causal_lm_token_logprobs

    device = next(module.parameters()).device
    ids = torch.tensor([probe], device=device)
    was_training = module.training
    module.eval()
    try:
        lp = causal_lm_token_logprobs(module, ids, torch.ones_like(ids), response_start=1)
    except Exception as err:
        raise RuntimeError(
            "weight-sync check: scoring the probe sequence with the trainer's module failed "
            f"({err!r}); it needs a transformers causal LM. Pass weight_sync.check=False to skip the check."
        ) from err
    finally:
        module.train(was_training)
    return lp[0].double().cpu()


def check_received(answers: list[list[str] | None] | None, sent: int, who: str) -> None:
    """Raise when a worker's model has parameters that received nothing in a sync.

    Args:
        answers: Each engine worker's list of its model's parameters that got no tensor in the
            sync (``None``: the worker's model does not say what it loaded; nothing to check).
        sent: How many tensors the trainer sent, for the message.
        who: The engine's name.

    Raises:
        RuntimeError: Some parameter got no tensor: the engine would go on computing with its old
            values while the trainer moves on (docs/training.md, "Weight sync across model families").
    """
    missing = sorted({name for answer in answers or () if answer for name in answer})
    if not missing:
        return
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise RuntimeError(
        f"{who} weight sync: {len(missing)} of the engine's parameters received nothing from the {sent} "
        f"tensors the trainer sent ({shown}): the engine would go on sampling with their old values. The "
        "trainer's model lacks them or names them otherwise (a different architecture or a renamed module?). "
        "Nothing was stamped with the new version."
    )


class SyncCheck:
    """Compares an engine's probe logprobs with the trainer's after each sync.

    Two tests, both needed:

    * **agreement**: every probe token within :class:`SyncTolerance` (precision-aware); catches
      weights that arrived wrong (names, dtype, another model) and a sync that never arrived once
      the trainer has moved past the engine's precision;
    * **movement**: the engine's probe logprobs are a deterministic function of its weights. If
      they are bit-identical to those at the engine's last change while the trainer's moved since
      then by more than ``atol / 100`` on some token, the sync did not arrive. This test is exact,
      so it needs no precision margin: it catches a missed sync at once, however peaked the
      policy. (Could a reduced-precision engine round a real update away entirely? Only if not
      one weight crossed a rounding boundary. Measured on the tiny Llama with ``lm_head`` x30: a
      step of 1e-6 on every weight moved the trainer's probe by 0.034 nats and changed 10,374 of
      its 344,704 bfloat16 weights.) The reference stays at the
      engine's last change, so small movements below the threshold add up.

    Args:
        who: The engine's name, for the error messages.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.last_max_abs_diff: float | None = None
        self._prev_engine: torch.Tensor | None = None
        self._prev_trainer: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the previous probes (a restarted engine, or a sync that could not be checked)."""
        self.last_max_abs_diff = None
        self._prev_engine = self._prev_trainer = None

    def __call__(self, engine: torch.Tensor, trainer: torch.Tensor, tolerance: SyncTolerance | float) -> float:
        """Raise ``RuntimeError`` if the sync did not arrive; return the max |engine - trainer| (nats)."""
        if not isinstance(tolerance, SyncTolerance):
            tolerance = SyncTolerance(atol=float(tolerance))
        abs_diff = (engine - trainer).abs()
        diff = float(abs_diff.max())
        self.last_max_abs_diff = diff
        excess = abs_diff - tolerance.bound(trainer)
        if not math.isfinite(diff) or bool((excess > 0).any()):
            worst = int(excess.nan_to_num(nan=math.inf).argmax())
            raise RuntimeError(
                f"{self.who} weight-sync check failed: the engine's logprobs of a probe sequence differ from the "
                f"trainer's by up to {diff:.4g} (probe token {worst + 1}: engine {float(engine[worst]):.4g}, trainer "
                f"{float(trainer[worst]):.4g}; accepted: weight_sync.tolerance={tolerance}): the new weights did not "
                "arrive in the engine (or arrived wrong: parameter names / dtype). Nothing was stamped with the new "
                "version."
            )
        if self._prev_engine is not None and self._prev_trainer is not None and torch.equal(engine, self._prev_engine):
            trainer_moved = float((trainer - self._prev_trainer).abs().max())
            if trainer_moved > tolerance.atol / 100:
                raise RuntimeError(
                    f"{self.who} weight-sync check failed: the trainer's probe logprobs moved by up to "
                    f"{trainer_moved:.4g} since the engine's last changed but the engine's did not change at all: "
                    "the new weights did not arrive in the engine. Nothing was stamped with the new version."
                )
            return diff  # keep the reference at the engine's last change: small movements add up
        self._prev_engine, self._prev_trainer = engine, trainer
        return diff
