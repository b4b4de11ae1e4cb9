"""The Lightning side: the module and the mixin, the rollout callback, checkpoints, preemption, the
progress bar and step logging.

Names load on first use (PEP 562), as the package's own top-level names do.
"""

from __future__ import annotations

from lightning_offpolicy._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "OffPolicyRLModule": "lightning_offpolicy.lightning.module",
    "OffPolicyMixin": "lightning_offpolicy.lightning.mixin",
    "RolloutCallback": "lightning_offpolicy.lightning.callback",
    "PeriodicCheckpoint": "lightning_offpolicy.lightning.checkpointing",
    "PreemptionCheckpoint": "lightning_offpolicy.lightning.preemption",
    "RLProgressBar": "lightning_offpolicy.lightning.progress",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
