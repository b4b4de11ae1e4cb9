#!/usr/bin/env python
"""The training step with the policy's decoder compiled (``compile_policy="on"``) vs eager, on CPU.

For each model and thread count, two fresh subprocesses (eager, compiled; each with an empty inductor
cache, so that the compilation is paid as in a first run) train an ``OffPolicyRLModule`` on packed
rollout batches whose lengths change every step, and time every step. The report gives the first steps
(the compilation) apart from the steady-state median, and the compiled / eager ratio of the latter.

Usage::

    python benchmarks/compile_policy.py --output docs/reports/performance_compile.md     # ~15 min, 2 CPU cores
    python benchmarks/compile_policy.py --models tiny --threads 1 --steps 3 --output /tmp/compile.md  # smoke, ~2 min
    python benchmarks/compile_policy.py --from-json docs/reports/performance_compile.json --output ...  # re-render
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# benchmarks/*.py run as scripts: their directory is on sys.path, and with it the shared harness.
from harness.report import header_bullets, load_bullet, load_prose, method_sections, run_header, write_report
from long_tail_task import MODEL_SHAPE

ROOT = Path(__file__).resolve().parent.parent
PROSE = load_prose(__file__)

#: name -> (what, rows per batch, prompt tokens, completion lengths (low, high, log-uniform), warm-up steps).
MODELS: dict[str, dict[str, Any]] = {
    # benchmarks/vs_trl_task.py's random-init tiny Llama and its batch: 8 prompts x 8 samples, ~22 tokens.
    "tiny": {"rows": 64, "prompt": 8, "completion": (8, 16), "warmup": 2},
    # A 15.7M-parameter Qwen2 (untied head) on rows of very different lengths.
    "qwen2-16m": {"rows": 32, "prompt": 16, "completion": (16, 512), "warmup": 2},
}
#: The long-tail side-by-side's Qwen2 shape, with a larger vocabulary.
QWEN2_16M = dict(MODEL_SHAPE, vocab_size=8192)
MODES = ("eager", "compiled")
#: Tokens per micro-batch: several micro-batches of different lengths per step on the larger model.
MICRO_TOKENS = 4096


def build_model(name: str, directory: Path):
    import torch

    if name == "tiny":
        from transformers import AutoModelForCausalLM
        from vs_trl_task import build_checkpoint

        return AutoModelForCausalLM.from_pretrained(build_checkpoint(directory, seed=0), dtype=torch.float32)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **QWEN2_16M)).float()


def make_batch(spec: dict[str, Any], vocab: int, seed: int):
    """Random prompts and completions; completion lengths log-uniform in the spec's range."""
    import torch

    from lightning_offpolicy.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    low, high = spec["completion"]
    lengths = [
        int(round(math.exp(math.log(low) + float(torch.rand((), generator=gen)) * math.log(high / low))))
        for _ in range(spec["rows"])
    ]
    prompts = [torch.randint(3, vocab, (spec["prompt"],), generator=gen).tolist() for _ in lengths]
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    rows = len(lengths)
    return RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=torch.rand(rows, generator=gen),
        advantages=torch.randn(rows, generator=gen),
        group_ids=[i // 8 for i in range(rows)],
        policy_versions=[0] * rows,
        rollout_logprobs=[[-math.log(vocab)] * n for n in lengths],
        pad_token_id=0,
    )


