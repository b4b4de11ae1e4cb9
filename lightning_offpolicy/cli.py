"""Console script ``lightning-offpolicy``: a ``LightningCLI`` for off-policy RL fits.

    lightning-offpolicy fit --config configs/quickstart.yaml
    lightning-offpolicy fit --config configs/quickstart.yaml --config configs/correction/geo_mis.yaml
    lightning-offpolicy fit --print_config
    lightning-offpolicy selfcheck          # every correction preset on a real tiny model, no training

Config groups: ``model`` (:class:`~lightning_offpolicy.module.OffPolicyRLModule`), ``data``
(a LightningDataModule yielding ``PromptBatch``, default
:class:`~lightning_offpolicy.tasks.PromptDataModule`), ``rollout``
(:class:`~lightning_offpolicy.rollout.RolloutCallback`, always added), ``trainer``.
``model.temperature`` is linked to ``rollout.temperature``: the trainer scores tokens with the
temperature the engine samples with. Unless the config names a progress bar, the training bar is
:class:`~lightning_offpolicy.progress.RLProgressBar` (batches, with the optimizer step in the postfix).
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_offpolicy.module import OffPolicyRLModule
from lightning_offpolicy.progress import RLProgressBar
from lightning_offpolicy.rollout.callback import RolloutCallback
from lightning_offpolicy.tasks import PromptDataModule


class OffPolicyCLI(LightningCLI):
    """``LightningCLI`` with the rollout callback as a first-class config group."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(RolloutCallback, "rollout")
        parser.link_arguments("rollout.temperature", "model.temperature")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with :class:`RLProgressBar` in place of the bar Lightning adds by default."""
        trainer = super().instantiate_trainer(**kwargs)
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        default_bar = trainer.progress_bar_callback
        if default_bar is not None and not any(isinstance(c, ProgressBar) for c in configured):
            # Lightning's default counts max_steps (optimizer steps) as batches: 2 per batch -> twice the batches.
            trainer.callbacks[trainer.callbacks.index(default_bar)] = RLProgressBar()
        return trainer


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["selfcheck"]:
        from lightning_offpolicy import selfcheck

        return selfcheck.main(words[1:])
    OffPolicyCLI(
        OffPolicyRLModule,
        PromptDataModule,
        subclass_mode_data=True,
        args=argv,  # None: read sys.argv
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
