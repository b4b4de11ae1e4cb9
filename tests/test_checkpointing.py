"""Atomic checkpoint writes, the periodic and on-exception checkpoints, and ``--ckpt_path last``'s search.

In-process: a full disk is simulated by a ``CheckpointIO`` test double whose single write call raises
``ENOSPC`` (the bytes still reach the real temporary file first); tests/test_preemption.py runs the CLI
on a real size-limited tmpfs and sends it a real SIGTERM.
"""

from __future__ import annotations

import errno
import os
import signal
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.checkpointing import (
    AtomicCheckpointIO,
    CheckpointSaveError,
    PeriodicCheckpoint,
    find_last_checkpoint,
)
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.preemption import SAVE_ERROR_EXIT_CODE, PreemptionCheckpoint
from lightning_offpolicy.rollout import SamplingConfig
from tests.module_helpers import TOKENIZER, tiny_model


class FullDiskIO(AtomicCheckpointIO):
    """The disk fills up after ``room`` bytes of a save: what a real ENOSPC does to ``write``."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def _write(self, fd: int, chunk: memoryview) -> int:
        written = os.write(fd, chunk[: self.room])
        self.room -= written
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return written


def state(value: float) -> dict:
    return {"weights": torch.full((4096,), value), "global_step": int(value)}


def test_a_full_disk_keeps_the_previous_checkpoint_byte_identical_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(state(1.0), path)
    before = path.read_bytes()
    with pytest.raises(CheckpointSaveError) as info:
        FullDiskIO(room=1000).save_checkpoint(state(2.0), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file is gone
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.written == 1000
    message = str(error)
    assert "No space left on device (ENOSPC)" in message and str(path) in message and " free on " in message
    assert "unchanged" in message
    # A first save that fails leaves nothing under the final name either.
    with pytest.raises(CheckpointSaveError):
        FullDiskIO(room=10).save_checkpoint(state(3.0), tmp_path / "new.ckpt")
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_an_atomic_save_replaces_the_file_and_keeps_the_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "x.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(state(1.0), path)
    io.save_checkpoint(state(2.0), path)
    assert io.load_checkpoint(path)["global_step"] == 2
    assert os.listdir(path.parent) == ["x.ckpt"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_find_last_checkpoint_picks_the_newest_of_every_earlier_version(tmp_path):
    root = tmp_path / "runs" / "quickstart"
    files = {
        "version_0/checkpoints/last.ckpt": 100,
        "version_1/checkpoints/last.ckpt": 200,
        "version_1/checkpoints/preempted.ckpt": 300,
        "version_1/checkpoints/.last.ckpt.0123.tmp": 900,  # an interrupted save: never a candidate
        "version_2/checkpoints/epoch=0-step=8.ckpt": 250,  # a ModelCheckpoint's own name: a checkpoint too
        "version_2/events.out": 950,
    }
    for name, mtime in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
        os.utime(root / name, (mtime, mtime))
    trainer = L.Trainer(logger=TensorBoardLogger(save_dir=tmp_path / "runs", name="quickstart"), accelerator="cpu")
    assert find_last_checkpoint(trainer) == str(root / "version_1/checkpoints/preempted.ckpt")
    os.utime(root / "version_0/checkpoints/last.ckpt", (400, 400))
    assert find_last_checkpoint(trainer) == str(root / "version_0/checkpoints/last.ckpt")
    # Lightning's `epoch=N-step=M.ckpt` (save_top_k, every_n_train_steps without save_last): written last, found.
    os.utime(root / "version_2/checkpoints/epoch=0-step=8.ckpt", (500, 500))
    assert find_last_checkpoint(trainer) == str(root / "version_2/checkpoints/epoch=0-step=8.ckpt")
    other = L.Trainer(logger=TensorBoardLogger(save_dir=tmp_path / "runs", name="other"), accelerator="cpu")
    assert find_last_checkpoint(other) is None


# ------------------------------------------------------------------------------ real fits
class RecordPrompts(L.Callback):
    """Keeps (global_step, prompts) of every trained batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, list(batch.prompts)))


class RaiseAt(L.Callback):
    """Raises ``exception`` at the start of the batch trained from optimizer step ``step`` (before generating)."""

    def __init__(self, step: int, exception: BaseException) -> None:
        self.step, self.exception = step, exception

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise self.exception


