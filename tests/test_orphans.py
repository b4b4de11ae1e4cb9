"""A killed trainer leaves nothing running and no shared memory behind (without starting vLLM).

rollout/vllm/watchdog.py: the vLLM plugin that stops an engine process once its trainer is gone, armed
here in plain Python children exactly as vLLM arms it (the plugin's entry with the variable the kit
sets). rollout/vllm/leftovers.py: the sweep at an engine start, on real segments in /dev/shm and real
processes. tools/soak_faults.py's ``trainer-sigkilled`` run checks the same on a real fit with vLLM.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import types
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest

from lightning_offpolicy.rollout.vllm import leftovers, watchdog
from lightning_offpolicy.rollout.vllm.watchdog import PLUGIN_NAME, TRAINER_ENV, TrainerToken

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not SHM.is_dir() or not Path("/proc").is_dir(), reason="needs /dev/shm and /proc")

# A child armed as vLLM arms its processes: the plugin's entry point, then the process's own work.
ARMED_CHILD = """
import sys, time
from lightning_offpolicy.rollout.vllm.watchdog import arm
print("armed" if arm() is not None else "not armed", flush=True)
time.sleep(120)
"""
# The trainer: starts the child with the variable the kit sets (optionally in a session of its own, as
# launch_local_server starts its server), reports the child's pid, then waits to be killed.
TRAINER = """
import os, subprocess, sys, time
from lightning_offpolicy.rollout.vllm.watchdog import trainer_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, **trainer_env()},
                         start_new_session=sys.argv[2] == "own-session")
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    return TrainerToken(pid).alive()


