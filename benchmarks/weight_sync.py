#!/usr/bin/env python
"""Weight sync into an in-process vLLM engine: in memory (shared-memory buckets) vs files, by model size.

For each model (a random float32 trainer, a bfloat16 vLLM engine started from the same weights) and
each ``VLLMEngine(weight_sync=WeightSyncSettings(transport=...))``: the wall time of whole
``update_weights`` calls (the sync check included), the transfer part alone (``last_sync_time_s``),
the bytes moved, and the peak extra memory of the trainer and engine processes together during one
sync (proportional set size, sampled). The transfer bandwidths then give the bytes and seconds of one
sync at 7B and 70B.

Usage::

    python benchmarks/weight_sync.py --output docs/reports/performance_weight_sync.md   # ~6 min, 2 CPU cores
    python benchmarks/weight_sync.py --models tiny --syncs 2 --output /tmp/sync.md      # a smoke test, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# benchmarks/*.py run as scripts: their directory is on sys.path, and with it the shared harness.
from harness.memory import MB
from harness.report import header_bullets, load_bullet, load_prose, method_sections, run_header, write_report
from trainer_memory_worker import MODELS as MEMORY_MODELS

ROOT = Path(__file__).resolve().parent.parent
PROSE = load_prose(__file__)

#: Model shapes: (architecture, config overrides). Random weights, built from the config.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("llama", {}),  # the quickstart's tiny Llama
    "llama-168m": ("llama", MEMORY_MODELS["llama-168m"].config),  # trainer_memory.py's
    # Qwen2-0.5B's shape (494M parameters, the embedding tied to the output layer).
    "qwen2-0.5b": (
        "qwen2",
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
    ),
}
TRANSPORTS = ("file", "memory")
#: Sizes the transfer bandwidths are extrapolated to: parameters (bfloat16 engine: 2 bytes each).
EXTRAPOLATE = {"7B (Qwen2-7B)": 7.62e9, "70B (Llama-3-70B)": 70.6e9}
ENGINE_DTYPE = "bfloat16"
SAMPLE_INTERVAL_S = 0.01


def build_model(name: str):
    import torch

    arch, overrides = MODELS[name]
    torch.manual_seed(0)
    if arch == "llama":
        from transformers import LlamaForCausalLM

        from lightning_offpolicy.demo.tiny import tiny_llama_config

        config = tiny_llama_config(**overrides) if overrides else tiny_llama_config()
        return LlamaForCausalLM(config).float().eval()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**overrides)
    return Qwen2ForCausalLM(config).float().eval()


def _pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` (shared pages split between the processes mapping them)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


class PssSampler:
    """Samples the summed PSS of some processes in a thread; ``peak`` is the largest sum seen."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> int:
        return sum(_pss_bytes(pid) for pid in self.pids)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.total())
            self._stop.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.total())


def _nudge(model, step: int) -> None:
    """Move every weight a little (the sync check's movement test needs the trainer to move)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 1e-3)


def worker(model_name: str, transport: str, syncs: int) -> dict[str, Any]:
    """One model, one transport, in this process: start the engine, time ``syncs`` syncs, sample one."""
    import gc
    import tempfile

    import torch

    from lightning_offpolicy.rollout import VLLMEngine
    from lightning_offpolicy.rollout.vllm import StartSettings, WeightSyncSettings
    from lightning_offpolicy.rollout.vllm import process as vllm_process

    torch.set_num_threads(1)
    model = build_model(model_name)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="weight_sync_bench_") as ckpt:
        model.save_pretrained(ckpt)
        engine = VLLMEngine(
            model=ckpt,
            start=StartSettings(dtype=ENGINE_DTYPE, max_model_len=256, kv_cache_space_gib=1),
            weight_sync=WeightSyncSettings(transport=transport),
            eos_token_id=0,
        )
        try:
            _nudge(model, 0)
            engine.update_weights(model, 0)  # warm-up: the first sync maps / creates what later ones reuse
            walls, transfers = [], []
            for step in range(1, syncs + 1):
                _nudge(model, step)
                gc.collect()
                began = time.perf_counter()
                engine.update_weights(model, step)
                walls.append(time.perf_counter() - began)
                transfers.append(engine.last_sync_time_s)
            _nudge(model, syncs + 1)
            gc.collect()
            pids = [os.getpid(), *sorted(vllm_process.descendants())]
            sampler = PssSampler(pids)
            before = sampler.total()
            with sampler:
                engine.update_weights(model, syncs + 1)
            # The engine's own scores of the sync check's probe: the same weights in every transport's
            # process (same start, same seeded moves), so the transports must agree bit for bit.
            probe_logprobs = engine._engine_probe_logprobs(engine._probe()).tolist()
            return {
                "model": model_name,
                "transport": transport,
                "params": params,
                "trainer_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "bytes": engine.last_sync_bytes,
                "wall_s": walls,
                "transfer_s": transfers,
                "check_diff": engine.last_sync_check_max_abs_diff,
                "probe_logprobs": probe_logprobs,
                "pss_before": before,
                "peak_extra": sampler.peak - before,
                # The shared-memory bucket lives from the first sync to close: in `before`, not in the peak.
                "held_buffer": engine._shared_weights.nbytes if engine._shared_weights is not None else 0,
                "processes": len(pids),
                "start_s": engine.start_time_s,
            }
        finally:
            engine.close()


def run_worker(model: str, transport: str, syncs: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, transport, "--syncs", str(syncs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per model: medians, the memory / file ratios and the bandwidths."""
    out: dict[str, dict[str, float]] = {}
    for model in dict.fromkeys(r["model"] for r in results):
        by = {r["transport"]: r for r in results if r["model"] == model}
        s: dict[str, float] = {}
        for transport, r in by.items():
            s[f"{transport}_wall_s"] = statistics.median(r["wall_s"])
            s[f"{transport}_transfer_s"] = statistics.median(r["transfer_s"])
            s[f"{transport}_bandwidth"] = r["bytes"] / s[f"{transport}_transfer_s"]
            s[f"{transport}_peak_extra"] = r["peak_extra"]
            s[f"{transport}_held_buffer"] = r["held_buffer"]
        if "file" in by and "memory" in by:
            memory, file = by["memory"]["probe_logprobs"], by["file"]["probe_logprobs"]
            s["transports_max_diff"] = max(abs(a - b) for a, b in zip(memory, file, strict=True))
            s["speedup_wall"] = s["file_wall_s"] / s["memory_wall_s"]
            s["speedup_transfer"] = s["file_transfer_s"] / s["memory_transfer_s"]
        out[model] = s
    return out


