"""The CLI takes any LightningDataModule by class_path and rewards by import path (string or weighted list)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import LightningDataModule
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.cli import OffPolicyCLI, main
from lightning_offpolicy.data import DatasetDataModule
from lightning_offpolicy.data.rewards import WeightedReward
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from tests import reward_fixtures

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


class JsonlPrompts(LightningDataModule):
    """A user's own data module, as a newcomer would write it (not a PromptDataModule subclass).

    Args:
        path: a JSONL file of {"prompt", "answer"} rows.
        batch_size: prompts per step.
    """

    def __init__(self, path: str, batch_size: int = 2) -> None:
        super().__init__()
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.rows,
            batch_size=self.batch_size,
            collate_fn=lambda rows: PromptBatch([r["prompt"] for r in rows], [{"answer": r["answer"]} for r in rows]),
        )


def rollout_callback(cli):
    return next(c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutCallback")


def parse(*args: str) -> OffPolicyCLI:
    return OffPolicyCLI(
        OffPolicyRLModule,
        LightningDataModule,
        subclass_mode_data=True,
        run=False,
        args=list(args),
        auto_configure_optimizers=False,
    )


def test_reward_fn_from_yaml_as_a_path_and_as_a_weighted_list(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"rev {c}=", "answer": c}) + "\n" for c in "abcd"))
    cli = parse(
        "--config",
        QUICKSTART,
        "--data.class_path=lightning_offpolicy.data.DatasetDataModule",
        f"--data.init_args.source={rows}",
        "--data.init_args.prompts_per_step=2",
        "--rollout.reward_fn=tests.reward_fixtures:exact_match",
    )
    assert isinstance(cli.datamodule, DatasetDataModule) and len(cli.datamodule.train_dataset) == 4
    assert rollout_callback(cli).reward_fn is reward_fixtures.exact_match
    config = tmp_path / "rewards.yaml"
    config.write_text(
        "rollout:\n  reward_fn:\n"
        "    - {fn: tests.reward_fixtures.exact_match, weight: 1.0, name: acc}\n"
        "    - tests.reward_fixtures.length_bonus\n"
    )
    reward = rollout_callback(parse("--config", QUICKSTART, "--config", str(config))).reward_fn
    assert isinstance(reward, WeightedReward)
    assert [(c.name, c.weight, c.fn) for c in reward.components] == [
        ("acc", 1.0, reward_fixtures.exact_match),
        ("length_bonus", 1.0, reward_fixtures.length_bonus),
    ]
    with pytest.raises(ImportError, match="'tests.reward_fixtures.no_such' could not be imported"):
        parse("--config", QUICKSTART, "--rollout.reward_fn=tests.reward_fixtures.no_such")


@pytest.mark.slow
def test_fit_a_users_own_data_module_with_weighted_rewards(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"rev {w}=", "answer": w[::-1]}) + "\n" for w in ["abc", "bca", "cab", "dde"])
    )
    rewards = tmp_path / "rewards.yaml"
    rewards.write_text(
        "rollout:\n  reward_fn:\n"
        "    - {fn: tests.reward_fixtures.exact_match, weight: 1.0, name: acc}\n"
        "    - {fn: tests.reward_fixtures.length_bonus, weight: 0.5, name: len}\n"
    )
    main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--config",
            str(rewards),
            "--data.class_path=tests.test_cli_data.JsonlPrompts",
            f"--data.init_args.path={rows}",
            "--trainer.max_steps=4",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--rollout.sampling.samples_per_prompt=2",
        ]
    )
    (version,) = list((tmp_path / "quickstart").iterdir())
    events = EventAccumulator(str(version))
    events.Reload()
    total, acc, length = (events.Scalars(k) for k in ("train/reward", "reward/acc", "reward/len"))
    assert len(total) == len(acc) == len(length) == 2  # 2 batches x 2 mini-batches = 4 optimizer steps
    for t, a, n in zip(total, acc, length, strict=True):
        assert 0.0 <= a.value <= 1.0 and n.value > 0
        assert t.value == pytest.approx(a.value + 0.5 * n.value, abs=1e-5)  # the total is the weighted sum