def worker(name: str, mode: str, threads: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps (after the warm-up ones) and return every step's seconds."""
    import lightning as L
    import torch
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from lightning_offpolicy.data.tokenizers import CharTokenizer
    from lightning_offpolicy.lightning.module import EVAL_MODE_NOTICE, OffPolicyRLModule

    torch.set_num_threads(threads)
    spec = MODELS[name]
    import warnings

    warnings.filterwarnings("ignore", message=EVAL_MODE_NOTICE)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(name, Path(tmp))
        vocab = model.config.vocab_size
        batches = [make_batch(spec, vocab, seed) for seed in range(spec["warmup"] + steps)]
        module = OffPolicyRLModule(
            model=model,
            tokenizer=CharTokenizer(),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
            max_tokens_per_microbatch=MICRO_TOKENS,
            compile_policy="on" if mode == "compiled" else "off",
        )
        times: list[float] = []

        class StepTimer(L.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                self.started = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                times.append(time.perf_counter() - self.started)

        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=len(batches),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[StepTimer()],
        )
        trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    tokens = [int(b.attention_mask.sum()) for b in batches]
    return {
        "model": name,
        "mode": mode,
        "threads": threads,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_s": times,
        "tokens": tokens,
        "warmup": spec["warmup"],
        "graphs": int(counters["stats"]["unique_graphs"]),
    }


def run_worker(name: str, mode: str, threads: int, steps: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=cache)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        out = subprocess.run(
            [sys.executable, __file__, "--worker", name, mode, str(threads), "--steps", str(steps)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
    if out.returncode != 0:
        raise RuntimeError(f"worker {name} {mode} {threads} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, threads): eager and compiled first steps, steady medians, their ratio."""
    rows = []
    keys = sorted({(r["model"], r["threads"]) for r in results}, key=lambda k: (list(MODELS).index(k[0]), k[1]))
    for model, threads in keys:
        by_mode = {r["mode"]: r for r in results if r["model"] == model and r["threads"] == threads}
        row: dict[str, Any] = {"model": model, "threads": threads}
        for mode, r in by_mode.items():
            warm = r["warmup"]
            row[f"{mode}_first_s"] = r["step_s"][0]
            row[f"{mode}_warmup_s"] = sum(r["step_s"][:warm])
            row[f"{mode}_steady_s"] = statistics.median(r["step_s"][warm:])
            row[f"{mode}_graphs"] = r["graphs"]
            row["parameters"] = r["parameters"]
            row["tokens_per_step"] = statistics.mean(r["tokens"])
        if len(by_mode) == 2:
            row["steady_ratio"] = row["compiled_steady_s"] / row["eager_steady_s"]
            # What the compilation costs: the compiled warm-up beyond as many steady compiled steps.
            row["compile_s"] = row["compiled_warmup_s"] - by_mode["compiled"]["warmup"] * row["compiled_steady_s"]
            saved = row["eager_steady_s"] - row["compiled_steady_s"]
            row["break_even_steps"] = row["compile_s"] / saved if saved > 0 else None
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        "# Compiled policy (`compile_policy`): training step, compiled vs eager",
        "",
        *header_bullets(header),
        load_bullet(header["load_start"], header["load_end"]),
        *method_sections(PROSE["method"].format(steps=header["steps"], micro=MICRO_TOKENS)),
        "| model | params | threads | tokens / step | eager s/step | compiled s/step | compiled / eager | "
        "compile s | break-even steps | graphs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        even = r.get("break_even_steps")
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:.2f}M | {r['threads']} | {r['tokens_per_step']:,.0f} | "
            f"{r.get('eager_steady_s', float('nan')):.3f} | {r.get('compiled_steady_s', float('nan')):.3f} | "
            f"{r.get('steady_ratio', float('nan')):.2f} | {r.get('compile_s', float('nan')):.1f} | "
            f"{'never' if even is None else f'{even:.0f}'} | {r.get('compiled_graphs', '-')} |"
        )
    lines += ["", PROSE["reading"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts (default 1,2)")
    p.add_argument("--steps", type=int, default=5, help="timed steady-state steps after the warm-up (default 5)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per subprocess")
    p.add_argument("--output", type=Path, default=None, help="markdown report (a .json is written next to it)")
    p.add_argument("--from-json", type=Path, default=None, help="re-render a report from its JSON (no measurement)")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]), args.steps)))
        return 0
    if args.from_json:
        payload = json.loads(args.from_json.read_text())
        payload["rows"] = summarize(payload["results"])
        write_report(args.output, render(payload["rows"], payload["header"]), payload)
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    load_start = os.getloadavg()[0]
    began = time.perf_counter()
    results = []
    for model in models:
        for n in threads:
            for mode in MODES:
                r = run_worker(model, mode, n, args.steps, args.timeout)
                results.append(r)
                print(f"{model:>10} {n} thread(s) {mode:>8}: " + " ".join(f"{s:.3f}" for s in r["step_s"]), flush=True)
    rows = summarize(results)
    header = {
        **run_header("compile_policy.py", argv),
        "steps": args.steps,
        "elapsed_s": time.perf_counter() - began,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
    write_report(args.output, render(rows, header), {"header": header, "results": results, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
