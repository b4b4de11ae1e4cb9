"""The LightningCLI entry point: shipped configs parse, print_config round-trips, errors are clear, fit runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.cli import OffPolicyCLI, claim_log_directory, main
from lightning_offpolicy.correction import PRESETS, OffPolicyCorrectionConfig
from lightning_offpolicy.lightning.module import OffPolicyRLModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CORRECTION_CONFIGS = sorted((ROOT / "configs" / "correction").glob("*.yaml"))
TASK_CONFIGS = sorted((ROOT / "configs" / "tasks").glob("*.yaml"))


def parse(*args: str) -> OffPolicyCLI:
    return OffPolicyCLI(
        OffPolicyRLModule,
        LightningDataModule,  # as cli.main: any data module (configs/reasoning_gym.yaml uses DatasetDataModule)
        subclass_mode_data=True,
        run=False,
        args=list(args),
        auto_configure_optimizers=False,
    )


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses_and_instantiates(config):
    cli = parse("--config", str(config))
    assert isinstance(cli.model, OffPolicyRLModule)
    assert any(type(c).__name__ == "RolloutCallback" for c in cli.trainer.callbacks)
    assert cli.model.temperature == cli.config["rollout"]["sampling"]["temperature"]


@pytest.mark.parametrize("config", CORRECTION_CONFIGS, ids=lambda p: p.stem)
def test_correction_configs_layer_to_exactly_their_preset(config):
    cli = parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(config))
    assert cli.model.correction == PRESETS[config.stem]()


@pytest.mark.parametrize("config", TASK_CONFIGS, ids=lambda p: p.stem)
def test_task_configs_layer_over_the_quickstart(config):
    cli = parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(config))
    assert cli.datamodule.task.name == config.stem
    assert cli.model.model_name == f"tiny:{config.stem}"


def test_every_preset_has_a_config_file():
    aliases = {"geo_rs", "seq_tis_geo_rs"}
    assert {p.stem for p in CORRECTION_CONFIGS} == set(PRESETS) - aliases


def print_config(capsys, *config_files: Path) -> str:
    args = ["fit"] + [a for f in config_files for a in ("--config", str(f))] + ["--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_print_config_round_trips(tmp_path, capsys, config):
    first = print_config(capsys, config)
    printed = tmp_path / "printed.yaml"
    printed.write_text(first)
    assert print_config(capsys, printed) == first
    # The file's own correction survives (token TIS in most configs; the default, none, in reasoning_gym.yaml).
    correction = yaml.safe_load(config.read_text())["model"].get("correction") or {}
    expected = (PRESETS[correction]().to_dict() if isinstance(correction, str) else correction).get("tis_level")
    assert yaml.safe_load(first)["model"]["correction"]["tis_level"] == expected


def test_invalid_values_give_a_clear_error_before_training(capsys):
    with pytest.raises(SystemExit):
        parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.correction.tis_level=tokens")
    assert "tis_level" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tis_clip_low"):
        parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.correction.tis_clip_low=3.0")
    with pytest.raises(ValueError, match="max_staleness >= sync_every - 1"):
        parse("--config", str(ROOT / "configs" / "vllm_async.yaml"), "--rollout.asynchrony.sync_every=4")
    with pytest.raises(SystemExit):
        parse(
            "--config",
            str(ROOT / "configs" / "lora_single_gpu.yaml"),
            "--rollout.engine.init_args.weight_sync.lora=lora",
        )
    assert "weight_sync.lora" in capsys.readouterr().err


def test_help_documents_the_knobs(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    for text in (
        "--model.correction.geo_mask_low",
        "--rollout.sampling.samples_per_prompt",
        "Completions per prompt",
        "--rollout.asynchrony.max_staleness",
        "Most policy versions",
        "--rollout.asynchrony.sync_every",
        "--model.lora_rank",
        "--model.gradient_checkpointing",
    ):
        assert text in out, text


def test_fit_help_shows_the_model_as_a_path_not_every_torch_class(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the line count depends on the wrapping width
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    # The torch.nn classes listed as "known subclasses" of --model.model were ~470 lines at 80
    # columns.
    assert len(out.splitlines()) < 1000
    assert "torch.nn.Linear" not in out and "torch.nn.Module" not in out
    assert "tiny:<task>" in out and "(type: str, default: tiny:reverse)" in out


def test_fit_help_fits_in_700_lines_at_80_columns_and_class_help_still_works(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 700
    assert "known subclasses" not in out and "--trainer.logger.help" not in out
    assert "Prompts: any LightningDataModule" in out
    # A trainer option keeps its first sentence only; the kit's own options keep their whole text.
    assert "The devices to use. (type:" in out
    assert "A checkpoint to resume from, or `last`: the newest" in out  # the kit's meaning of `last`
    assert "Completions per prompt" in out
    # The per-option class help left out of the listing still answers.
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.logger.help", "TensorBoardLogger"])
    assert exit_info.value.code == 0
    assert "--trainer.logger.save_dir" in capsys.readouterr().out


def test_model_path_from_the_command_line_reaches_the_module():
    cli = parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.model=tiny:copy")
    assert cli.model.model_name == "tiny:copy"
    assert cli.config["model"]["model"] == "tiny:copy"


def test_top_level_help_names_selfcheck(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # no line wrapped inside a command
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "lightning-offpolicy selfcheck" in out and "fit --config" in out


@pytest.mark.slow
def test_short_fit_writes_tensorboard_metrics(tmp_path):
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_steps=4",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.prompts_per_step=4",
            "--rollout.sampling.samples_per_prompt=4",
            "--trainer.val_check_interval=2",
            "--data.init_args.num_val_prompts=8",
        ]
    )
    (version,) = list((tmp_path / "quickstart").iterdir())
    events = EventAccumulator(str(version))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "rollout_corr/kl",
        "rollout_corr/chi2_token",
        "rollout_corr/ess",
        "ppo/clip_frac",
        "train/reward",
        "rollout/tokens_per_s",
        "staleness/max",
        "perf/train_tokens_per_s",
        "val/reward_greedy",
        "val/reward_sampled",
        "val/pass@k",
        "val/length",
    ):
        assert tag in tags, tag
    assert len(events.Scalars("val/reward_greedy")) == 1  # after batch 2 (the sanity check is not logged)
    assert len(events.Scalars("train/reward")) == 2  # 2 batches x 2 mini-batches = 4 optimizer steps
    assert list((version / "checkpoints").glob("*.ckpt"))
    assert OffPolicyCorrectionConfig.token_tis()  # the config of the run (sanity)


def test_dapo_entropy_bonus_and_correction_from_yaml(tmp_path, capsys):
    """DAPO's settings (rollout:), the entropy bonus (model.loss) and verl's decoupled_k3_rs_token_tis in the
    kit's names, from YAML; verl's own names are refused there (OffPolicyCorrectionConfig.from_peer_names
    takes them, in Python)."""
    extra = tmp_path / "dapo.yaml"
    extra.write_text(
        """