def _wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until ``pid`` is gone (``None``: still there after ``timeout_s``)."""
    begin = time.monotonic()
    while time.monotonic() - begin < timeout_s:
        if not _alive(pid):
            return time.monotonic() - begin
        time.sleep(0.05)
    return None


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != TRAINER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@needs_shm
@pytest.mark.parametrize("session", ["same-session", "own-session"])
def test_an_armed_engine_process_dies_within_seconds_of_its_sigkilled_trainer(session):
    """The trainer is SIGKILLed and left unreaped (a zombie, as under a parent that does not wait): the
    child goes within a second or two. In its own session (a local server) it also SIGTERMs its group:
    a grandchild that runs no watchdog goes too."""
    child_code = ARMED_CHILD
    if session == "own-session":
        child_code = "import subprocess; grandchild = subprocess.Popen(['sleep', '120']); print(grandchild.pid)\n"
        child_code += ARMED_CHILD
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, child_code, session], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        pids = [int(trainer.stdout.readline())]
        if session == "own-session":
            pids.append(int(trainer.stdout.readline()))
        assert trainer.stdout.readline().strip() == "armed"
        time.sleep(0.5)
        assert all(_alive(pid) for pid in pids), "the watchdog must leave a child of a live trainer alone"
        trainer.kill()  # not waited for: a zombie trainer is a dead one
        for pid in pids:
            took = _wait_gone(pid, timeout_s=5.0)
            assert took is not None and took < 2.5, f"pid {pid} outlived its trainer ({took})"
    finally:
        trainer.kill()
        trainer.wait()
        for pid in pids if "pids" in locals() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@needs_shm
def test_a_process_whose_trainer_died_before_the_plugin_loaded_stops_at_once():
    """Killed during the engine start (20-45 s on a CPU machine): the process was orphaned before vLLM
    loaded the plugin in it, and goes as soon as it does."""
    env = {**_env(), TRAINER_ENV: str(TrainerToken(_dead_pid()))}
    child = subprocess.run([sys.executable, "-c", ARMED_CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL and child.stdout.strip() == "armed"
    assert "is gone: stopping it" in child.stderr


def test_the_plugin_does_nothing_in_a_process_that_names_no_other_trainer(monkeypatch, caplog):
    """No variable (a vLLM started by hand), the trainer itself (vLLM loads plugins there too), a value that
    is not a token: nothing is armed."""
    monkeypatch.delenv(TRAINER_ENV, raising=False)
    assert watchdog.arm() is None
    monkeypatch.setenv(TRAINER_ENV, str(TrainerToken.of(os.getpid())))
    assert watchdog.arm() is None
    with caplog.at_level(logging.WARNING, logger=watchdog.__name__):
        monkeypatch.setenv(TRAINER_ENV, "not-a-pid")
        assert watchdog.arm() is None
    assert "not-a-pid" in caplog.text
    assert watchdog._armed is None and not any(t.name == "lightning-offpolicy-watchdog" for t in _threads())


def _threads():
    import threading

    return threading.enumerate()


@needs_shm
def test_a_process_that_merely_inherited_the_variable_is_left_alone():
    """The variable names a live process this one does not descend from (it leaked into an unrelated
    program): not armed, and the named process's death does not touch it."""
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    env = {**_env(), TRAINER_ENV: str(TrainerToken.of(unrelated.pid))}
    child = subprocess.Popen([sys.executable, "-c", ARMED_CHILD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "not armed"
        unrelated.kill()
        unrelated.wait()
        time.sleep(1.0)
        assert child.poll() is None
    finally:
        for proc in (unrelated, child):
            proc.kill()
            proc.wait()


@needs_shm
def test_a_trainer_is_its_pid_and_start_time_and_a_zombie_is_dead():
    me = TrainerToken.of(os.getpid())
    assert me.alive() and TrainerToken.parse(str(me)) == me
    assert not TrainerToken(os.getpid(), start="1").alive()  # the pid, reused by another process
    assert TrainerToken.parse("") is None and TrainerToken.parse("12") is None and TrainerToken.parse("1:5") is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = TrainerToken.of(child.pid)
    for _ in range(200):  # it exits, unreaped: os.kill(pid, 0) still succeeds on the zombie
        if not token.alive():
            break
        time.sleep(0.05)
    os.kill(child.pid, 0)
    assert not token.alive()
    child.wait()


def test_the_kit_names_its_process_and_keeps_its_plugin_allowed():
    env = watchdog.trainer_env({})
    assert env == {TRAINER_ENV: str(TrainerToken.of(os.getpid()))}
    assert watchdog.trainer_env({"VLLM_PLUGINS": "foo"})["VLLM_PLUGINS"] == f"foo,{PLUGIN_NAME}"
    assert watchdog.trainer_env({"VLLM_PLUGINS": ""})["VLLM_PLUGINS"] == PLUGIN_NAME
    assert "VLLM_PLUGINS" not in watchdog.trainer_env({"VLLM_PLUGINS": f"foo,{PLUGIN_NAME}"})


def test_the_plugin_entry_point_is_installed():
    """pyproject.toml's entry point, installed (an editable install made before it lacks it: reinstall)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == PLUGIN_NAME]
    assert found, "the kit's vLLM plugin is not installed: reinstall the kit (.venv/bin/pip install -e . --no-deps)"
    assert found[0].load() is watchdog.arm and watchdog.plugin_registered()


def test_an_engine_start_names_the_trainer_only_while_it_starts(monkeypatch, tmp_path):
    """start_llm: vLLM spawns its engine core with the variable; the trainer's environment is restored after."""
    from lightning_offpolicy.rollout.vllm import offline

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(os.environ)
            raise ValueError("stop here")

    fake = types.ModuleType("vllm")
    fake.LLM = LLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.delenv(TRAINER_ENV, raising=False)
    engine = types.SimpleNamespace(
        _start_dtype=None, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, seed=0,
        tensor_parallel_size=1, support_logprobs=20, max_model_len=None, lora_sync="merged", engine_kwargs={},
        kv_cache_space_gib=1,
    )  # fmt: skip
    with pytest.raises(RuntimeError):
        offline.start_llm(engine, str(tmp_path))
    assert seen[TRAINER_ENV] == str(TrainerToken.of(os.getpid()))
    assert TRAINER_ENV not in os.environ


def test_a_local_server_is_started_naming_the_trainer(monkeypatch, tmp_path):
    from lightning_offpolicy.rollout.vllm import server

    seen = {}

    def popen(cmd, env, **kwargs):
        seen.update(env=env, kwargs=kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(server.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="stop here"):
        server.launch_local_server(tmp_path, port=8999, log_file=tmp_path / "server.log")
    assert seen["env"][TRAINER_ENV] == str(TrainerToken.of(os.getpid()))
    assert seen["kwargs"]["start_new_session"] is True
    assert TRAINER_ENV not in os.environ


def _segment(name: str | None, nbytes: int = 1 << 20) -> Path:
    """A real POSIX shared-memory segment in /dev/shm, its pages written, no longer mapped by this process."""
    segment = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    segment.buf[:nbytes] = b"\1" * nbytes
    resource_tracker.unregister(segment._name, "shared_memory")  # the test removes it, not the tracker
    path = SHM / segment.name.lstrip("/")
    segment.close()
    return path


@needs_shm
def test_the_sweep_removes_a_dead_writers_weight_bucket_and_keeps_a_live_ones(caplog):
    host = socket.gethostname()
    dead = _segment(f"{leftovers.BUCKET_PREFIX}{host}-{_dead_pid()}-t3st0001")
    live = _segment(f"{leftovers.BUCKET_PREFIX}{host}-{os.getpid()}-t3st0002")
    other_host = _segment(f"{leftovers.BUCKET_PREFIX}another-host-{_dead_pid()}-t3st0003")
    try:
        with caplog.at_level(logging.WARNING, logger=leftovers.__name__):
            found = leftovers.sweep()
        assert [f.path for f in found.removed_buckets] == [str(dead)]
        assert not dead.exists() and live.exists() and other_host.exists()
        (line,) = [r.getMessage() for r in caplog.records if "weight bucket" in r.getMessage()]
        assert str(dead) in line and "1.0 MiB freed" in line and str(live) not in line
    finally:
        for path in (dead, live, other_host):
            path.unlink(missing_ok=True)


def test_a_weight_bucket_is_named_after_its_writer():
    from lightning_offpolicy.rollout.vllm.sync.shared_weights import SharedWeightsBuffer

    buffer = SharedWeightsBuffer(1 << 10)
    buffer.ensure(1 << 10)
    try:
        assert buffer.path.name.startswith(f"{leftovers.BUCKET_PREFIX}{socket.gethostname()}-{os.getpid()}-")
        assert leftovers._BUCKET.match(buffer.path.name)
    finally:
        buffer.close()


@needs_shm
def test_segments_no_process_uses_are_reported_with_the_command_and_kept(caplog):
    unused = _segment(None)
    held = _segment(None)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import mmap, os, time; f = os.open({str(held)!r}, os.O_RDWR); print(1, flush=True); "
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "1"
        for path in (unused, held):
            os.utime(path, (time.time() - 3600, time.time() - 3600))  # past MIN_AGE_S
        with caplog.at_level(logging.WARNING, logger=leftovers.__name__):
            found = leftovers.sweep()
        paths = {f.path for f in found.unused_segments}
        assert str(unused) in paths and str(held) not in paths
        assert unused.exists() and held.exists()  # reported, never removed by the sweep
        assert any(leftovers.CLEAR_COMMAND in r.getMessage() for r in caplog.records)
        os.utime(unused, None)  # just written: too young to be reported
        assert str(unused) not in {f.path for f in leftovers.unused_segments()}
    finally:
        holder.kill()
        holder.wait()
        for path in (unused, held):
            path.unlink(missing_ok=True)


@needs_shm
def test_the_segments_a_killed_process_mapped_are_removed_and_one_still_held_is_kept():
    """What ``LocalVLLMServer.close`` does for a server that was killed: it knows the segments from when it ran."""
    own, shared = _segment(None), _segment(None)
    mapper = (
        "import mmap, os, sys, time\n"
        "maps = [mmap.mmap(os.open(path, os.O_RDWR), 0) for path in sys.argv[1:]]\n"
        "print(1, flush=True)\n"
        "time.sleep(120)\n"
    )
    victim = subprocess.Popen([sys.executable, "-c", mapper, str(own), str(shared)], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", mapper, str(shared)], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "1" and other.stdout.readline().strip() == "1"
        recorded = leftovers.mapped_segments([victim.pid])
        assert recorded == {str(own), str(shared)}
        assert leftovers.remove_unused_segments(recorded) == []  # alive: nothing removed
        victim.kill()
        victim.wait()
        removed = leftovers.remove_unused_segments(recorded)
        assert [r.path for r in removed] == [str(own)] and removed[0].size == 1 << 20
        assert not own.exists() and shared.exists()  # the other process still maps it
    finally:
        for process in (victim, other):
            process.kill()
            process.wait()
        for path in (own, shared):
            path.unlink(missing_ok=True)


@needs_shm
def test_the_sweep_stops_engine_processes_of_a_dead_trainer_and_nothing_else(caplog):
    dead = str(TrainerToken(_dead_pid()))
    live = str(TrainerToken.of(os.getpid()))

    def start(title: str, trainer: str | None) -> subprocess.Popen:
        env = _env() if trainer is None else {**_env(), TRAINER_ENV: trainer}
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", title], env=env)

    started = {
        "orphan": start("VLLM::EngineCore", dead),
        "live trainer": start("VLLM::EngineCore", live),
        "not vLLM": start("my_script", dead),
        "no trainer": start("VLLM::Worker", None),
    }
    try:
        time.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger=leftovers.__name__):
            found = leftovers.sweep()
        assert started["orphan"].pid in [p.pid for p in found.stopped]
        assert started["orphan"].wait(timeout=5.0) is not None
        for name in ("live trainer", "not vLLM", "no trainer"):
            assert started[name].poll() is None, name
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Stopped")]
        assert f"pid {started['orphan'].pid} " in line
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
