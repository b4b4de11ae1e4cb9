"""Console script ``lightning-offpolicy``: a ``LightningCLI`` for off-policy RL fits.

    lightning-offpolicy fit --config configs/quickstart.yaml
    lightning-offpolicy fit --config configs/quickstart.yaml --config configs/correction/geo_mis.yaml
    lightning-offpolicy fit --print_config
    lightning-offpolicy selfcheck          # every correction preset on a real tiny model, no training

Config groups: ``model`` (:class:`~lightning_offpolicy.module.OffPolicyRLModule`), ``data``
(any LightningDataModule yielding ``PromptBatch``, given by ``class_path``:
:class:`~lightning_offpolicy.tasks.PromptDataModule`,
:class:`~lightning_offpolicy.data.DatasetDataModule`, or your own), ``rollout``
(:class:`~lightning_offpolicy.rollout.RolloutCallback`, always added), ``trainer``.
``model.temperature`` is linked to ``rollout.temperature``: the trainer scores tokens with the
temperature the engine samples with.
"""

from __future__ import annotations

import sys

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from lightning_offpolicy.data import DatasetDataModule  # noqa: F401  (a known data class for --data.help)
from lightning_offpolicy.module import OffPolicyRLModule
from lightning_offpolicy.rollout.callback import RolloutCallback
from lightning_offpolicy.tasks import PromptDataModule  # noqa: F401


class OffPolicyCLI(LightningCLI):
    """``LightningCLI`` with the rollout callback as a first-class config group."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(RolloutCallback, "rollout")
        parser.link_arguments("rollout.temperature", "model.temperature")


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["selfcheck"]:
        from lightning_offpolicy import selfcheck

        return selfcheck.main(words[1:])
    OffPolicyCLI(
        OffPolicyRLModule,
        LightningDataModule,  # any data module: the kit's, or the user's own (class_path: mydata.MyPrompts)
        subclass_mode_data=True,
        args=argv,  # None: read sys.argv
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