model:
  loss:
    entropy_coef: 0.01
  correction:
    tis_level: token
    tis_clip_high: 2.0
    kl_reject: k3
    kl_reject_level: seq_mean
    kl_reject_threshold: 0.02
rollout:
  dapo:
    dynamic_sampling: true
    max_refill_batches: 3
    overlong_filter: true
    overlong_buffer: 4
    overlong_penalty_factor: 0.5
"""
    )
    cli = parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(extra))
    assert cli.model.loss_config.entropy_coef == 0.01
    assert cli.model.correction == PRESETS["decoupled_k3_rs"](threshold=0.02).replace(
        tis_level="token", tis_clip_high=2.0
    )
    (callback,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutCallback"]
    assert callback.dapo.dynamic_sampling and callback.dapo.max_refill_batches == 3
    assert callback.dapo.overlong_filter and callback.dapo.overlong_buffer == 4
    assert callback.dapo.overlong_penalty_factor == 0.5
    peer = tmp_path / "verl.yaml"
    peer.write_text("model:\n  correction:\n    rollout_is: token\n")
    with pytest.raises(SystemExit):
        parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(peer))
    assert "rollout_is" in capsys.readouterr().err


# ---------------------------------------------------------------------------- correction presets by name
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def test_a_correction_preset_by_name_on_the_command_line_and_in_yaml(tmp_path):
    assert parse("--config", QUICKSTART, "--model.correction=geo_mis").model.correction == PRESETS["geo_mis"]()
    layered = parse("--config", QUICKSTART, "--model.correction=geo_mis", "--model.correction.geo_mask_low=0.98")
    assert layered.model.correction == PRESETS["geo_mis"](low=0.98)
    config = tmp_path / "preset.yaml"
    config.write_text("model:\n  correction: cispo\n")
    assert parse("--config", QUICKSTART, "--config", str(config)).model.correction == PRESETS["cispo"]()


@pytest.mark.parametrize("where", ["command line", "yaml"])
def test_a_misspelt_correction_preset_names_the_close_one_and_every_preset(tmp_path, capsys, where):
    config = tmp_path / "typo.yaml"
    config.write_text("model:\n  correction: token_tiss\n")
    args = ["--model.correction=token_tiss"] if where == "command line" else ["--config", str(config)]
    with pytest.raises(SystemExit):
        parse("--config", QUICKSTART, *args)
    err = capsys.readouterr().err
    # Before: "Unable to load config 'token_tiss'", no preset named.
    assert "Unknown correction preset 'token_tiss'. Did you mean 'token_tis'" in err
    assert "Known presets: bypass, " in err and "cispo" in err
    assert "Unable to load config" not in err


# ---------------------------------------------------------------------------- one run per log directory
def short_fit(tmp_path, seed: int, *extra: str) -> None:
    main(
        ["fit", "--config", QUICKSTART, f"--trainer.logger.init_args.save_dir={tmp_path}", f"--seed_everything={seed}"]
        + ["--trainer.max_steps=2", "--trainer.enable_progress_bar=false", "--data.init_args.num_val_prompts=0"]
        + list(extra)
    )


def run_holding(tmp_path, *extra: str):
    """Run A: the CLI's trainer after it took its log directory (A is still running: the lock is held)."""
    cli = parse("--config", QUICKSTART, f"--trainer.logger.init_args.save_dir={tmp_path}", *extra)
    lock = claim_log_directory(cli.trainer)
    (Path(cli.trainer.logger.log_dir) / "a.txt").write_text("run A")
    return cli.trainer, lock


