"""The demo entry point: every preset on a real tiny model, real TensorBoard events."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.cli import main
from lightning_offpolicy.correction import PRESETS
from lightning_offpolicy.demo.selfcheck import LOSS_CHECKS


def test_selfcheck_runs_every_preset_and_writes_tensorboard(tmp_path, capsys):
    logdir = tmp_path / "tb"
    assert main(["selfcheck", "--batch", "8", "--new-tokens", "12", "--logdir", str(logdir)]) == 0
    printed = capsys.readouterr().out
    assert f"all {len(PRESETS)} presets passed, and the DPPO losses" in printed
    assert all(f"\n{name} " in printed for name in LOSS_CHECKS), "a DPPO loss has no row in the table"
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in [*PRESETS, *LOSS_CHECKS]:
        assert f"{name}/rollout_corr/kl" in tags
        assert f"{name}/ppo/clip_frac" in tags
    # The engine runs other weights in another precision: the mismatch is real and positive.
    kl = events.Scalars("disabled/rollout_corr/kl")[0].value
    assert kl > 1e-4
    assert events.Scalars("bypass/rollout_corr/kl")[0].value == 0.0


def test_cli_requires_a_subcommand():
    with pytest.raises(SystemExit):
        main([])
