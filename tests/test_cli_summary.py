"""What a CLI fit prints: no Lightning tips, no "Total FLOPs: 0", and at the end where the run's files are."""

from __future__ import annotations

import logging
import re
import statistics
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.cli import main
from lightning_offpolicy.lightning.console import summary_lines

ROOT = Path(__file__).resolve().parents[1]


def test_summary_lines_average_a_window_at_each_end():
    lines = summary_lines("runs/x/version_0", None, None, [0.1, 0.2, 0.3, 0.4, 0.5], window=2)
    assert lines[0] == "Run directory:     runs/x/version_0"
    assert lines[1] == "Last checkpoint:   (none saved)"
    assert lines[-1] == "train/reward:      0.150 (mean of the first 2 batches) -> 0.450 (last 2), 5 batches"
    # Fewer batches than two windows: half of them at each end.
    assert "0.100 (mean of the first 1 batches) -> 0.200 (last 1)" in summary_lines(None, None, None, [0.1, 0.2])[-1]


@pytest.mark.slow
def test_a_fit_prints_where_its_files_are_and_its_reward_first_to_last(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_steps=8",  # 4 batches of 2 optimizer steps
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.prompts_per_step=4",
            "--rollout.sampling.samples_per_prompt=4",
            "--data.init_args.num_val_prompts=0",
        ]
    )
    printed = capsys.readouterr().out
    fields = dict(re.findall(r"^(Run directory|Last checkpoint|TensorBoard|train/reward): +(.*)$", printed, re.M))
    run = tmp_path / "quickstart" / "version_0"
    assert fields["Run directory"] == str(run)
    assert (run / "config.yaml").is_file()
    assert fields["Last checkpoint"] == str(run / "checkpoints" / "last.ckpt")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert "--ckpt_path last" in printed
    (events,) = run.glob("events.out.tfevents.*")
    assert fields["TensorBoard"] == str(events)
    assert f"(tensorboard --logdir {tmp_path})" in printed

    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    rewards = [s.value for s in sorted(accumulator.Scalars("train/reward"), key=lambda s: s.step)]
    assert len(rewards) == 4
    first, last = statistics.fmean(rewards[:2]), statistics.fmean(rewards[2:])
    assert fields["train/reward"] == f"{first:.3f} (mean of the first 2 batches) -> {last:.3f} (last 2), 4 batches"

    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("GPU available") for m in messages)  # Lightning's own lines still reach the log
    assert not any("Tip:" in m for m in messages)
    (summary,) = [m for m in messages if "Trainable params" in m]
    assert "Flops" not in summary and "FLOPs" not in summary and "Total params" in summary
