"""The Lightning side: the module and the mixin, the rollout callback, checkpoints, preemption, the
progress bar and step logging.

Names load on first use (PEP 562), as the package's own top-level names do.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "OffPolicyRLModule": "lightning_offpolicy.lightning.module",
    "OffPolicyMixin": "lightning_offpolicy.lightning.mixin",
    "RolloutCallback": "lightning_offpolicy.lightning.callback",
    "PeriodicCheckpoint": "lightning_offpolicy.lightning.checkpointing",
    "PreemptionCheckpoint": "lightning_offpolicy.lightning.preemption",
    "RLProgressBar": "lightning_offpolicy.lightning.progress",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_offpolicy.lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
