"""SIGTERM: a checkpoint at a batch boundary, a non-zero exit, a clean shutdown, and a resume that continues.

The in-process tests drive the callback through the Python API (the signal is sent to the test
process itself); the slow ones run ``python -m lightning_offpolicy.cli fit`` as a real subprocess
(one process and 2 DDP ranks) and send it SIGTERM mid-fit, as a scheduler would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import lightning as L
import psutil
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.checkpointing import find_last_checkpoint
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.lightning.preemption import (
    SAVE_ERROR_EXIT_CODE,
    SIGINT_EXIT_CODE,
    SIGTERM_EXIT_CODE,
    PreemptionCheckpoint,
)
from lightning_offpolicy.rollout import AsyncSettings, HFEngine, SamplingConfig
from lightning_offpolicy.rollout.engine import INTERRUPTED
from tests.vllm_fixtures import requires_vllm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import soak_faults  # noqa: E402

STEPS_PER_BATCH = 2  # num_minibatches below, and in configs/quickstart.yaml


class SendSigterm(L.Callback):
    """Sends SIGTERM to this very process at the end of batch ``at_batch`` (as a scheduler would)."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at_batch:
            os.kill(os.getpid(), signal.SIGTERM)


class BatchProbe(L.Callback):
    """Records (batch index, batches Lightning counts as stepped) as each training batch starts."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # `_batches_that_stepped`: the step the batch's values are logged at.
        self.batches.append((batch_idx, trainer.fit_loop.epoch_loop._batches_that_stepped))


def build(
    tmp_path, max_steps: int, callbacks, max_new_tokens: int = 7, val_every: int | None = None, logger=False, **rollout
):
    """The module, its RolloutCallback, a Trainer and the data; ``val_every``: a held-out evaluation (one
    batch of 2 prompts) every that many training batches."""
    module = OffPolicyRLModule(
        model=build_tiny_llama(),
        tokenizer=CharTokenizer(),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        num_minibatches=STEPS_PER_BATCH,
    )
    rollout_callback = RolloutCallback(
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=max_new_tokens), seed=1, **rollout
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[rollout_callback, *callbacks],
        default_root_dir=tmp_path,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **({} if val_every is None else dict(val_check_interval=val_every, check_val_every_n_epoch=None)),
        num_sanity_val_steps=0,
    )
    held_out = {} if val_every is None else dict(num_val_prompts=2, val_prompts_per_step=2)
    data = PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=32, **held_out)
    return module, rollout_callback, trainer, data


def test_lightning_alone_exits_zero_on_sigterm(tmp_path):
    """The problem, in this Lightning version: the SIGTERMException it raises carries no code (status 0)."""
    module, _, trainer, data = build(tmp_path, 40, [SendSigterm(at_batch=1)])
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code is None  # sys.exit(None): the process exits with status 0


def test_sigterm_saves_at_the_batch_boundary_exits_143_and_resumes(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"))
    module, rollout, trainer, data = build(tmp_path, 40, [SendSigterm(at_batch=1), preemption])
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == SIGTERM_EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is given back
    path = tmp_path / "ckpt" / "preempted.ckpt"
    assert preemption.saved_path == str(path) and path.is_file()
    # Signalled at the end of batch 1: saved right there, after 2 batches of 2 optimizer steps.
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["global_step"] == checkpoint["policy_version"] == 2 * STEPS_PER_BATCH == module.policy_version
    saved_weights = {k: v.clone() for k, v in module.policy.state_dict().items()}

    resumed, resumed_rollout, resumed_trainer, data = build(tmp_path, 4 * STEPS_PER_BATCH, [PreemptionCheckpoint()])
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["version"] = pl_module.policy_version
            seen["weights"] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}

    resumed_trainer.callbacks.append(Probe())
    resumed_trainer.fit(resumed, data, ckpt_path=path)  # no SystemExit: finishes normally
    assert seen["version"] == 2 * STEPS_PER_BATCH
    for name, value in saved_weights.items():
        torch.testing.assert_close(seen["weights"][name], value, rtol=0, atol=0)
    assert resumed.policy_version == resumed_trainer.global_step == 4 * STEPS_PER_BATCH
    assert resumed_rollout.generated_batches == 4


class SendSigint(L.Callback):
    """Presses Ctrl-C ``times`` times as batch ``at_batch`` starts (before any of its optimizer steps)."""

    def __init__(self, at_batch: int, times: int = 1) -> None:
        self.at_batch, self.times = at_batch, times

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at_batch:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt), as in a terminal; Lightning leaves SIGINT ignored after
    a KeyboardInterrupt, so it is put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_first_ctrl_c_inside_a_batch_finishes_it_saves_and_exits_130(tmp_path, python_sigint_handler):
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"))
    module, _, trainer, data = build(tmp_path, 40, [SendSigint(at_batch=1), preemption])
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == SIGINT_EXIT_CODE == 130 and preemption.cause == "Ctrl-C"
    # Pressed as batch 1 started: the batch ran to its end, and its state is the checkpoint's.
    checkpoint = torch.load(tmp_path / "ckpt" / "preempted.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2 * STEPS_PER_BATCH == module.policy_version
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_a_second_ctrl_c_stops_at_once_keeping_the_last_completed_batch(tmp_path, python_sigint_handler):
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"))
    module, _, trainer, data = build(tmp_path, 40, [SendSigint(at_batch=1, times=2), preemption])
    with pytest.raises(SystemExit) as info:  # Lightning's KeyboardInterrupt handling exits 1
        trainer.fit(module, data)
    assert info.value.code == 1 and not (tmp_path / "ckpt" / "on_exception.ckpt").exists()
    checkpoint = torch.load(tmp_path / "ckpt" / "preempted.ckpt", weights_only=False)
    assert checkpoint["global_step"] == STEPS_PER_BATCH  # batch 0's end: batch 1 never stepped


def test_without_a_model_checkpoint_each_run_saves_in_its_own_directory(tmp_path):
    """enable_checkpointing=False: the preemption checkpoint goes where a ModelCheckpoint of the run would write
    (its logger's version), not to a `<default_root_dir>/checkpoints` every run started there shares."""
    paths = []
    for _ in range(2):  # two experiments started in the same directory, both preempted
        preemption = PreemptionCheckpoint()
        logger = TensorBoardLogger(save_dir=tmp_path / "logs", name="run")
        module, _, trainer, data = build(tmp_path, 40, [SendSigterm(at_batch=0), preemption], logger=logger)
        with pytest.raises(SystemExit):
            trainer.fit(module, data)
        paths.append(preemption.saved_path)
    root = tmp_path / "logs" / "run"
    assert paths == [str(root / f"version_{v}" / "checkpoints" / "preempted.ckpt") for v in (0, 1)]
    assert all(Path(p).is_file() for p in paths) and not (tmp_path / "checkpoints").exists()
    resumed = L.Trainer(logger=TensorBoardLogger(save_dir=tmp_path / "logs", name="run"), accelerator="cpu")
    assert find_last_checkpoint(resumed) == paths[1]  # --ckpt_path last: the newest of them


def test_sigterm_during_a_generation_cuts_it_short_and_saves_the_last_completed_batch(tmp_path):
    """A scheduler's SIGTERM while the engine generates (a long generation; a remote request that hangs): the
    generation returns at once, interrupted, its batch is not trained, and the last completed batch is saved."""
    engine = HFEngine()
    calls, prompts, generate = [], [], engine.generate
    engine.generate = lambda ids, *args, **kwargs: (
        prompts.append(ids) or calls.append(generate(ids, *args, **kwargs)) or calls[-1]
    )
    steps = {"second call": 0}

    class SigtermInTheSecondGeneration(threading.Event):
        """The engine's interrupt event: the generation asks it once per decoding step."""

        def is_set(self) -> bool:
            if len(calls) == 1:  # the second call is under way
                steps["second call"] += 1
                if steps["second call"] == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler, three steps into it
            return super().is_set()

    engine._interrupt = SigtermInTheSecondGeneration()
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path))
    module, _, trainer, data = build(tmp_path, 40, [preemption], max_new_tokens=200, engine=engine)
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == 143
    assert len(calls) == 2  # the generation the signal landed in was the last: cut short, its batch not trained
    assert any(c.finish_reason == INTERRUPTED for c in calls[1]), [c.finish_reason for c in calls[1]]
    assert steps["second call"] < 200 and max(len(c.token_ids) for c in calls[1]) < 200
    assert module.policy_version == trainer.global_step == STEPS_PER_BATCH
    assert torch.load(preemption.saved_path, weights_only=False)["global_step"] == STEPS_PER_BATCH

    # The resumed run starts with the batch whose rollout was cut: its prompts, at batch index 1, counted
    # as the second batch (its values are logged at step 1, not 2).
    resumed_engine = HFEngine()
    resumed_prompts, generate_again = [], resumed_engine.generate
    resumed_engine.generate = lambda ids, *args, **kwargs: (
        resumed_prompts.append(ids) or generate_again(ids, *args, **kwargs)
    )
    resumed_module, _, resumed_trainer, data = build(
        tmp_path, 2 * STEPS_PER_BATCH, [resumed := BatchProbe()], engine=resumed_engine
    )
    resumed_trainer.fit(resumed_module, data, ckpt_path=preemption.saved_path)
    assert resumed.batches == [(1, 1)]
    assert resumed_prompts == [prompts[1]]
    assert resumed_module.policy_version == 2 * STEPS_PER_BATCH


