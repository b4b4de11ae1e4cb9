"""tools/soak.py and soak_faults.py: their readers and checks on real files and processes, quick runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import soak  # noqa: E402
import soak_faults  # noqa: E402

from tests.vllm_fixtures import requires_vllm  # noqa: E402


def test_reward_blocks_are_a_quarter_of_the_batches_at_most_30():
    assert soak.reward_blocks([0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]) == (0.0, 1.0)  # blocks of 2
    rewards = [i / 199 for i in range(200)]  # blocks of 30: means of 0..29 and 170..199, over 199
    first, last = soak.reward_blocks(rewards)
    assert first == pytest.approx(14.5 / 199) and last == pytest.approx(184.5 / 199)
    assert soak.reward_blocks([0.3]) is None


def test_scalars_come_back_in_step_order_from_real_event_files(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run" / "version_0"))
    for step, value in [(2, 0.5), (0, 0.1), (1, 0.3)]:
        writer.add_scalar("train/reward", value, step)
    writer.close()
    directory = soak.run_dir(tmp_path / "run")
    assert directory == tmp_path / "run" / "version_0"
    assert soak.scalars(directory, "train/reward") == pytest.approx([0.1, 0.3, 0.5])
    assert soak.scalars(directory, "staleness/max") == []


def test_a_process_left_over_by_a_run_is_found_and_killed():
    script = (
        "import subprocess, sys; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])"  # outlives its parent
    )
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    leader.wait(timeout=60)
    time.sleep(0.5)
    left = soak.leftovers_after_exit(leader.pid, grace_s=1.0)
    assert len(left) == 1 and "time.sleep(120)" in left[0]
    assert "[sleeping, ppid " in left[0] or "[running, ppid " in left[0]  # state and parent, for the report
    assert soak.leftovers_after_exit(leader.pid, grace_s=5.0) == []  # killed


def test_every_shipped_config_is_run_or_skipped_with_a_reason():
    specs = soak.shipped_configs()
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")}
    assert {s.configs[-1] for s in specs} == files and len(specs) == len(files)
    by_name = {s.name: s for s in specs}
    assert by_name["fsdp"].skip_reason and "GPU" in by_name["fsdp"].skip_reason
    lora = by_name["lora_single_gpu (CPU form)"]
    assert lora.skip_reason is None and "--model.model=tiny:reverse" in lora.args
    assert by_name["correction/cispo"].configs == [soak.BASE, "configs/correction/cispo.yaml"]
    assert by_name["vllm_async"].uses_vllm and not by_name["quickstart"].uses_vllm
    # Its checkpoint is built by the example its header names, so it runs like every other config.
    assert by_name["reasoning_gym"].skip_reason is None


def test_a_gpu_recipe_without_a_cpu_form_is_skipped():
    reason = soak._not_cpu_runnable({"trainer": {"accelerator": "gpu"}, "model": {"model": "tiny:reverse"}})
    assert "accelerator='gpu'" in reason
    assert "not built locally" in soak._not_cpu_runnable({"model": {"model": "Qwen/Qwen2.5-0.5B"}})
    assert soak._not_cpu_runnable({"trainer": {"accelerator": "cpu"}, "model": {"model": "tiny:copy"}}) is None
    assert soak._not_cpu_runnable({"model": {"model": "checkpoints/tiny-qwen2-arith"}}) is None
    assert soak.BUILT_CHECKPOINTS["checkpoints/tiny-qwen2-arith"][0] == "examples/own_model_and_data.py"


def run_quick(tmp_path: Path, *args: str) -> dict:
    status = soak.main(["--quick", "--workdir", str(tmp_path / "runs"), "--output", str(tmp_path / "soak.md"), *args])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert status == 0, [(r["config"], r["condition"], r["failures"], r["log_tail"][-1500:]) for r in report["runs"]]
    markdown = (tmp_path / "soak.md").read_text()
    for run in report["runs"]:
        assert run["ok"] and run["exit_code"] == 0 and run["resume_ok"] and not run["leftover_processes"]
        assert run["staleness_max"] <= run["staleness_bound"]
        assert f"| {run['config']} | {run['condition']} | 0 |" in markdown
    return report


@pytest.mark.slow
@pytest.mark.long("the soak's two conditions, one real quickstart fit quiet and one beside its busy-loop hog")
@pytest.mark.soak("tools/soak.py on a real fit, quiet and beside its hog")
def test_quick_soak_of_the_quickstart_quiet_and_beside_a_hog(tmp_path):
    report = run_quick(tmp_path, "--only", "quickstart")
    assert [(r["config"], r["condition"]) for r in report["runs"]] == [("quickstart", "quiet"), ("quickstart", "hog")]
    for run in report["runs"]:
        assert run["batches"] == 2  # --quick-steps 4 at 2 optimizer steps per batch
        assert run["resumed_versions"] == [6.0, 8.0]  # continued from version 4, 2 more batches


@requires_vllm
@pytest.mark.slow
@pytest.mark.long(
    "a real configs/vllm_async.yaml fit under tools/soak.py: the vLLM engine's processes and "
    "their exit are what the soak checks"
)
@pytest.mark.soak("tools/soak.py on a real vLLM fit")
def test_quick_soak_of_the_async_vllm_config(tmp_path, vllm_engine_holder):
    vllm_engine_holder.close()  # one engine at a time on a small machine
    report = run_quick(tmp_path, "--only", "vllm_async", "--conditions", "quiet")
    (run,) = report["runs"]
    assert run["staleness_bound"] == 2


def test_resume_keeps_the_passed_runs_of_the_same_mode_and_reruns_the_rest(tmp_path):
    output = tmp_path / "soak.md"
    passed = soak.RunResult(config="quickstart", condition="quiet", exit_code=0, wall_s=90.0, batches=150)
    failed = soak.RunResult(config="quickstart", condition="hog", exit_code=1, failures=["exit status 1"])
    other = soak.RunResult(config="correction/cispo", condition="hog", exit_code=0, batches=150)
    runs = [{**soak.asdict(r), "ok": r.ok} for r in (passed, failed, other)]
    payload = {"meta": {"quick": False, "wall_s": 500.0}, "runs": runs}
    output.with_suffix(".json").write_text(json.dumps(payload))
    earlier, wall_s = soak.earlier_runs(output, quick=False)
    assert earlier == {
        ("quickstart", "quiet"): passed, ("quickstart", "hog"): failed, ("correction/cispo", "hog"): other
    }  # fmt: skip
    assert wall_s == 500.0
    assert soak.earlier_runs(output, quick=True) == ({}, 0.0)  # a quick run never stands for a full one
    assert soak.earlier_runs(tmp_path / "none.md", quick=False) == ({}, 0.0)
    # The passed run is not run again; the runs outside this plan (a failure included) stay in the report.
    assert soak.main(["--only", "quickstart", "--conditions", "quiet", "--resume", "--output", str(output)]) == 0
    report = json.loads(output.with_suffix(".json").read_text())
    assert [(r["config"], r["condition"], r["ok"]) for r in report["runs"]] == [
        ("quickstart", "quiet", True), ("quickstart", "hog", False), ("correction/cispo", "hog", True)
    ]  # fmt: skip
    assert report["meta"]["wall_s"] >= 500.0 and report["meta"]["pending"] == []
    assert "| quickstart | quiet | 0 | 90 | 150 |" in output.read_text()


def test_an_interrupted_report_lists_the_runs_still_to_do():
    done = soak.RunResult(config="quickstart", condition="quiet", exit_code=0, wall_s=90.0, batches=150)
    meta = {"quick": False, "machine": "m", "wall_s": 90.0, "resume_batches": 2, "hog_processes": 1,
            "conditions": ["quiet", "hog"], "pending": [("quickstart", "hog"), ("vllm", "quiet")]}  # fmt: skip
    text = soak.markdown([done], [], meta)
    assert "1 of 1 runs passed" in text and "Not run yet" in text
    assert "- `quickstart` [hog]" in text and "- `vllm` [quiet]" in text
    assert "Not run yet" not in soak.markdown([done], [], {**meta, "pending": []})


def test_report_only_rewrites_the_report_and_lists_what_is_still_to_run(tmp_path):
    output = tmp_path / "soak.md"
    passed = soak.RunResult(config="quickstart", condition="quiet", exit_code=0, wall_s=90.0, batches=150)
    payload = {"meta": {"quick": False, "wall_s": 90.0}, "runs": [{**soak.asdict(passed), "ok": True}]}
    output.with_suffix(".json").write_text(json.dumps(payload))
    started, handler = time.monotonic(), signal.getsignal(signal.SIGTERM)
    assert soak.main(["--only", "quickstart", "--report-only", "--output", str(output)]) == 0
    assert time.monotonic() - started < 30  # nothing ran
    # Its SIGTERM handler (a clean stop) is the caller's again: left in place, a later SIGTERM in the same
    # process (a test's preemption) raised KeyboardInterrupt, which Lightning turns into exit status 1.
    assert signal.getsignal(signal.SIGTERM) is handler
    report = json.loads(output.with_suffix(".json").read_text())
    assert [(r["config"], r["condition"]) for r in report["runs"]] == [("quickstart", "quiet")]
    assert report["meta"]["pending"] == [["quickstart", "hog"]]
    assert "- `quickstart` [hog]" in output.read_text()


@pytest.mark.slow
@pytest.mark.soak("tools/soak.py stopped mid-run")
def test_a_stopped_soak_takes_its_run_and_hog_down_and_keeps_its_report(tmp_path):
    import os
    import signal

    import psutil

    output = tmp_path / "soak.md"
    command = [sys.executable, str(ROOT / "tools" / "soak.py"), "--quick", "--only", "quickstart", "--conditions",
               "hog", "--workdir", str(tmp_path / "runs"), "--output", str(output)]  # fmt: skip
    log = tmp_path / "soak.log"
    with open(log, "w") as out:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while "quickstart [hog] ..." not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)
        time.sleep(5.0)  # the fit and the hog are running
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 2  # the hog and the fit (and the fit's own children)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(2.0)
    left = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], left
    report = json.loads(output.with_suffix(".json").read_text())
    assert report["runs"] == [] and report["meta"]["pending"] == [["quickstart", "hog"]]


# ------------------------------------------------------------------------------ tools/soak_faults.py


def test_every_fault_applies_where_it_can_happen():
    specs = {s.name: s for s in soak.shipped_configs()}
    assert soak_faults.applies("sigterm-group", specs["quickstart"])
    assert soak_faults.applies("engine-killed", specs["vllm_async"])
    assert not soak_faults.applies("engine-killed", specs["quickstart"])  # no engine process to kill
    assert soak_faults.applies("trainer-sigkilled", specs["vllm"])  # its engine processes must not outlive it
    assert not soak_faults.applies("trainer-sigkilled", specs["quickstart"])
    assert [name for name, s in specs.items() if soak_faults.applies("full-disk", s)] == ["quickstart"]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm and /proc")
def test_the_sigkill_fault_finds_the_processes_that_name_the_trainer_and_their_shared_memory(tmp_path):
    import os

    held = Path("/dev/shm") / f"soak_test_{os.getpid()}"
    held.write_bytes(b"x")
    code = f"import os, time; f = os.open({str(held)!r}, os.O_RDONLY); print(1, flush=True); time.sleep(60)"
    env = {**os.environ, soak_faults.TRAINER_ENV: f"{os.getpid()}:"}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"
        assert child.pid in soak_faults.named_trainer(os.getpid())
        assert held.name in soak_faults.shm_files_of([child.pid]) and held.name in soak_faults.shm_listing()
    finally:
        child.kill()
        child.wait()
        held.unlink()


@pytest.mark.slow
@pytest.mark.long("a real quickstart fit SIGTERMed as a process group, then its resume: what the fault run checks")
@pytest.mark.soak("tools/soak_faults.py on a real fit")
def test_quick_fault_run_sigterm_to_the_group_then_resume(tmp_path):
    output = tmp_path / "faults.md"
    status = soak_faults.main(
        ["--quick", "--only", "quickstart", "--faults", "sigterm-group", "--workdir", str(tmp_path / "runs"),
         "--output", str(output)]
    )  # fmt: skip
    report = json.loads(output.with_suffix(".json").read_text())
    (run,) = report["runs"]
    assert status == 0 and run["ok"], run
    assert run["exit_code"] == 143 and run["checkpoint"].endswith("preempted.ckpt")
    saved = run["saved_version"]
    assert saved >= 2 and run["resumed_versions"] == [saved + 2.0, saved + 4.0]  # 2 optimizer steps per batch
    assert run["resumed_first_step"] == saved // 2
    assert "| quickstart | sigterm-group | 143 |" in output.read_text()