def test_a_fresh_csv_logged_run_does_not_warn_that_old_logs_will_be_deleted(tmp_path):
    """The run's lock is the only entry of its new directory: CSVLogger's warning about deleting what a
    directory held is not for it (a second run given the same version is, and still gets it)."""
    import warnings

    csv = ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short_fit(tmp_path, 0, *csv)
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]
    (metrics,) = tmp_path.rglob("metrics.csv")
    assert metrics.parent.name == "version_0"
    with pytest.warns(UserWarning, match="exists and is not empty"):
        short_fit(tmp_path, 0, *csv, "--trainer.logger.init_args.version=0")


def test_runs_started_together_with_automatic_versions_get_a_directory_each(tmp_path, monkeypatch):
    trainer_a, lock_a = run_holding(tmp_path)
    assert trainer_a.logger.version == 0
    # Run B listed the log directory before A created version_0 (both started at the same moment): it picks 0 too.
    stale, next_version = [0], TensorBoardLogger._get_next_version
    monkeypatch.setattr(
        TensorBoardLogger, "_get_next_version", lambda self: stale.pop() if stale else next_version(self)
    )
    short_fit(tmp_path, 2)
    root = tmp_path / "quickstart"
    # Before: B wrote its config.yaml, events and checkpoints into A's version_0.
    assert sorted(p.name for p in (root / "version_0").iterdir()) == [".run.lock", "a.txt"]
    assert "seed_everything: 2" in (root / "version_1" / "config.yaml").read_text()
    assert (root / "version_1" / "checkpoints" / "last.ckpt").is_file()
    lock_a.close()


def test_a_second_run_in_a_fixed_log_directory_fails_before_writing_anything(tmp_path):
    trainer_a, lock_a = run_holding(tmp_path, "--trainer.logger.init_args.version=fixed")
    directory = tmp_path / "quickstart" / "fixed"
    with pytest.raises(RuntimeError) as info:
        short_fit(tmp_path, 2, "--trainer.logger.init_args.version=fixed")  # before: trained, writing over A's files
    message = str(info.value)
    assert f"Another run (pid {os.getpid()} on " in message
    assert f"is writing to the log directory {directory} now" in message
    assert "leave trainer.logger's `version` unset" in message
    assert sorted(p.name for p in directory.iterdir()) == [".run.lock", "a.txt"]  # no config, events, checkpoint
    # Once A has ended, the directory is free again: a resumed run writes there.
    lock_a.close()
    short_fit(tmp_path, 3, "--trainer.logger.init_args.version=fixed")
    assert "seed_everything: 3" in (directory / "config.yaml").read_text()