class SigtermAfterTheEvaluation(L.Callback):
    """Sends SIGTERM to this process as the first held-out evaluation ends."""

    def on_validation_end(self, trainer, pl_module):
        if not getattr(self, "sent", False):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_resume_after_a_sigterm_at_a_validation_batch_logs_at_the_next_step(tmp_path):
    """Lightning resumes a checkpoint whose last batch ran a validation by running that batch's end again,
    which counts it as stepped twice; the preemption checkpoint is saved after the first count (here the
    next batch's generation is stopped, and the state saved is that of the batch before)."""
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path))
    module, _, trainer, data = build(tmp_path, 40, [SigtermAfterTheEvaluation(), preemption], val_every=3)
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == 143
    assert torch.load(preemption.saved_path, weights_only=False)["global_step"] == 3 * STEPS_PER_BATCH

    module, _, trainer, data = build(tmp_path, 5 * STEPS_PER_BATCH, [resumed := BatchProbe()], val_every=3)
    trainer.fit(module, data, ckpt_path=preemption.saved_path)
    assert resumed.batches == [(3, 3), (4, 4)]  # (batch index, the step its values are logged at)


def test_sigterm_during_an_evaluation_stops_it_unlogged_and_the_resume_continues(tmp_path):
    """A validation's generation is cut short too; its completions, cut, are not scored as if whole."""
    engine = HFEngine()
    calls, generate = [], engine.generate

    def sigterm_in_the_first_evaluation(ids, sampling, *args, **kwargs):
        calls.append(sampling.greedy)
        if sampling.greedy:  # the held-out evaluation's first call (training samples)
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(ids, sampling, *args, **kwargs)

    engine.generate = sigterm_in_the_first_evaluation
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path))
    module, _, trainer, data = build(tmp_path, 40, [preemption], val_every=2, engine=engine)
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == 143
    assert calls == [False, False, True]  # two training batches, then the evaluation's greedy call: stopped
    assert not [name for name in trainer.callback_metrics if name.startswith("val/")]
    assert torch.load(preemption.saved_path, weights_only=False)["global_step"] == 2 * STEPS_PER_BATCH

    module, _, trainer, data = build(tmp_path, 4 * STEPS_PER_BATCH, [resumed := BatchProbe()], val_every=2)
    trainer.fit(module, data, ckpt_path=preemption.saved_path)
    assert resumed.batches == [(2, 2), (3, 3)]
    assert module.policy_version == 4 * STEPS_PER_BATCH