class RaiseBeforeOptimizerStep(L.Callback):
    """Raises inside a batch, after its first optimizer step (the state is then no batch's)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 5:
            raise RuntimeError("failed between two optimizer steps of a batch")


def fit(root, max_steps: int, *extra, every: int = 4, ckpt_path=None, record=None, plugins=None):
    module = OffPolicyRLModule(
        model=tiny_model(), tokenizer=TOKENIZER, optimizer=partial(torch.optim.AdamW, lr=1e-3), num_minibatches=2
    )
    rollout = RolloutCallback(sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=3), seed=1)
    callbacks = [
        *extra,
        rollout,
        record or RecordPrompts(),
        PreemptionCheckpoint(),
        PeriodicCheckpoint(every_n_train_steps=every, save_last=True, save_top_k=0),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=root,
        logger=TensorBoardLogger(save_dir=root, name="run"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins if plugins is not None else [AtomicCheckpointIO()],
    )
    data = PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=64)
    if ckpt_path == "last":
        ckpt_path = find_last_checkpoint(trainer)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module, rollout


def test_find_last_checkpoint_restores_a_previous_checkpoint_a_sharded_save_moved_aside_when_cut_short(tmp_path):
    directory = tmp_path / "checkpoints"
    aside = directory / ".last.ckpt.0a1b2c.old"  # a crash between _replace_directory's two renames
    (aside / "shards").mkdir(parents=True)
    (aside / "shards" / "__0_0.distcp").write_bytes(b"rank 0 shard")
    (directory / ".last.ckpt.0a1b2c.tmp").mkdir()  # the staging directory: never a candidate, left as it is
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu")
    assert find_last_checkpoint(trainer) == str(directory / "last.ckpt")
    assert (directory / "last.ckpt" / "shards" / "__0_0.distcp").read_bytes() == b"rank 0 shard"
    assert sorted(p.name for p in directory.iterdir()) == [".last.ckpt.0a1b2c.tmp", "last.ckpt"]

    # A crash after both renames: the new checkpoint is in place, the hidden previous one is removed.
    (directory / ".last.ckpt.9f8e7d.old").mkdir()
    (directory / ".preempted.ckpt.9f8e7d.old").write_bytes(b"previous")  # a file, restored as one
    assert find_last_checkpoint(trainer) in {str(directory / "last.ckpt"), str(directory / "preempted.ckpt")}
    assert sorted(p.name for p in directory.iterdir()) == [".last.ckpt.0a1b2c.tmp", "last.ckpt", "preempted.ckpt"]
    assert (directory / "preempted.ckpt").read_bytes() == b"previous"


def test_lightning_model_checkpoint_misses_the_last_steps_and_periodic_checkpoint_saves_them(tmp_path):
    """every_n_train_steps=4 and max_steps=10: Lightning's last.ckpt stops at step 8."""

    def last_step(callback, root):
        trainer = L.Trainer(
            accelerator="cpu", max_steps=10,
            callbacks=[RolloutCallback(sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=3)), callback],
            default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        module = OffPolicyRLModule(model=tiny_model(), tokenizer=TOKENIZER, num_minibatches=2)
        trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=64))
        return torch.load(root / "last.ckpt", weights_only=False)["global_step"]

    lightning = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=4, save_last=True, save_top_k=0)
    assert last_step(lightning, tmp_path / "a") == 8
    periodic = PeriodicCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=4, save_last=True, save_top_k=0)
    assert last_step(periodic, tmp_path / "b") == 10
    assert sorted(os.listdir(tmp_path / "b")) == ["last.ckpt"]


