"""``make soak``'s fault runs: each shipped config stopped as real jobs are stopped, then resumed.

    python tools/soak_faults.py                          # every fault on every config it applies to
    python tools/soak_faults.py --quick --only quickstart vllm_async --faults sigterm-group

Faults (each run as a real ``python -m lightning_offpolicy.cli fit`` in its own session):

* ``sigterm-group``: SIGTERM to the fit's whole process group, as ``scancel`` or a container stop
  sends it (a vLLM config's engine processes get it too), once training is under way; every
  CPU-runnable config, synchronous and asynchronous. Expected: exit status 143 and ``preempted.ckpt``.
* ``engine-killed``: the vLLM ``EngineCore`` process SIGKILLed mid-fit (vLLM configs). Expected: the
  fit fails (a status other than 0 and 143) instead of hanging, with a checkpoint to resume from.
* ``full-disk``: the checkpoint directory on a 6 MiB tmpfs (a private mount namespace, ``unshare``),
  where the second periodic save does not fit (the quickstart). Expected: exit status 1 naming
  ENOSPC, and the first save intact.
* ``trainer-sigkilled``: the training process itself SIGKILLed mid-fit, as the OOM killer does (vLLM
  configs), and left unreaped (a zombie) while its engine processes are watched. Expected: within
  ``ORPHAN_WAIT_S`` every process of the run is gone (its descendants at the kill, its session, any
  process whose environment names it as its trainer: the engine core, its workers, the resource
  tracker), and no ``/dev/shm`` file the run had mapped or open, nor a new weight bucket of it, is left.
  Nothing was saved at the kill, so this run is not resumed (the other faults check the resume).

Every run must leave no process of its session behind, and then (not after ``trainer-sigkilled``)
``--ckpt_path last`` (the full-disk run: the intact checkpoint) resumes for ``--resume-batches``
batches: exit 0, the first logged ``train/policy_version`` is the saved one plus one batch, and the
first resumed batch is logged at the step the checkpoint's batch count says (the data position
continues). Writes ``--output`` (markdown) and the same results as JSON next to it; exit status 1
when a run fails a check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import machine, prepare_tiny_models, run_dir, saved_run_config  # noqa: E402
from soak_configs import ROOT, SoakConfig, run_slug, select_configs, vllm_installed  # noqa: E402
from soak_processes import describe, run_fit, session_processes  # noqa: E402

from lightning_offpolicy.rollout.vllm.leftovers import bucket_prefix  # noqa: E402
from lightning_offpolicy.rollout.vllm.process import is_alive  # noqa: E402

FAULTS = ("sigterm-group", "engine-killed", "full-disk", "trainer-sigkilled")
SIGTERM_STATUS = 143
ORPHAN_WAIT_S = 10.0  # how long the processes of a SIGKILLed trainer may take to go
TRAINER_ENV = "LIGHTNING_OFFPOLICY_TRAINER"  # the variable that names a kit trainer (rollout/vllm/watchdog.py)
SHM = Path("/dev/shm")
DISK_MIB = 6  # one checkpoint of the tiny model (just under 4 MiB) fits, a second beside it does not


@dataclass
class FaultResult:
    """One config under one fault: what happened, and what each check found."""

    config: str
    fault: str
    exit_code: int | None = None
    wall_s: float | None = None
    checkpoint: str | None = None
    saved_version: int | None = None
    resumed_versions: list[float] = field(default_factory=list)
    resumed_first_step: int | None = None
    leftover_processes: list[str] = field(default_factory=list)
    # trainer-sigkilled: the run's processes at the kill, the seconds until the last was gone (None: some
    # outlived ORPHAN_WAIT_S), the /dev/shm files it had mapped or open, the new ones left after the wait
    # (those of the run, and those no process of it had: another program's on a shared machine).
    processes_at_kill: list[str] = field(default_factory=list)
    gone_after_s: float | None = None
    exit_s: dict[int, float] = field(default_factory=dict)  # pid -> seconds from the kill to its exit
    shm_of_run: list[str] = field(default_factory=list)
    shm_left: list[str] = field(default_factory=list)
    shm_new_unattributed: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures


def applies(fault: str, spec: SoakConfig) -> bool:
    """Whether ``fault`` is run on ``spec`` (the engine kill needs vLLM; the disk is the same for every config)."""
    if fault in ("engine-killed", "trainer-sigkilled"):
        return spec.uses_vllm
    if fault == "full-disk":
        return spec.name == "quickstart"
    return True


def scalar_events(directory: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``tag`` in step order, from the TensorBoard event files of ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags().get("scalars", []):
        return []
    return sorted((e.step, e.value) for e in events.Scalars(tag))


def wait_for_training(proc: subprocess.Popen, log_path: Path, after_s: float, timeout_s: float = 900.0) -> bool:
    """Wait until the fit has logged its first rollout, then ``after_s`` more seconds; False if it ended first."""
    deadline = time.monotonic() + timeout_s
    while "first rollout" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    end = time.monotonic() + after_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return True


def sigterm_the_group(after_s: float):
    def during(proc: subprocess.Popen, log_path: Path) -> None:
        if wait_for_training(proc, log_path, after_s):
            os.killpg(proc.pid, signal.SIGTERM)

    return during


def kill_the_engine_core(after_s: float):
    def during(proc: subprocess.Popen, log_path: Path) -> None:
        import psutil

        if not wait_for_training(proc, log_path, after_s):
            return
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
                    child.kill()
            except psutil.Error:
                continue

    return during


def shm_listing() -> set[str]:
    """The names in ``/dev/shm`` now (empty where there is none)."""
    try:
        return {entry.name for entry in os.scandir(SHM)}
    except OSError:
        return set()


def named_trainer(pid: int) -> list[int]:
    """The processes whose environment names ``pid`` as their kit trainer (those ``/proc`` lets us read)."""
    needle = f"{TRAINER_ENV}={pid}:".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != pid:
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if any(item.startswith(needle) for item in environ.split(b"\0")):
                found.append(int(entry.name))
    return found


def shm_files_of(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files (names) that the processes ``pids`` map or hold open."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(errors="replace").splitlines()
            fds = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        for path in [line.split(maxsplit=5)[-1] for line in maps if f"{SHM}/" in line] + fds:
            if path.startswith(f"{SHM}/"):
                names.add(path.removeprefix(f"{SHM}/").removesuffix(" (deleted)"))
    return names


def sigkill_the_trainer(after_s: float, result: FaultResult, shm_before: set[str]):
    """SIGKILL the trainer once training is under way; watch its processes and shared memory go."""

    def during(proc: subprocess.Popen, log_path: Path) -> None:
        import psutil

        if not wait_for_training(proc, log_path, after_s):
            return

        def run_processes() -> list[Any]:
            procs = {p.pid: p for p in session_processes(proc.pid)}
            with contextlib.suppress(psutil.Error):
                procs.update((p.pid, p) for p in psutil.Process(proc.pid).children(recursive=True))
            for pid in named_trainer(proc.pid):
                with contextlib.suppress(psutil.Error):
                    procs.setdefault(pid, psutil.Process(pid))
            return [p for p in procs.values() if is_alive(p)]

        at_kill = run_processes()
        result.processes_at_kill = describe(at_kill)
        of_run = shm_files_of([proc.pid, *(p.pid for p in at_kill)])
        os.kill(proc.pid, signal.SIGKILL)  # not reaped here: a zombie trainer must count as dead too
        killed = time.monotonic()
        left, seen = at_kill, {p.pid: p for p in at_kill}
        while time.monotonic() - killed < ORPHAN_WAIT_S:
            seen.update((p.pid, p) for p in run_processes())
            left = [p for p in seen.values() if is_alive(p)]
            for p in seen.values():
                if p not in left and p.pid not in result.exit_s:
                    result.exit_s[p.pid] = round(time.monotonic() - killed, 2)
            if not left:
                result.gone_after_s = max(result.exit_s.values(), default=0.0)
                break
            time.sleep(0.05)
        if left:  # run_fit then gives them its own grace and kills them: they show as leftovers too
            result.failures.append(f"alive {ORPHAN_WAIT_S:g} s after the kill: {describe(left)}")
        time.sleep(0.5)  # the resource tracker unlinks the run's segments as the last of its processes exits
        new = shm_listing() - shm_before
        bucket = bucket_prefix(proc.pid)  # the kit's, of this trainer
        of_run |= {name for name in new if name.startswith(bucket)}
        result.shm_of_run = sorted(of_run)
        result.shm_left = sorted(name for name in of_run if (SHM / name).exists())
        result.shm_new_unattributed = sorted(new - of_run)
        if result.shm_left:
            result.failures.append(f"{len(result.shm_left)} /dev/shm file(s) of the run left: {result.shm_left}")

    return during


def full_disk_wrapper(disk: Path, out: Path, prepare: str = "") -> list[str]:
    """A command prefix: run the fit with ``disk`` a private ``DISK_MIB`` MiB tmpfs (in a user and mount
    namespace of its own, so no privilege is needed and nothing outside sees it), copy it to ``out`` after.

    Args:
        disk: The directory the tmpfs is mounted on (it exists).
        out: Where the tmpfs's files are copied once the command ends (it exists).
        prepare: Shell commands run on the mounted tmpfs before the command (e.g. a ``cp`` of an earlier
            checkpoint), each followed by ``&&``.
    """
    script = (
        f'mount -t tmpfs -o size={DISK_MIB}M tmpfs "{disk}" && {prepare}'
        f'{{ "$@"; status=$?; cp -a "{disk}/." "{out}/"; exit $status; }}'
    )
    return ["unshare", "-Urm", "sh", "-c", script, "sh"]


def can_mount_tmpfs(scratch: Path) -> str | None:
    """Why a private tmpfs cannot be mounted here (``None``: it can)."""
    if shutil.which("unshare") is None:
        return "needs unshare(1) to mount a size-limited tmpfs"
    scratch.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", f'mount -t tmpfs -o size=1M tmpfs "{scratch}"'], capture_output=True
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a user namespace: {probe.stderr.decode()}"


def fault_one(spec: SoakConfig, fault: str, workdir: Path, quick: bool, resume_batches: int, timeout_s: float):
    """Run ``spec`` under ``fault``, check what it left, and resume from it."""
    import torch

    result = FaultResult(spec.name, fault)
    save_dir = workdir / f"{run_slug(spec.name)}__{fault}"
    shutil.rmtree(save_dir, ignore_errors=True)
    args = [*spec.args, "--trainer.max_steps=100000"]
    if quick:
        args += ["--data.init_args.prompts_per_step=4"]
    after_s = 3.0 if quick else 30.0
    during, prefix, expected = None, [], None
    checkpoints = save_dir / "fit"
    if fault == "sigterm-group":
        during, expected = sigterm_the_group(after_s), SIGTERM_STATUS
    elif fault == "engine-killed":
        during = kill_the_engine_core(after_s)
    elif fault == "trainer-sigkilled":
        during, expected = sigkill_the_trainer(after_s, result, shm_listing()), -signal.SIGKILL
    else:
        disk, checkpoints = save_dir / "disk", save_dir / "after"
        disk.mkdir(parents=True)
        checkpoints.mkdir()
        overlay = save_dir / "checkpoint_on_a_small_disk.yaml"
        overlay.write_text(
            "trainer:\n  callbacks:\n    - class_path: lightning_offpolicy.lightning.checkpointing.PeriodicCheckpoint\n"
            f"      init_args: {{dirpath: {disk}, every_n_train_steps: 2, save_last: true, save_top_k: 0}}\n"
        )
        spec = SoakConfig(spec.name, [*spec.configs, str(overlay)], spec.args, spec.uses_vllm)
        prefix, expected = full_disk_wrapper(disk, checkpoints), 1
    result.exit_code, result.wall_s, result.log_tail, result.leftover_processes = run_fit(
        spec.configs, args, save_dir / "fit", timeout_s, during=during, prefix=prefix
    )
    if result.exit_code is None:
        result.failures.append(f"did not end within {timeout_s:g} s (killed)")
    elif expected is not None and result.exit_code != expected:
        result.failures.append(f"exit status {result.exit_code}, expected {expected}")
    elif expected is None and result.exit_code in (0, SIGTERM_STATUS):
        result.failures.append(f"exit status {result.exit_code} after the engine was killed")
    if result.leftover_processes:
        result.failures.append(f"{len(result.leftover_processes)} process(es) left over")
    if fault == "full-disk" and "No space left on device (ENOSPC)" not in result.log_tail:
        result.failures.append("the failed save did not name ENOSPC")
    if fault == "trainer-sigkilled":
        if not result.processes_at_kill:
            result.failures.append("the fit ended before it could be killed")
        return result  # nothing was saved at the kill: no resume

    # What `--ckpt_path last` resumes from: the newest checkpoint (find_last_checkpoint).
    found = sorted(checkpoints.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    temporary = [p.name for p in checkpoints.rglob(".*.tmp")]  # AtomicCheckpointIO's, of a save cut short
    if not found or temporary:
        result.failures.append(f"no checkpoint, or temporary files left: {temporary}")
        return result
    checkpoint = found[-1]
    if fault == "sigterm-group" and checkpoint.name != "preempted.ckpt":
        result.failures.append(f"the newest checkpoint is {checkpoint.name}, not preempted.ckpt")
    result.checkpoint = str(checkpoint.relative_to(workdir))
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    result.saved_version = int(state["policy_version"])
    directory = run_dir(save_dir / "fit")
    model = saved_run_config(directory).get("model") or {} if directory else {}
    steps_per_batch = int(model.get("ppo_epochs", 1)) * int(model.get("num_minibatches", 1))
    target = result.saved_version + resume_batches * steps_per_batch
    # The full-disk run's checkpoint was copied out of its tmpfs: name it; the others resume with `last`.
    where = f"--ckpt_path={checkpoint}" if fault == "full-disk" else "--ckpt_path=last"
    resume_args = [*args, f"--trainer.max_steps={target}", where]
    resume_configs = spec.configs[:-1] if fault == "full-disk" else spec.configs
    (save_dir / "fit" / "fit.log").rename(save_dir / "fit" / "fault.log")  # the resume writes its own
    status, _, tail, left = run_fit(resume_configs, resume_args, save_dir / "fit", timeout_s)
    resume_log = (save_dir / "fit" / "fit.log").read_text(errors="replace")
    if fault != "full-disk" and f"--ckpt_path last: resuming from {checkpoint}" not in resume_log:
        result.failures.append(f"--ckpt_path last did not resume from {checkpoint.name}")
    resumed = run_dir(save_dir / "fit")
    versions = scalar_events(resumed, "train/policy_version") if resumed else []
    result.resumed_versions = [v for _, v in versions]
    result.resumed_first_step = versions[0][0] if versions else None
    expected_versions = [float(result.saved_version + steps_per_batch), float(target)]
    if (
        status != 0
        or left
        or result.resumed_versions[:1] + result.resumed_versions[-1:] != expected_versions
        or result.resumed_first_step != result.saved_version // steps_per_batch
    ):
        result.failures.append(
            f"resume from {checkpoint.name} (version {result.saved_version}): exit {status}, versions "
            f"{result.resumed_versions} from step {result.resumed_first_step}, expected {expected_versions[0]:g}.."
            f"{target} from step {result.saved_version // steps_per_batch}, leftovers {left}"
        )
        result.log_tail = tail
    return result


def markdown(results: list[FaultResult], skipped: list[tuple[str, str, str]], meta: dict[str, Any]) -> str:
    mode = "`--quick` (small batches, the fault a few seconds in)" if meta["quick"] else "the configs' own sizes"
    lines = [
        "# Soak: faults, and the resume from what each left",
        "",
        f"`python tools/soak_faults.py`, {mode}; {meta['machine']}. Total wall time "
        f"**{meta['wall_s'] / 60:.1f} min**; {sum(r.ok for r in results)} of {len(results)} runs passed every check.",
        "",
        "Checks per run: the exit status the fault calls for (143 after SIGTERM; not 0 or 143 after the engine "
        "was killed; 1 naming ENOSPC on a full disk); no process of the run's session outlives it; a complete "
        "checkpoint and no temporary file; the resume (`--ckpt_path last`) exits 0, its first logged policy "
        "version is the saved one plus one batch, logged at the step of the checkpoint's batch count. After a "
        f"SIGKILL of the trainer (exit -9): every process of the run gone within {ORPHAN_WAIT_S:g} s and none of its "
        "shared-memory files left; no resume (nothing is saved at a SIGKILL).",
        "",
        "| config | fault | exit | fit wall s | checkpoint | saved version | resumed versions (first step) "
        "| leftovers | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        versions = "-" if not r.resumed_versions else f"{r.resumed_versions[0]:g}..{r.resumed_versions[-1]:g}"
        name = Path(r.checkpoint).name if r.checkpoint else "-"
        verdict = "pass" if r.ok else "FAIL: " + "; ".join(r.failures)
        lines.append(
            f"| {r.config} | {r.fault} | {r.exit_code} | {r.wall_s or 0:.0f} | {name} | {r.saved_version} "
            f"| {versions} ({r.resumed_first_step}) | {len(r.leftover_processes)} | {verdict} |"
        )
    killed = [r for r in results if r.fault == "trainer-sigkilled"]
    if killed:
        lines += [
            "",
            f"`trainer-sigkilled`: the processes of the run at the kill (the trainer, its engine's, the resource "
            f"tracker), the seconds until the last was gone (limit {ORPHAN_WAIT_S:g} s), the `/dev/shm` files the run "
            "had mapped or open and those left after; new files no process of the run had are another program's.",
            "",
            "| config | processes at the kill | gone after s | /dev/shm files of the run | left | new, not the run's |",
            "|---|---|---|---|---|---|",
        ]
        for r in killed:
            lines.append(
                f"| {r.config} | {len(r.processes_at_kill)} | {r.gone_after_s if r.gone_after_s is not None else '-'} "
                f"| {len(r.shm_of_run)} | {len(r.shm_left)} | {len(r.shm_new_unattributed)} |"
            )
    if skipped:
        lines += ["", "Not run:", ""] + [f"- `{config}` {fault}: {why}" for config, fault, why in skipped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batches, the fault 3 s into training")
    parser.add_argument("--only", nargs="*", default=None, help="configs to run (quickstart vllm_async ...)")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS, help="faults to run")
    parser.add_argument("--resume-batches", type=int, default=2, help="batches trained after resuming")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one fit may take")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "soak_faults", help="where runs write")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "docs" / "reports" / "soak_faults.md", help="markdown report"
    )
    args = parser.parse_args(argv)
    if args.resume_batches < 1:
        parser.error("--resume-batches must be >= 1")
    specs = select_configs(parser, args.only)
    has_vllm, no_tmpfs = vllm_installed(), can_mount_tmpfs(args.workdir / ".probe")
    plan, skipped = [], []
    for spec in specs:
        for fault in args.faults:
            if not applies(fault, spec):
                continue
            why = spec.skip_reason or (
                "needs vLLM, which is not installed" if spec.uses_vllm and not has_vllm
                else no_tmpfs if fault == "full-disk" else None
            )  # fmt: skip
            (skipped.append((spec.name, fault, why)) if why else plan.append((spec, fault)))
    started = time.perf_counter()
    prepare_tiny_models([spec for spec, _ in plan])
    results = []
    for spec, fault in plan:
        print(f"soak faults: {spec.name} [{fault}] ...", flush=True)
        result = fault_one(spec, fault, args.workdir, args.quick, args.resume_batches, args.timeout)
        print(f"soak faults: {spec.name} [{fault}]: {'pass' if result.ok else result.failures}", flush=True)
        if result.ok:
            result.log_tail = ""
        results.append(result)
        meta = {"quick": args.quick, "machine": machine(), "wall_s": time.perf_counter() - started}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(markdown(results, skipped, meta))
        payload = {"meta": meta, "runs": [{**asdict(r), "ok": r.ok} for r in results], "skipped": skipped}
        args.output.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    print(f"soak faults: {sum(r.ok for r in results)}/{len(results)} runs passed; report in {args.output}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