def test_sigterm_during_the_last_batch_still_saves_and_exits_143(tmp_path):
    """Lightning stops at the end of the epoch then: the checkpoint is the finished run (resuming ends at once)."""
    before = signal.getsignal(signal.SIGTERM)
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path))
    module, _, trainer, data = build(tmp_path, 2 * STEPS_PER_BATCH, [SendSigterm(at_batch=1), preemption])
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == 143 and module.policy_version == 2 * STEPS_PER_BATCH
    assert torch.load(preemption.saved_path, weights_only=False)["global_step"] == 2 * STEPS_PER_BATCH
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_stops_the_background_producer(tmp_path):
    preemption = PreemptionCheckpoint(dirpath=str(tmp_path))
    module, rollout, trainer, data = build(
        tmp_path,
        40,
        [SendSigterm(at_batch=2), preemption],
        engine=HFEngine(dtype="bfloat16"),
        asynchrony=AsyncSettings(max_staleness=1),
    )
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, data)
    assert info.value.code == 143
    assert rollout.producer is None
    assert not [t for t in threading.enumerate() if t.name == "RolloutProducer" and t.is_alive()]
    assert torch.load(tmp_path / "preempted.ckpt", weights_only=False)["policy_version"] == 3 * STEPS_PER_BATCH


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="exit_code=0"):
        PreemptionCheckpoint(exit_code=0)
    with pytest.raises(ValueError, match="filename"):
        PreemptionCheckpoint(filename="")