@pytest.mark.parametrize("exception", [RuntimeError("the engine died"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_an_exception_between_batches_saves_and_ckpt_path_last_resumes_at_the_next_batch(tmp_path, exception):
    full = RecordPrompts()
    fit(tmp_path / "full", 12, record=full)
    # Stopped at the start of the 4th batch (after 6 optimizer steps); the periodic last.ckpt is at step 4.
    if isinstance(exception, KeyboardInterrupt):
        handler = signal.getsignal(signal.SIGINT)
        try:
            with pytest.raises(SystemExit) as info:  # Lightning turns Ctrl-C into exit status 1
                fit(tmp_path / "run", 12, RaiseAt(6, exception))
        finally:
            signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
        assert info.value.code == 1
    else:
        with pytest.raises(RuntimeError, match="the engine died"):
            fit(tmp_path / "run", 12, RaiseAt(6, exception))
    checkpoints = tmp_path / "run" / "run" / "version_0" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["last.ckpt", "on_exception.ckpt"]
    saved = torch.load(checkpoints / "on_exception.ckpt", weights_only=False)
    assert saved["global_step"] == saved["policy_version"] == 6
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 4

    resumed = RecordPrompts()
    trainer, module, rollout = fit(tmp_path / "run", 12, ckpt_path="last", record=resumed)
    assert trainer.ckpt_path == str(checkpoints / "on_exception.ckpt")
    assert resumed.seen[0][0] == 6  # the first batch trained continues at step 6 ...
    assert resumed.seen == full.seen[3:]  # ... on the prompts the uninterrupted run trained there
    assert module.policy_version == trainer.global_step == 12
    assert rollout.generated_batches == 6
    # ... and its batches are logged at their own steps, 3 to 5 as in the uninterrupted run (the batch
    # stopped at its start is not counted as stepped).
    events = EventAccumulator(str(tmp_path / "run" / "run" / "version_1"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/policy_version")] == [(3, 8.0), (4, 10.0), (5, 12.0)]


def test_an_exception_inside_a_batch_saves_no_on_exception_checkpoint(tmp_path, caplog):
    with pytest.raises(RuntimeError, match="between two optimizer steps"):
        fit(tmp_path, 12, RaiseBeforeOptimizerStep())
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    assert os.listdir(checkpoints) == ["last.ckpt"]  # step 4: the last consistent state
    assert "no on-exception checkpoint written (it stopped inside a batch" in caplog.text


class SendSigterm(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_with_a_full_disk_exits_74_names_enospc_and_keeps_the_previous_checkpoint(tmp_path, caplog):
    # The periodic save at step 4 succeeds; the preemption save at step 6 meets a full disk.
    class FullAfterFirstSave(FullDiskIO):
        def __init__(self) -> None:
            super().__init__(room=10**9)
            self.saves = 0

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.saves += 1
            if self.saves > 1:
                self.room = 4096
            super().save_checkpoint(checkpoint, path, storage_options)

    with pytest.raises(SystemExit) as info:
        fit(tmp_path, 40, SendSigterm(), plugins=[FullAfterFirstSave()])
    assert info.value.code == SAVE_ERROR_EXIT_CODE == 74
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    assert os.listdir(checkpoints) == ["last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 4
    assert "No space left on device (ENOSPC) writing " + str(checkpoints / "preempted.ckpt") in caplog.text
    assert "SIGTERM: no checkpoint saved at step 6; exiting with status 74 (not 143" in caplog.text


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="save_error_exit_code=143 must differ from exit_code"):
        PreemptionCheckpoint(save_error_exit_code=143)
    with pytest.raises(ValueError, match="save_error_exit_code=0 must be an int in 1..255"):
        PreemptionCheckpoint(save_error_exit_code=0)
    with pytest.raises(ValueError, match="exception_filename='preempted' must differ from filename"):
        PreemptionCheckpoint(exception_filename="preempted")
    with pytest.raises(ValueError, match="exception_filename=''"):
        PreemptionCheckpoint(exception_filename="")
    with pytest.raises(ValueError, match="save_on_exception='yes'"):
        PreemptionCheckpoint(save_on_exception="yes")


def test_the_cli_installs_atomic_checkpoints_and_keeps_a_configured_checkpoint_io():
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_offpolicy.lightning.checkpointing import install_atomic_checkpoint_io

    trainer = L.Trainer(accelerator="cpu", logger=False)
    assert install_atomic_checkpoint_io(trainer) and isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)

    class Mine(TorchCheckpointIO):
        pass

    trainer = L.Trainer(accelerator="cpu", logger=False, plugins=[Mine()])
    assert not install_atomic_checkpoint_io(trainer) and type(trainer.strategy.checkpoint_io) is Mine


def test_a_save_cut_by_sigkill_leaves_a_temporary_that_the_next_resume_removes(tmp_path):
    """A writer SIGKILLed in the middle of an atomic write leaves its full-size hidden file; `--ckpt_path last`
    removes it (its writer is dead), and keeps a live writer's and another host's."""
    import socket
    import subprocess
    import sys
    import time

    from lightning_offpolicy.lightning.leftovers import temporary_name

    checkpoints = tmp_path / "runs" / "run" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"x")
    # A writer that never finishes its write (the chunks never end), killed as the OOM killer would.
    writer = subprocess.Popen(
        [
            sys.executable, "-c",
            "import itertools, os, sys; from lightning_offpolicy.lightning.checkpointing import atomic_write; "
            "atomic_write(b'x' * (1 << 20), sys.argv[1], write=lambda fd, chunk: "
            "[os.write(fd, chunk[:1]), print('writing', flush=True), __import__('time').sleep(60)][0])",
            str(checkpoints / "last.ckpt"),
        ],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert writer.stdout.readline().strip() == "writing"
        (left,) = [p for p in checkpoints.iterdir() if p.name.endswith(".tmp")]
        assert f"-{writer.pid}-" in left.name and socket.gethostname() in left.name
    finally:
        writer.kill()
        writer.wait()
    live = checkpoints / os.path.basename(
        temporary_name(str(checkpoints / "last.ckpt"))
    )  # this process's: a save in progress
    live.write_bytes(b"x")
    other_host = checkpoints / f".last.ckpt.another-host-{writer.pid}-0123456789ab.tmp"
    other_host.write_bytes(b"x")
    time.sleep(0.01)
    trainer = L.Trainer(logger=TensorBoardLogger(save_dir=tmp_path / "runs", name="run"), accelerator="cpu")
    assert find_last_checkpoint(trainer) == str(checkpoints / "last.ckpt")
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted([live.name, other_host.name, "last.ckpt"])
