"""The soak's processes: a fit in its own session, the CPU hog beside it, what a fit leaves behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from soak_configs import ROOT


def session_processes(sid: int) -> list[Any]:
    """Live (non-zombie) processes of session ``sid``: what a run started and left behind."""
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != sid and os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.Error, OSError):
            continue
    return out


def describe(procs: list[Any]) -> list[str]:
    names = []
    for proc in procs:
        try:
            # status and parent tell a process that ignored its kill from one still being torn down
            state = f"[{proc.status()}, ppid {proc.ppid()}]"
            names.append(f"{proc.pid} {proc.name()} {state} {' '.join(proc.cmdline())[:120]}")
        except Exception:  # gone while being described
            names.append(str(proc.pid))
    return names


def leftovers_after_exit(sid: int, grace_s: float = 30.0) -> list[str]:
    """Processes of the session still alive ``grace_s`` after its leader exited (then killed)."""
    deadline = time.monotonic() + grace_s
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = session_processes(sid)
    names = describe(left)
    for proc in left:
        try:
            proc.kill()
        except Exception:
            pass
    return names


def start_hog(processes: int) -> list[subprocess.Popen]:
    """Busy-loop processes (one core each) that compete with the run for the CPU."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(processes)
    ]


def stop_hog(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
        hog.wait()


def run_fit(
    configs: list[str],
    args: list[str],
    save_dir: Path,
    timeout_s: float,
    during: Callable[[subprocess.Popen, Path], None] | None = None,
    prefix: Sequence[str] = (),
) -> tuple[int | None, float, str, list[str]]:
    """One ``lightning-offpolicy fit`` in its own session: (exit status, wall s, log tail, leftover processes).

    ``during(process, log_path)`` runs once the fit has started (tools/soak_faults.py stops it
    there); ``prefix`` goes before the command (a wrapper that runs it, e.g. in a mount namespace).
    """
    save_dir.mkdir(parents=True, exist_ok=True)
    command = [*prefix, sys.executable, "-m", "lightning_offpolicy.cli", "fit"]
    for config in configs:
        command += ["--config", str(ROOT / config)]
    command += [
        *args,
        f"--trainer.default_root_dir={save_dir}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=true",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log_path = save_dir / "fit.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            if during is not None:
                during(proc, log_path)
            status: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
        except BaseException:  # the soak itself is stopped (Ctrl-C, SIGTERM): take the run down with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.perf_counter() - started
    leftovers = leftovers_after_exit(proc.pid)
    return status, wall, log_path.read_text()[-4000:], leftovers
