"""Console script ``lightning-offpolicy``: a ``LightningCLI`` for off-policy RL fits.

    lightning-offpolicy fit --config configs/quickstart.yaml
    lightning-offpolicy fit --config configs/quickstart.yaml --config configs/correction/geo_mis.yaml
    lightning-offpolicy fit --print_config
    lightning-offpolicy selfcheck          # every correction preset on a real tiny model, no training
    lightning-offpolicy check-model DIR    # every engine gets the weights of DIR's architecture right

Config groups: ``model`` (:class:`~lightning_offpolicy.lightning.module.OffPolicyRLModule`; ``model.model``
is a string here, a path, a hub name or ``tiny:<task>``), ``data`` (any LightningDataModule yielding
``PromptBatch``, by ``class_path``), ``rollout``
(:class:`~lightning_offpolicy.lightning.callback.RolloutCallback`, always added; ``rollout.sampling.temperature``
is linked to ``model.temperature``), ``preemption``, ``trainer``. On top of LightningCLI:

* the training bar is :class:`~lightning_offpolicy.lightning.progress.RLProgressBar` unless the config
  names one;
* what a fit prints comes from :mod:`~lightning_offpolicy.lightning.console`: no tips, no FLOPs, and
  at the end where the run, its last checkpoint and its TensorBoard events are;
* checkpoints are written atomically, ``--ckpt_path last`` resumes from the newest checkpoint of an
  earlier run of the same logger name
  (:func:`~lightning_offpolicy.lightning.checkpointing.find_last_checkpoint`), and one run at a time
  writes a log directory (:func:`claim_log_directory`).

The why of each: docs/getting_started.md ("Change the run from the command line or YAML", "Resume a run").
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import traceback
import warnings
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_offpolicy.correction.config import PRESETS, unknown_preset_message
from lightning_offpolicy.data import DatasetDataModule  # noqa: F401  (a known data class for --data.help)
from lightning_offpolicy.data.tasks import PromptDataModule  # noqa: F401
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.checkpointing import find_last_checkpoint, install_atomic_checkpoint_io
from lightning_offpolicy.lightning.console import FitSummary, ModelSummaryWithoutFlops, silence_lightning_tips
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.preemption import PreemptionCheckpoint
from lightning_offpolicy.lightning.progress import RLProgressBar

log = logging.getLogger(__name__)

#: Shown by ``lightning-offpolicy --help``: the subcommand that LightningCLI does not know about.
DESCRIPTION = (
    "Off-policy-corrected RL of language models with Lightning. `lightning-offpolicy fit --config "
    "configs/quickstart.yaml` trains; `lightning-offpolicy selfcheck` checks every correction preset on a "
    "real tiny model in under a minute, without training (`selfcheck --help` for its options). "
    "`fit --OPTION.help CLASS` shows the settings of a class that a class-typed option accepts."
)

CKPT_PATH_HELP = (
    "A checkpoint to resume from, or `last`: the newest checkpoint (last.ckpt, preempted.ckpt, on_exception.ckpt) "
    "of an earlier run with the same logger name."
)

MODEL_HELP = (
    "The causal LM: a local directory, a Hugging Face hub name, or tiny:<task> (a tiny Llama built and "
    "SFT-warmed locally, no download; e.g. tiny:reverse). From Python, OffPolicyRLModule(model=...) also "
    "takes a module instance."
)


class ConciseHelpFormatter(DefaultHelpFormatter):
    """``fit --help`` that fits on a few screens: each option once, in one or two sentences.

    On top of jsonargparse's formatter it leaves out the list of known subclasses after a
    class-typed option and the ``--OPTION.help CLASS`` entry beside it (both still work: the
    description says so), keeps the first sentence of each ``trainer.*`` option and of
    ``weights_only`` (their full text is Lightning's documentation), and says what ``--ckpt_path
    last`` means here.
    """

    def add_argument(self, action: argparse.Action) -> None:
        if any(flag.endswith(".help") for flag in action.option_strings):
            return
        super().add_argument(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action)
        text = _KNOWN_SUBCLASSES.sub("", text)
        if (action.dest.startswith("trainer.") or action.dest in _FIT_ARGUMENTS) and action.help:
            shown = CKPT_PATH_HELP if action.dest == "ckpt_path" else _first_sentence(action.help)
            text = shown + text[len(action.help) :] if text.startswith(action.help) else text
        return text


#: ``Trainer.fit``'s own arguments, documented by Lightning like the trainer's.
_FIT_ARGUMENTS = ("ckpt_path", "weights_only")
_KNOWN_SUBCLASSES = re.compile(r", known subclasses: [^)]*")
# A sentence ends at a period followed by white space, except after "e.g." / "i.e." / "etc.".
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s")


def _first_sentence(text: str) -> str:
    match = _SENTENCE_END.search(text)
    return text if match is None else text[: match.start() + 1]


#: Held (``flock``) by the run writing a log directory, for as long as it runs.
RUN_LOCK_FILE = ".run.lock"


def claim_log_directory(trainer: Trainer) -> Any:
    """Take this run's log directory for as long as it runs; the open lock file (``None``: nothing to hold).

    Two runs started at the same moment with an automatic version (``version_N``) could both pick the
    same ``N`` (Lightning lists the directory, then creates ``version_N`` later) and write their
    ``config.yaml``, events and checkpoints over each other; two runs given the same fixed directory
    always did. The run holds a lock on ``<log_dir>/.run.lock`` (``flock``: the operating system
    drops it when the process ends, however it ends), and:

    * a run whose version is picked automatically and finds it held moves on to the next free
      ``version_N``, as it would have had it started a moment later;
    * a run given that directory (a fixed ``version``, or no logger: ``default_root_dir``) gets a
      ``RuntimeError`` before anything is written, naming the directory and the process holding it.

    A directory whose run has ended is taken again (a resumed run rewrites its ``config.yaml``).
    Called by the CLI before the subcommand runs, on global rank zero only (the other ranks use its
    directory, as Lightning broadcasts it); remote paths and systems without ``flock`` are left alone.
    """
    try:
        import fcntl
    except ImportError:
        return None
    if trainer.global_rank != 0 or rank_zero_only.rank != 0:
        return None
    logger = trainer.loggers[0] if trainer.loggers else None
    # Lightning creates the logger's experiment (and version_N) at the start of fit: the version is still open now.
    automatic = (
        isinstance(logger, (TensorBoardLogger, CSVLogger)) and logger._version is None and logger._experiment is None
    )
    taken: list[str] = []
    for _ in range(1000):
        log_dir = _local_log_dir(trainer)
        if not log_dir or "://" in log_dir:
            return None
        try:
            os.makedirs(log_dir, exist_ok=True)
            handle = open(os.path.join(log_dir, RUN_LOCK_FILE), "a+")  # held until the run ends
        except OSError:
            return None  # not writable: Lightning's own writes report it
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            if not automatic:
                what = (
                    "leave trainer.logger's `version` unset (each run then gets the next version_N), or set another "
                    "`version`, `name` or `save_dir`"
                    if logger is not None
                    else "set another trainer.default_root_dir"
                )
                raise RuntimeError(
                    f"Another run ({holder}) is writing to the log directory {log_dir} now: two runs in one directory "
                    f"overwrite each other's config.yaml, events and checkpoints. Give this run a directory of its "
                    f"own: {what}."
                ) from None
            taken.append(f"{log_dir} ({holder})")
            assert logger is not None
            logger._version = None  # the next version_N after the taken one
            continue
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        if os.listdir(log_dir) == [RUN_LOCK_FILE]:
            # CSVLogger warns that an existing directory's logs will be deleted when it holds anything: here
            # only this run's lock, in a directory just made for it.
            warnings.filterwarnings("ignore", message=f"Experiment logs directory {re.escape(log_dir)} exists")
        if taken:
            log.warning("%s was taken by a run that started at the same time; this run logs to %s.", taken[-1], log_dir)
        return handle
    raise RuntimeError(f"No free log directory after {len(taken)} tries; the last: {taken[-1]}.")


def _local_log_dir(trainer: Trainer) -> str | None:
    """``trainer.log_dir`` without its broadcast (rank zero alone calls it, before the processes are joined)."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        return logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
    return trainer.default_root_dir


class OffPolicyCLI(LightningCLI):
    """``LightningCLI`` with the rollout callback as a first-class config group."""

    def add_core_arguments_to_parser(self, parser) -> None:
        # LightningCLI's own, except that `model.model` is typed `str`: typed `torch.nn.Module`, as the module's
        # argument is (an instance, from Python), `fit --help` would list every torch.nn class.
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        if self.subclass_mode_model:
            parser.add_lightning_class_args(self._model_class, "model", subclass_mode=True)
        else:
            parser.add_class_arguments(
                self._model_class, "model", fail_untyped=False, instantiate=True, sub_configs=True, skip={"model"}
            )
            parser.add_argument("--model.model", type=str, default="tiny:reverse", help=MODEL_HELP)
        required = self.datamodule_class is not None  # no data class: the module's own dataloaders
        parser.add_lightning_class_args(
            self._datamodule_class, "data", subclass_mode=self.subclass_mode_data, required=required
        )
        # The group's title would be the first line of LightningDataModule's docstring.
        for group in parser._action_groups:
            if any(action.dest == "data" for action in group._group_actions):
                group.title = "Prompts: any LightningDataModule that yields PromptBatch, by class_path"

    def add_arguments_to_parser(self, parser) -> None:
        _accept_correction_presets(parser)
        parser.add_lightning_class_args(RolloutCallback, "rollout")
        parser.link_arguments("rollout.sampling.temperature", "model.temperature")
        # Greedy decoding is for evaluation only (RolloutCallback refuses it): not a training option.
        for action in parser._actions:
            if action.dest == "rollout.sampling.greedy":
                action.help = argparse.SUPPRESS
        # SIGTERM (preemption): checkpoint at the next batch boundary, then exit 143, not 0.
        parser.add_lightning_class_args(PreemptionCheckpoint, "preemption")
        # argparse's usage line lists every option once more before the options themselves.
        parser.usage = "%(prog)s [-h] [-c CONFIG] [--print_config[=flags]] [--GROUP.SETTING VALUE ...]"

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:
            # A constructor's own error inside a subclass-mode group (`data`) reaches the user wrapped in
            # jsonargparse's "Does not validate against any of the Union subtypes" dump: show it alone.
            cause = _constructor_error(err)
            if cause is None:
                raise
            raise cause from None

    def _parse_ckpt_path(self) -> None:
        # LightningCLI parses a `--ckpt_path FILE`'s saved hyper-parameters over the config, so that the
        # checkpoint's model and correction would replace the configured ones without a word (`last` is resolved
        # later and never was). Here the config is what trains, whichever way the checkpoint is named: the module
        # refuses another policy's checkpoint and names each setting that differs from the saving run's.
        return

    def _run_subcommand(self, subcommand: str) -> None:
        # One run per log directory at a time: taken before Lightning writes anything there.
        lock = claim_log_directory(self.trainer)
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            # SIGTERM to the whole process group (scancel) also stops vLLM's engine: the batch then fails with
            # the engine's error. The job was preempted, not broken: exit as a preempted job does.
            preemption = self._preemption()
            if preemption is None or not preemption.signalled:
                raise
            if preemption.save_error is not None:
                saved = f"; the checkpoint was NOT saved: {preemption.save_error}"
            else:
                saved = f"; saved {preemption.saved_path}" if preemption.saved_path else ""
            message = f"{preemption.cause}: the run stopped with {type(err).__name__}{saved}; exit {preemption.status}"
            print(message, file=sys.stderr)
            raise SystemExit(preemption.status) from err
        finally:
            if lock is not None:
                lock.close()  # the directory is free for a later run (a resumed one)

    def _preemption(self) -> PreemptionCheckpoint | None:
        return next((c for c in self.trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)

    def before_fit(self) -> None:
        """``--ckpt_path last``: the newest checkpoint of an earlier run of this config, or none (a fresh start)."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != "last":
            return
        preemption = self._preemption()
        names = (preemption.filename, preemption.exception_filename) if preemption else ()
        extra = [preemption.dirpath] if preemption else []
        path = find_last_checkpoint(self.trainer, names=names, extra_directories=extra)
        if path is None:
            # As Lightning's own "last": a job resubmitted by a scheduler starts fresh the first time.
            log.warning("--ckpt_path last: no checkpoint found from an earlier run; starting from scratch.")
        else:
            log.warning("--ckpt_path last: resuming from %s", path)
        config["ckpt_path"] = path

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with :class:`RLProgressBar` in place of Lightning's default bar, atomic checkpoints, and
        the console of :mod:`~lightning_offpolicy.lightning.console` (no tips, no FLOPs, a summary at the end)."""
        silence_lightning_tips()
        trainer_config = self._get(self.config_init, "trainer", default={})
        callbacks = trainer_config.get("callbacks")
        if trainer_config.get("enable_checkpointing") is False and isinstance(callbacks, list):
            # `--trainer.enable_checkpointing=false` over a shipped config that lists its periodic
            # checkpoint: the user asked for no checkpoints (Lightning would refuse the combination).
            kept = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
            if len(kept) != len(callbacks):
                log.info("trainer.enable_checkpointing=false: the config's ModelCheckpoint callbacks are left out.")
                trainer_config["callbacks"] = callbacks = kept
        # The callbacks the config names, read now: Lightning extends the config's list in place.
        configured = list(callbacks) if isinstance(callbacks, list) else [] if callbacks is None else [callbacks]
        trainer = super().instantiate_trainer(**kwargs)
        # A full disk during a save must leave the previous checkpoint, not a truncated file under its name.
        install_atomic_checkpoint_io(trainer)
        default_bar = trainer.progress_bar_callback
        if default_bar is not None and not any(isinstance(c, ProgressBar) for c in configured):
            # Lightning's default counts max_steps (optimizer steps) as batches: 2 per batch -> twice the batches.
            trainer.callbacks[trainer.callbacks.index(default_bar)] = RLProgressBar()
        _replace_default_model_summary(trainer, configured)
        trainer.callbacks.append(FitSummary())
        return trainer


def _replace_default_model_summary(trainer: Trainer, configured: list[Any]) -> None:
    """Lightning's default model summary (its FLOPs are 0 without an ``example_input_array``) -> one without FLOPs."""
    if any(isinstance(c, ModelSummary) for c in configured):
        return
    for index, callback in enumerate(trainer.callbacks):
        if isinstance(callback, ModelSummary):
            trainer.callbacks[index] = ModelSummaryWithoutFlops(max_depth=callback._max_depth)


#: A bare word, as a preset name is (a config file has a dot or a slash, inline YAML a brace or a colon).
_BARE_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")

CORRECTION_HELP = (
    "A correction preset by name (e.g. token_tis, geo_mis, bypass; the list: docs/off_policy_correction.md), "
    "or a YAML file / inline YAML of the fields below. A preset sets every field, as "
    "configs/correction/<name>.yaml does; fields given after it change it."
)


def _accept_correction_presets(parser: Any) -> None:
    """``--model.correction=token_tis`` (or ``correction: token_tis`` in YAML) takes the preset of that name.

    jsonargparse reads a bare string given for a dataclass group as a config file and fails with
    "Unable to load config 'token_tiss'"; an unknown name now gets the known presets and the close ones.
    """
    try:
        from jsonargparse._actions import _ActionConfigLoad
    except ImportError:  # jsonargparse moved its private class: no presets by name, nothing else changes
        return
    action = next((a for a in parser._actions if a.dest == "model.correction"), None)
    if type(action) is not _ActionConfigLoad:
        return

    class CorrectionConfigLoad(_ActionConfigLoad):
        def _load_config(self, value: Any, parser: Any) -> Any:
            name = value.strip() if isinstance(value, str) else None
            if name in PRESETS:
                value = PRESETS[name]().to_dict()
            try:
                return super()._load_config(value, parser)
            except TypeError:
                if name is None or not _BARE_WORD.fullmatch(name):
                    raise
            raise TypeError(
                f'Parser key "{self.dest}": '
                + unknown_preset_message(name)
                + " Give a preset name, a YAML file of OffPolicyCorrectionConfig fields, or single fields "
                "(--model.correction.tis_level=token)."
            ) from None

    action.__class__ = CorrectionConfigLoad
    action.help = CORRECTION_HELP


def _constructor_error(err: BaseException) -> BaseException | None:
    """The error a constructor raised under jsonargparse's union wrapper, or ``None`` when ``err`` is not that."""
    if not str(err).startswith("Does not validate against any of the Union subtypes"):
        return None
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    frames = traceback.extract_tb(root.__traceback__)
    if root is err or not frames or f"{os.sep}jsonargparse{os.sep}" in frames[-1].filename:
        return None
    return root


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["selfcheck"]:
        from lightning_offpolicy.demo import selfcheck

        return selfcheck.main(words[1:])
    if words[:1] == ["check-model"]:
        from lightning_offpolicy.modelcheck import cli as check_model

        return check_model.main(words[1:])
    OffPolicyCLI(
        OffPolicyRLModule,
        LightningDataModule,  # any data module: the kit's, or the user's own (class_path: mydata.MyPrompts)
        subclass_mode_data=True,
        args=argv,  # None: read sys.argv
        # A resumed run rewrites its directory's config; concurrent runs never share one (claim_log_directory).
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={
            "description": DESCRIPTION,
            "formatter_class": ConciseHelpFormatter,
            **{name: {"formatter_class": ConciseHelpFormatter} for name in LightningCLI.subcommands()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