# ------------------------------------------------------------------------------ the real CLI, SIGTERM'd
def session_processes(sid: int) -> list[psutil.Process]:
    """Live processes of session ``sid`` (the CLI runs in its own session: its DDP ranks and engines too)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return out


def assert_session_ends(sid: int, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for every process of session ``sid`` to end; fail naming those left."""
    _, alive = psutil.wait_procs(session_processes(sid), timeout=timeout_s)
    assert alive == [], f"processes of the run left running: {[p.pid for p in alive]}"


def run_cli(
    tmp_path: Path,
    name: str,
    *args: str,
    sigterm_after: str | tuple[str, ...] | None = None,
    sigterm_delay_s: float = 3.0,
    timeout: float = 600,
    config: str = "quickstart.yaml",
    whole_group: bool = False,
):
    """``python -m lightning_offpolicy.cli fit`` on ``config``; SIGTERM ``sigterm_delay_s`` after ``sigterm_after``
    (a line, or each of several lines) is logged.

    Returns (exit status, log text). Asserts that no process of its session outlives it.
    """
    log_path = tmp_path / f"{name}.log"
    command = [
        sys.executable, "-m", "lightning_offpolicy.cli", "fit",
        "--config", str(ROOT / "configs" / config),
        f"--trainer.default_root_dir={tmp_path / name}",
        f"--trainer.logger.init_args.save_dir={tmp_path / name}",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.prompts_per_step=4",
        "--rollout.sampling.samples_per_prompt=2",
        *args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        if sigterm_after is not None:
            wanted = (sigterm_after,) if isinstance(sigterm_after, str) else sigterm_after
            while not all(line in log_path.read_text() for line in wanted) and proc.poll() is None:
                assert time.monotonic() < deadline, "the fit did not start in time"
                time.sleep(0.5)
            time.sleep(sigterm_delay_s)
            assert proc.poll() is None, f"the fit ended before the signal:\n{log_path.read_text()[-3000:]}"
            if whole_group:  # as scancel / a container stop: the engine's processes get it too
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        assert_session_ends(proc.pid, timeout_s=30)  # DDP ranks and engine processes exit right after the main one
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return status, log_path.read_text()


def logged_policy_versions(run_dir: Path, name: str = "quickstart") -> list[float]:
    (version,) = [p for p in (run_dir / name).iterdir() if p.is_dir()]
    events = EventAccumulator(str(version))
    events.Reload()
    return [e.value for e in events.Scalars("train/policy_version")]


def sigterm_while_both_ranks_generate(tmp_path: Path, *args: str) -> str:
    """A 2-rank DDP CLI fit whose second generation (engine call) is slow, and SIGTERM to its process group
    once both ranks are in it: both generations are cut short, none comes after, and the fit exits 143.

    Returns the fit's log.
    """
    engine = tmp_path / "engine.yaml"
    engine.write_text(
        "rollout:\n  engine:\n    class_path: tests.marked_engine.MarkedHFEngine\n"
        "    init_args: {dtype: bfloat16, slow_from: 2, step_delay_s: 2.0}\n"
    )
    started = tuple(f"MarkedHFEngine: rank {rank} generation 2 started" for rank in (0, 1))
    status, log = run_cli(
        tmp_path, "first", "--config", str(engine), "--trainer.max_steps=2000", *TWO_RANKS, *args,
        sigterm_after=started, sigterm_delay_s=1.0, whole_group=True,
    )  # fmt: skip
    assert status == SIGTERM_EXIT_CODE, log[-3000:]
    for rank in (0, 1):  # cut short (its eight decoding steps would take 16 s)
        assert f"MarkedHFEngine: rank {rank} generation 2 ended " in log, log[-3000:]
        ended = log.split(f"MarkedHFEngine: rank {rank} generation 2 ended ", 1)[1].splitlines()[0]
        assert INTERRUPTED in ended, ended
    assert "generation 3 started" not in log
    return log


TWO_RANKS = ("--trainer.strategy=ddp", "--trainer.devices=2")


@pytest.mark.slow
@pytest.mark.long("a real SIGTERM to a 2-rank DDP CLI fit while both ranks generate, then its resume")
def test_cli_sigterm_under_two_rank_ddp_cuts_the_generations_short_and_resumes(tmp_path):
    """SIGTERM to the process group while both ranks generate their second batch: each rank's generation
    returns at once, no rank trains that batch (a rank that went on would wait in the step's collectives for
    the other), every rank exits 143, and the checkpoint is that of the first batch (step, policy version and
    logged steps), which the resume continues (it does not restart from 0)."""
    sigterm_while_both_ranks_generate(tmp_path, "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0")
    (path,) = (tmp_path / "first").rglob("preempted.ckpt")
    assert path.parent.name == "checkpoints"  # the ModelCheckpoint's directory
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["global_step"] == checkpoint["policy_version"] == STEPS_PER_BATCH  # the first batch only
    assert logged_policy_versions(tmp_path / "first") == [STEPS_PER_BATCH]

    target = 3 * STEPS_PER_BATCH
    status, log = run_cli(tmp_path, "resumed", f"--trainer.max_steps={target}", f"--ckpt_path={path}", *TWO_RANKS)
    assert status == 0, log[-3000:]
    assert logged_policy_versions(tmp_path / "resumed") == [2 * STEPS_PER_BATCH, target]


@pytest.mark.slow
def test_cli_sigterm_under_two_rank_ddp_during_the_sanity_check_stops(tmp_path):
    """Before training, in the sanity check's evaluation: Lightning's own SIGTERM handler (a broadcast inside
    the handler, run twice on rank 1: the group's signal, then rank 0's forward of it) left rank 1 waiting in
    that broadcast for good. The kit's handler is in place from the sanity check on: the run stops, nothing
    trained, no checkpoint."""
    log = sigterm_while_both_ranks_generate(tmp_path)
    assert not list((tmp_path / "first").rglob("*.ckpt")), log[-3000:]


@requires_vllm
@pytest.mark.slow
@pytest.mark.long("a real SIGTERM to an asynchronous CLI fit with vLLM: its engine processes must end")
@pytest.mark.parametrize(
    "whole_group",
    [False, pytest.param(True, marks=pytest.mark.soak("the soak's sigterm-group fault on configs/vllm_async.yaml"))],
    ids=["main-process", "process-group"],
)
def test_cli_sigterm_with_async_vllm_stops_the_engine_processes(tmp_path, vllm_engine_holder, whole_group):
    """process-group: as scancel, the engine's processes get the signal too, and the weight push after the batch
    in flight fails; that batch had finished its optimizer steps, so its state is saved all the same."""
    vllm_engine_holder.close()  # one engine at a time on a small machine
    status, log = run_cli(
        tmp_path,
        "vllm",
        "--trainer.max_steps=2000",
        config="vllm_async.yaml",
        sigterm_after="first rollout",
        whole_group=whole_group,
    )  # fmt: skip  (run_cli asserts that no process of the run, EngineCore included, is left)
    assert status == SIGTERM_EXIT_CODE, log[-3000:]
    (path,) = (tmp_path / "vllm").rglob("preempted.ckpt")
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["policy_version"] == checkpoint["global_step"] >= STEPS_PER_BATCH
    logged = logged_policy_versions(tmp_path / "vllm", "vllm_async")[-1]
    if whole_group:  # the failed push may have cut the logging of the saved batch short
        assert checkpoint["policy_version"] - logged in (0, STEPS_PER_BATCH), (logged, checkpoint["policy_version"])
    else:
        assert logged == checkpoint["policy_version"]


@requires_vllm
@pytest.mark.slow
@pytest.mark.long(
    "a real SIGTERM to the process group of a CLI fit with vLLM (its EngineCore stops too), "
    "then the checkpoint's resume"
)
@pytest.mark.soak("the soak's sigterm-group fault on configs/vllm.yaml, at test size")
def test_sigterm_to_the_whole_process_group_with_a_synchronous_vllm_engine(tmp_path, vllm_engine_holder):
    """scancel signals every process of the job: vLLM's EngineCore stops too, and the batch being generated
    fails with the engine's error. Still a preemption: status 143 and a checkpoint of the last completed batch."""
    vllm_engine_holder.close()  # one engine at a time on a small machine
    status, log = run_cli(
        tmp_path, "vllm", "--trainer.max_steps=2000", config="vllm.yaml", sigterm_after="first rollout",
        whole_group=True,
    )  # fmt: skip
    assert status == SIGTERM_EXIT_CODE, log[-3000:]
    (path,) = (tmp_path / "vllm").rglob("preempted.ckpt")
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["policy_version"] == checkpoint["global_step"] >= 1
    assert logged_policy_versions(tmp_path / "vllm", "vllm")[-1] == checkpoint["policy_version"]


# ------------------------------------------------------------------------------ --ckpt_path last, a full disk
@pytest.mark.slow
def test_cli_sigterm_mid_fit_exits_143_and_ckpt_path_last_resumes_from_its_checkpoint(tmp_path):
    """SIGTERM mid-fit: exit 143 with a checkpoint of the last completed batch (nothing trained after it). The
    resumed run is a new logger version: `last` must look in the earlier versions' directories, and the run
    continues from the checkpoint's step and data position (`--ckpt_path FILE`: the two-rank DDP test above)."""
    status, log = run_cli(tmp_path, "run", "--trainer.max_steps=2000", sigterm_after="first rollout")
    assert status == SIGTERM_EXIT_CODE, log[-3000:]
    (path,) = (tmp_path / "run").rglob("preempted.ckpt")
    assert path.parent.name == "checkpoints"  # the ModelCheckpoint's directory
    checkpoint = torch.load(path, weights_only=False)
    step = checkpoint["global_step"]
    assert step >= STEPS_PER_BATCH and step % STEPS_PER_BATCH == 0 and checkpoint["policy_version"] == step
    assert logged_policy_versions(tmp_path / "run")[-1] == step  # nothing trained after the checkpoint

    target = step + 2 * STEPS_PER_BATCH
    status, log = run_cli(tmp_path, "run", f"--trainer.max_steps={target}", "--ckpt_path=last")
    assert status == 0, log[-3000:]
    assert f"--ckpt_path last: resuming from {path}" in log
    events = EventAccumulator(str(tmp_path / "run" / "quickstart" / "version_1"))
    events.Reload()
    scalars = events.Scalars("train/policy_version")
    # The resumed run's first step is version step + 2: it continued, it did not restart from 0.
    assert [e.value for e in scalars] == [step + STEPS_PER_BATCH, target]
    # The data position continues: the first batch logged is the one after the checkpoint's.
    assert scalars[0].step == step // STEPS_PER_BATCH
    # The periodic checkpoint of the resumed run holds its final step (target is not a multiple of 100).
    last = tmp_path / "run" / "quickstart" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["policy_version"] == target


def full_disk_cli(tmp_path: Path, every: int, *extra_args: str, sigterm: bool, previous: bool) -> tuple[int, str, Path]:
    """The CLI with its checkpoint directory on a real 6 MiB tmpfs (``soak_faults.full_disk_wrapper``);
    the directory is copied out when the fit ends. A checkpoint of the tiny model is just under 4 MiB: one
    fits, a second beside it does not. ``previous``: a 4 MiB ``last.ckpt`` is there from the start, and must
    come out byte-identical.

    Returns (exit status, log text, the copy of the checkpoint directory).
    """
    if (why := soak_faults.can_mount_tmpfs(tmp_path / "probe")) is not None:
        pytest.skip(why)
    disk, out, before = tmp_path / "disk", tmp_path / "after", tmp_path / "previous.ckpt"
    disk.mkdir()
    out.mkdir()
    before.write_bytes(os.urandom(4 << 20))
    place = f'cp "{before}" "{disk}/last.ckpt" && ' if previous else ""
    extra = tmp_path / "checkpoint.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_offpolicy.lightning.checkpointing.PeriodicCheckpoint\n"
        f"      init_args: {{dirpath: {disk}, every_n_train_steps: {every}, save_last: true, save_top_k: 0}}\n"
    )
    command = [
        sys.executable, "-m", "lightning_offpolicy.cli", "fit",
        "--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(extra),
        f"--trainer.default_root_dir={tmp_path / 'run'}", f"--trainer.logger.init_args.save_dir={tmp_path / 'run'}",
        "--trainer.enable_progress_bar=false", "--data.init_args.prompts_per_step=4",
        "--rollout.sampling.samples_per_prompt=2",
        "--trainer.max_steps=2000", *extra_args,
    ]  # fmt: skip
    log_path = tmp_path / "fit.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*soak_faults.full_disk_wrapper(disk, out, prepare=place), *command],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        if sigterm:
            deadline = time.monotonic() + 600
            while "first rollout" not in log_path.read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, "the fit did not start in time"
                time.sleep(0.5)
            time.sleep(3.0)
            (fit_process,) = [
                p for p in psutil.Process(proc.pid).children(recursive=True) if "lightning_offpolicy.cli" in p.cmdline()
            ]
            fit_process.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=600)
        # Every process of the fit ends with it (a DDP rank left waiting at a barrier would wait for good).
        assert_session_ends(proc.pid, timeout_s=120)
    finally:
        if proc.poll() is None or session_processes(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    if previous:
        assert (out / "last.ckpt").read_bytes() == before.read_bytes(), "the previous checkpoint changed"
    return status, log_path.read_text(), out


@pytest.mark.slow
def test_cli_sigterm_with_a_full_disk_keeps_the_previous_checkpoint_and_does_not_exit_143(tmp_path):
    status, log, after = full_disk_cli(tmp_path, every=1000, sigterm=True, previous=True)
    assert status == SAVE_ERROR_EXIT_CODE == 74, log[-3000:]
    assert sorted(os.listdir(after)) == ["last.ckpt"], "a truncated or temporary file was left"
    assert f"No space left on device (ENOSPC) writing {tmp_path / 'disk' / 'preempted.ckpt'} after " in log
    assert " free on " in log and "exiting with status 74 (not 143" in log


@pytest.mark.slow
@pytest.mark.parametrize("ddp", [(), ("--trainer.strategy=ddp", "--trainer.devices=2")], ids=["1-rank", "ddp"])
def test_cli_periodic_save_on_a_full_disk_fails_naming_enospc_and_keeps_the_previous_checkpoint(tmp_path, ddp):
    """The save at step 2 fits; the one at step 4 does not, beside it: last.ckpt must stay the step-2 one. Under
    DDP rank 0 writes while rank 1 waits at the save's barrier: rank 1 learns of the failure and stops too (with
    NCCL a rank that only sees its peer gone waits for the collective's timeout)."""
    status, log, after = full_disk_cli(tmp_path, 2, *ddp, sigterm=False, previous=False)
    assert status == 1, log[-3000:]
    if ddp:  # rank 1 stops on rank 0's failure, named, not on its connection closing when rank 0 exits
        assert "OSError: the checkpoint " in log and " could not be saved on another rank (see its log)" in log
        assert "Connection closed by peer" not in log
    assert sorted(os.listdir(after)) == ["last.ckpt"], "a truncated or temporary file was left"
    assert torch.load(after / "last.ckpt", weights_only=False)["global_step"] == 2  # complete, and the previous one
    assert (
        f"CheckpointSaveError: Checkpoint not saved: No space left on device (ENOSPC) writing {tmp_path / 'disk'}"
        in log
    )
