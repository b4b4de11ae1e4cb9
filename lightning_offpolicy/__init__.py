"""lightning_offpolicy: off-policy-corrected reinforcement learning of language models with PyTorch Lightning.

The names a user starts from, importable from here::

    from lightning_offpolicy import OffPolicyRLModule, RolloutCallback, VLLMEngine

Everything else is imported from its subpackage (``lightning_offpolicy.correction``,
``lightning_offpolicy.metrics``, ``lightning_offpolicy.data``, ``lightning_offpolicy.rollout``,
``lightning_offpolicy.lightning``, ...); docs/architecture.md says which package holds what.

Names load on first use (PEP 562), so ``import lightning_offpolicy`` and the pure-torch
``lightning_offpolicy.correction`` stay light: Lightning, transformers and vLLM are imported only by
the parts that need them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from lightning_offpolicy._lazy import lazy_exports

try:
    __version__ = version("lightning_offpolicy")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0.0.0"

#: Public name -> the package that exports it. The only list: ``__all__`` is derived from it, and
#: tests/test_public_api.py checks that the ``TYPE_CHECKING`` imports below name the same objects.
_EXPORTS: dict[str, str] = {
    # Training: the module, or RL added to your own SFT module; the callback that feeds them rollouts.
    "OffPolicyRLModule": "lightning_offpolicy.lightning",
    "OffPolicyMixin": "lightning_offpolicy.lightning",
    "RolloutCallback": "lightning_offpolicy.lightning",
    "RLProgressBar": "lightning_offpolicy.lightning",
    # Rollout engines and their sampling settings.
    "SamplingConfig": "lightning_offpolicy.rollout",
    "HFEngine": "lightning_offpolicy.rollout",
    "VLLMEngine": "lightning_offpolicy.rollout",
    "RemoteVLLMEngine": "lightning_offpolicy.rollout",
    # The correction and the loss (pure torch).
    "OffPolicyCorrectionConfig": "lightning_offpolicy.correction",
    "PolicyLossConfig": "lightning_offpolicy.correction",
    # Prompts: the built-in tasks, or your own data.
    "PromptDataModule": "lightning_offpolicy.data.tasks",
    "DatasetDataModule": "lightning_offpolicy.data",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:  # type checkers and IDEs do not run __getattr__: the same names, imported eagerly
    from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig  # noqa: F401
    from lightning_offpolicy.data import DatasetDataModule  # noqa: F401
    from lightning_offpolicy.data.tasks import PromptDataModule  # noqa: F401
    from lightning_offpolicy.lightning.callback import RolloutCallback  # noqa: F401
    from lightning_offpolicy.lightning.mixin import OffPolicyMixin  # noqa: F401
    from lightning_offpolicy.lightning.module import OffPolicyRLModule  # noqa: F401
    from lightning_offpolicy.lightning.progress import RLProgressBar  # noqa: F401
    from lightning_offpolicy.rollout import HFEngine, RemoteVLLMEngine, SamplingConfig, VLLMEngine  # noqa: F401