def _extrapolation_rows(ratios: dict[str, dict[str, float]], model: str) -> list[str]:
    s = ratios[model]
    rows = []
    for label, params in EXTRAPOLATE.items():
        nbytes = params * 2
        cells = [f"{nbytes / s[f'{t}_bandwidth']:.1f}" if f"{t}_bandwidth" in s else "-" for t in TRANSPORTS]
        rows.append(f"| {label} | {nbytes / 1e9:.1f} | " + " | ".join(cells) + " |")
    return rows


def render(results: list[dict[str, Any]], ratios: dict[str, dict[str, float]], header: dict[str, Any]) -> str:
    lines = [
        "# Weight sync: in memory vs files",
        "",
        *header_bullets(header),
        f"- **Wall time of the whole run**: {header['elapsed_s']:.1f} s",
        load_bullet(header["load_start"], header["load_end"]),
        "",
        *method_sections(PROSE["method"].format(syncs=header["syncs"], interval_ms=SAMPLE_INTERVAL_S * 1000)),
        "| model | parameters | transport | bytes / sync MB | sync s (check incl.) | transfer s "
        "| transfer GB/s | peak extra MB | bucket held MB | check max diff |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = ratios[r["model"]]
        t = r["transport"]
        lines.append(
            f"| {r['model']} | {r['params']:,} | {t} | {r['bytes'] / MB:,.0f} | {s[f'{t}_wall_s']:.3f} "
            f"| {s[f'{t}_transfer_s']:.3f} | {s[f'{t}_bandwidth'] / 1e9:.2f} | {r['peak_extra'] / MB:,.0f} "
            f"| {r['held_buffer'] / MB:,.0f} | {r['check_diff']:.3g} |"
        )
    agree = {model: s["transports_max_diff"] for model, s in ratios.items() if "transports_max_diff" in s}
    lines += [
        "",
        "Memory == file (the engine's probe logprobs after the same weights crossed each way): "
        + ", ".join(f"{m} {'bit-identical' if d == 0 else f'**differ by {d:.3g}**'}" for m, d in agree.items())
        + ".",
    ]
    lines += ["", "Ratios (same run), file / memory:", ""]
    for model, s in ratios.items():
        if "speedup_wall" in s:
            lines.append(
                f"- {model}: whole sync **{s['speedup_wall']:.1f}x** faster in memory "
                f"({s['file_wall_s']:.2f} s -> {s['memory_wall_s']:.2f} s), the transfer alone "
                f"{s['speedup_transfer']:.1f}x; peak extra {s['file_peak_extra'] / MB:,.0f} MB -> "
                f"{s['memory_peak_extra'] / MB:,.0f} MB during the sync, plus the "
                f"{s['memory_held_buffer'] / MB:,.0f} MB bucket held between syncs."
            )
    largest = max(ratios, key=lambda m: next(r["params"] for r in results if r["model"] == m))
    lines += [
        "",
        f"## Extrapolated to larger models (the {largest} bandwidths, bfloat16 engine)",
        "",
        PROSE["extrapolation"],
        "",
        "| model | bytes / sync GB | " + " | ".join(f"{t} transfer s" for t in TRANSPORTS) + " |",
        "|---|---:|" + "---:|" * len(TRANSPORTS),
        *_extrapolation_rows(ratios, largest),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--syncs", type=int, default=3, help="timed syncs per model and transport (default 3)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    p.add_argument("--output", type=Path, default=None, help="markdown report (a .json is written next to it)")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "TRANSPORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.syncs)))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    if args.syncs < 1:
        p.error("--syncs must be >= 1")
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    results = []
    for model in models:
        for transport in TRANSPORTS:
            r = run_worker(model, transport, args.syncs, args.timeout)
            results.append(r)
            print(
                f"{model:>11} {transport:>6}: sync {statistics.median(r['wall_s']):.3f} s, transfer "
                f"{statistics.median(r['transfer_s']):.3f} s, {r['bytes'] / MB:,.0f} MB, peak extra "
                f"{r['peak_extra'] / MB:,.0f} MB",
                flush=True,
            )
    ratios = summarize(results)
    import vllm

    header = {
        **run_header("weight_sync.py", argv, f"vLLM {vllm.__version__}"),
        "syncs": args.syncs,
        "elapsed_s": time.perf_counter() - began,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
    write_report(args.output, render(results, ratios, header), {"header": header, "results": results, "ratios": ratios})
    differ = {m: s["transports_max_diff"] for m, s in ratios.items() if s.get("transports_max_diff", 0) != 0}
    if differ:
        print(f"memory and file syncs gave different engines: {differ}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
