#!/usr/bin/env python
"""How many sampled tokens leave the loss under top-p on vLLM, and what the exact kept set costs.

A vLLM engine's worker records the set top-k / top-p kept at each sampled token (the kit's worker
extension reads the finite entries of vLLM's processed logprobs, ``rollout/vllm/kept_sets.py``): every
support known, whatever its width. Without it (a server without the kit's receiver) the engine reads
the support from the top ``support_logprobs`` processed logprobs of each token: a nucleus wider than
that leaves the support unknown, and the token leaves the loss (``rollout/support_unknown_frac``).

``VLLMEngine`` and ``RemoteVLLMEngine`` (a local server, ``--max-logprobs`` = the vocabulary), each
started once, on a tiny Qwen2 with a byte-level BPE vocabulary trained here on Python's own source
files, warmed up on them so that its next-token distributions range from peaked to flat as a real
model's do. For each engine, each top-p and each way of reading the support (recorded; top
``support_logprobs`` K), the same prompts and seeds: the share of sampled tokens whose support is
unknown, the widths of the kept sets, and the generation time against K = 20 (vLLM's default
``max_logprobs``) in the same run.

Usage::

    python benchmarks/vllm_support.py --output docs/reports/performance_vllm_support.md   # ~8 min on 2 cores
    python benchmarks/vllm_support.py --quick                                          # ~3 min
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from harness.report import header_bullets, load_bullet, run_header, write_report

FULL = {"vocab_size": 4096, "sft_steps": 300, "prompts": 64, "new_tokens": 48, "top_p": [0.9, 0.95], "repeats": 2}
QUICK = {"vocab_size": 1024, "sft_steps": 40, "prompts": 16, "new_tokens": 24, "top_p": [0.9], "repeats": 1}


def corpus(limit: int = 4000) -> list[str]:
    """Lines of Python's standard library sources: text a byte-level BPE learns real merges from."""
    import sysconfig

    lines: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        lines += [line.strip() for line in path.read_text(errors="ignore").splitlines() if len(line.strip()) > 20]
        if len(lines) >= limit:
            break
    return lines[:limit]


def build(directory: Path, settings: dict) -> Path:
    """The checkpoint: BPE trained on :func:`corpus`, a tiny Qwen2 warmed up to complete its lines."""
    from lightning_offpolicy.demo.tiny_bpe import build_bpe_checkpoint

    texts = corpus()
    pairs = [(line[: len(line) // 2], line[len(line) // 2 :]) for line in texts]
    return build_bpe_checkpoint(
        directory, texts, vocab_size=settings["vocab_size"], sft_pairs=pairs, sft_steps=settings["sft_steps"]
    )


def measure_engine(engine, prompts: list[list[int]], vocab: int, settings: dict) -> list[dict]:
    """Rows of (top_p, support read, unknown share, kept-set widths, tokens, seconds) on one started engine."""
    from lightning_offpolicy.rollout import SamplingConfig

    name = type(engine).__name__
    engine.generate(prompts[:2], SamplingConfig(max_new_tokens=4, top_p=0.9))  # start-up, not measured
    records = engine.records_kept_sets
    assert records, f"{name}: the worker does not record kept sets"
    rows = []
    for top_p in settings["top_p"]:
        sampling = SamplingConfig(max_new_tokens=settings["new_tokens"], top_p=top_p, samples_per_prompt=2)
        for support in ["recorded", 20, 100, 400, vocab]:
            engine.records_kept_sets = support == "recorded"
            if support != "recorded":
                engine.support_logprobs = support
            seconds, unknown, widths = [], 0, []
            for repeat in range(settings["repeats"]):
                begin = time.perf_counter()
                completions = engine.generate(prompts, sampling, seed=repeat)
                seconds.append(time.perf_counter() - begin)
                for completion in completions:
                    unknown += sum(kept is None for kept in completion.sampling_support)
                    widths += [len(kept) or vocab for kept in completion.sampling_support if kept is not None]
            tokens = len(widths) + unknown
            rows.append({"engine": name, "top_p": top_p, "K": support, "unknown": unknown / tokens, "tokens": tokens,
                         "seconds": min(seconds), "mean_width": sum(widths) / max(len(widths), 1),
                         "max_width": max(widths, default=0)})  # fmt: skip
    engine.records_kept_sets = records
    return rows


def measure(checkpoint: Path, settings: dict) -> tuple[int, list[dict]]:
    """The rows of :func:`measure_engine` on ``VLLMEngine``, then on ``RemoteVLLMEngine`` (a local server)."""
    from transformers import AutoConfig, AutoTokenizer

    from lightning_offpolicy.rollout import VLLMEngine
    from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine, StartSettings, launch_local_server

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [tokenizer(line[: len(line) // 2]).input_ids for line in corpus()[-settings["prompts"] :]]
    eos = tokenizer.eos_token_id
    start = StartSettings(dtype="float32", kv_cache_space_gib=1)
    engine = VLLMEngine(model=str(checkpoint), eos_token_id=eos, start=start, support_logprobs=vocab)
    try:
        rows = measure_engine(engine, prompts, vocab, settings)
    finally:
        engine.close()
    server = launch_local_server(
        str(checkpoint), start=start, startup_timeout_s=600, extra_args=["--max-logprobs", str(vocab)]
    )
    try:
        with RemoteVLLMEngine(server.base_url, eos_token_id=eos) as remote:
            rows += measure_engine(remote, prompts, vocab, settings)
    finally:
        server.close()
    return vocab, rows


def render(header: dict, settings: dict, vocab: int, rows: list[dict]) -> str:
    lines = ["# vLLM: the sampling support under top-p, and the cost of exact supports", "", *header_bullets(header)]
    lines += [load_bullet(*header["load"]), f"- **Vocabulary**: {vocab} (byte-level BPE); settings: {settings}", ""]
    lines += ["The machine is shared and noisy: read the ratios (measured within one run), not the seconds.", ""]
    lines += [
        "| engine | top_p | support read from | tokens out of the loss | kept set: mean / widest | "
        "generation time vs K=20 |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = next(r for r in rows if (r["engine"], r["top_p"], r["K"]) == (row["engine"], row["top_p"], 20))
        read = "the worker's record" if row["K"] == "recorded" else f"top {row['K']} logprobs"
        lines.append(
            f"| {row['engine']} | {row['top_p']} | {read}{' (= vocabulary)' if row['K'] == vocab else ''} | "
            f"{100 * row['unknown']:.1f}% | {row['mean_width']:.0f} / {row['max_width']} | "
            f"{row['seconds'] / base['seconds']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--output", type=Path, default=None, help="Markdown report (a .json next to it)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="vllm_support_") as directory:
        vocab, rows = measure(build(Path(directory) / "ckpt", settings), settings)
    header = {**run_header("vllm_support.py", argv), "load": [load_start, os.getloadavg()[0]]}
    write_report(args.output, render(header, settings, vocab, rows), {"header": header, "vocab": vocab, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
