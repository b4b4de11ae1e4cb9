"""``seed_everything`` is the run's seed: every component without its own seed takes it, an explicit one wins."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.cli import OffPolicyCLI
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.seeding import RUN_SEED_ENV, run_seed
from tests.test_cli import parse

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")


def test_run_seed(monkeypatch, caplog):
    assert run_seed(None, "X.seed") == 0  # nothing seeded the run
    monkeypatch.setenv(RUN_SEED_ENV, "7")
    assert run_seed(None, "X.seed") == 7
    with caplog.at_level(logging.INFO):
        assert run_seed(3, "X.seed") == 3
    assert "X.seed=3 is set explicitly: it wins over the run's seed_everything=7" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run_seed(7, "X.seed") == 7
    assert "explicitly" not in caplog.text  # the same value: nothing to say
    with pytest.raises(ValueError, match=r"X\.seed='1' must be an int, or None"):
        run_seed("1", "X.seed")


def _cli(*args: str) -> OffPolicyCLI:
    return parse("--config", QUICKSTART, *args)


def _callback(cli: OffPolicyCLI) -> RolloutCallback:
    return next(c for c in cli.trainer.callbacks if isinstance(c, RolloutCallback))


def test_seed_everything_seeds_every_component_and_an_explicit_seed_wins(caplog):
    three = _cli("--seed_everything=3")
    assert three.model.seed == _callback(three).seed == three.datamodule.seed == 3
    four = _cli("--seed_everything=4")
    assert four.model.seed == _callback(four).seed == four.datamodule.seed == 4
    prompts = [three.datamodule.train_dataset[i] for i in range(16)]
    assert prompts != [four.datamodule.train_dataset[i] for i in range(16)]  # another prompt set
    assert prompts == [_cli("--seed_everything=3").datamodule.train_dataset[i] for i in range(16)]
    with caplog.at_level(logging.INFO):
        mixed = _cli("--seed_everything=3", "--data.init_args.seed=5")
    assert mixed.datamodule.seed == 5 and mixed.model.seed == _callback(mixed).seed == 3
    assert "PromptDataModule.seed=5 is set explicitly: it wins over the run's seed_everything=3" in caplog.text


def _fit(tmp_path: Path, seed: int) -> dict[str, torch.Tensor]:
    cli = _cli(
        f"--seed_everything={seed}",
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.init_args.prompts_per_step=4",
        "--rollout.sampling.samples_per_prompt=4",
    )
    cli.trainer.fit(cli.model, cli.datamodule)
    return {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tmp_path):
    """One batch (two optimizer steps) from the same checkpoint: the trained weights are a function of the seed."""
    first, again, other = (_fit(tmp_path / str(i), seed) for i, seed in enumerate((1, 1, 2)))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)
