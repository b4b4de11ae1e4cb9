"""Generation micro-benchmark: HFEngine's lean sampling loop against ``transformers``' ``generate``.

Times one ``HFEngine.generate`` call per variant, interleaved (every repeat runs each variant once,
in a rotated order), on one thread, and reports the median seconds per call and the ratio to the
lean loop measured in the same run. Three shapes:

- ``vs_trl``: the task of ``benchmarks/vs_trl.py``: its random-init tiny Llama (vocab 64, hidden
  128, 2 layers, float32, weights shared with the trainer), 8 prompts of 4-7 tokens x 8 samples,
  16 new tokens, temperature 1;
- ``quickstart``: the shape of ``configs/quickstart.yaml``: the tiny Llama (random init, not the
  SFT warm-up), 16 ``reverse``
  prompts x 8 samples, 8 new tokens, temperature 1, the engine's own bfloat16 copy;
- ``long_tail``: the ``vs_trl`` prompts and model, up to 128 new tokens: the random-init model
  ends a row with probability ~1/64 per token, so most rows stop long before the longest one (the
  lean loop drops a row from the forward passes once it stopped; ``generate`` decodes every row to
  the longest one's end).

Variants: ``lean`` and ``generate`` (``HFEngine(sampler=...)``; the lean loop runs under
``torch.inference_mode``); ``lean, no_grad`` (the lean loop under ``no_grad`` only, as ``generate``);
``generate, static cache`` (``generate(cache_implementation="static")``: what a StaticCache buys ``generate``). With
``--compile``, also ``lean, torch.compile`` (the model compiled with ``dynamic=True``; its
compile time is reported apart).

    python benchmarks/generation.py --output docs/reports/performance_generation.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import header_bullets, load_bullet, run_header  # noqa: E402

from lightning_offpolicy.demo.tiny import build_tiny_llama  # noqa: E402
from lightning_offpolicy.rollout.engine import SamplingConfig  # noqa: E402
from lightning_offpolicy.rollout.hf.engine import HFEngine  # noqa: E402

PAD, EOS = 0, 2


def vs_trl_shape() -> dict[str, Any]:
    """The vs_trl task: char prompts of 3-6 letters + ':' (4-7 tokens), ids as its char tokenizer gives them."""
    rng = random.Random(0)
    chars = string.ascii_lowercase + ":"
    texts = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6))) + ":" for _ in range(8)]
    prompts = [[3 + chars.index(c) for c in text] for text in texts]  # <pad>, <bos>, <eos> come first
    return {
        "prompts": prompts,
        "sampling": SamplingConfig(max_new_tokens=16, temperature=1.0, samples_per_prompt=8),
        "dtype": None,
    }


def quickstart_shape() -> dict[str, Any]:
    from lightning_offpolicy.data.tasks import get_task
    from lightning_offpolicy.data.tokenizers import CharTokenizer

    task, tokenizer, rng = get_task("reverse"), CharTokenizer(), random.Random(0)
    prompts = [tokenizer.encode_prompt(task.sample(rng)[0]) for _ in range(16)]
    return {
        "prompts": prompts,
        "sampling": SamplingConfig(max_new_tokens=8, temperature=1.0, samples_per_prompt=8),
        "dtype": "bfloat16",
    }


def long_tail_shape() -> dict[str, Any]:
    shape = vs_trl_shape()
    return {**shape, "sampling": SamplingConfig(max_new_tokens=128, temperature=1.0, samples_per_prompt=8)}


SHAPES: dict[str, Callable[[], dict[str, Any]]] = {
    "vs_trl": vs_trl_shape,
    "quickstart": quickstart_shape,
    "long_tail": long_tail_shape,
}


def _static_generate(engine: HFEngine) -> None:
    """Make ``engine``'s generate path ask for a StaticCache."""
    original = engine._hf_generate

    def patched(model, input_ids, attention_mask, sampling, device):
        generate = model.generate

        def static(*args: Any, **kwargs: Any) -> Any:
            return generate(*args, cache_implementation="static", **kwargs)

        model.generate = static
        try:
            return original(model, input_ids, attention_mask, sampling, device)
        finally:
            del model.generate

    engine._hf_generate = patched  # type: ignore[method-assign]


def build_variants(shape: dict[str, Any], compile_model: bool) -> tuple[dict[str, HFEngine], dict[str, float]]:
    model = build_tiny_llama(vocab_size=64, seed=0)
    variants: dict[str, HFEngine] = {}
    extra: dict[str, float] = {}
    for name, sampler in (
        ("lean", "lean"),
        ("generate", "generate"),
        ("lean, no_grad", "lean"),
        ("generate, static cache", "generate"),
    ):
        engine = HFEngine(dtype=shape["dtype"], pad_token_id=PAD, eos_token_id=EOS, sampler=sampler)
        engine.update_weights(model, version=0)
        if name == "lean, no_grad":
            engine._lean_inference_mode = False
        if name == "generate, static cache":
            _static_generate(engine)
        variants[name] = engine
    if compile_model:
        # A copy of its own (its forward is replaced), compiled in place: the engine still sees a
        # causal LM (an OptimizedModule wrapper would send it back to generate).
        engine = HFEngine(dtype=shape["dtype"], pad_token_id=PAD, eos_token_id=EOS, sampler="lean")
        engine.update_weights(copy.deepcopy(model), version=0)
        engine.model.forward = torch.compile(engine.model.forward, dynamic=True)
        start = time.perf_counter()
        engine.generate(shape["prompts"], shape["sampling"], seed=0)
        extra["compile_first_call_s"] = time.perf_counter() - start
        variants["lean, torch.compile"] = engine
    return variants, extra


def check_equal(variants: dict[str, HFEngine], shape: dict[str, Any]) -> tuple[dict[str, bool], dict[str, float]]:
    """Whether each variant's tokens and logprobs equal ``generate``'s (same seed), exactly; and the
    completion lengths of that call (mean, longest)."""
    reference = variants["generate"].generate(shape["prompts"], shape["sampling"], seed=123)
    lengths = [len(c.token_ids) for c in reference]
    equal = {}
    for name, engine in variants.items():
        got = engine.generate(shape["prompts"], shape["sampling"], seed=123)
        equal[name] = all(
            a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(got, reference, strict=True)
        )
    return equal, {"mean": statistics.mean(lengths), "max": max(lengths)}


def time_variants(variants: dict[str, HFEngine], shape: dict[str, Any], repeats: int, warmup: int) -> dict[str, Any]:
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            start = time.perf_counter()
            variants[name].generate(shape["prompts"], shape["sampling"], seed=repeat)
            elapsed = time.perf_counter() - start
            if repeat >= warmup:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "median_s": medians,
        "min_s": {name: min(values) for name, values in times.items()},
        "ratio_to_lean": {name: medians[name] / medians["lean"] for name in names},
        "repeats": repeats,
    }


def run(shapes: list[str], repeats: int, warmup: int, compile_model: bool) -> dict[str, Any]:
    results = {}
    for key in shapes:
        shape = SHAPES[key]()
        variants, extra = build_variants(shape, compile_model)
        equal, lengths = check_equal(variants, shape)
        timing = time_variants(variants, shape, repeats, warmup)
        sampling: SamplingConfig = shape["sampling"]
        results[key] = {
            "rows": len(shape["prompts"]) * sampling.samples_per_prompt,
            "prompt_tokens": [min(map(len, shape["prompts"])), max(map(len, shape["prompts"]))],
            "max_new_tokens": sampling.max_new_tokens,
            "engine_dtype": shape["dtype"] or "float32 (shared)",
            "equal_to_generate": equal,
            "completion_tokens": lengths,
            **timing,
            **extra,
        }
    return results


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Generation: the lean sampling loop against `generate`",
        "",
        "Generated by `benchmarks/generation.py`. One `HFEngine.generate` call per variant, interleaved,",
        "one thread; median seconds per call over the repeats and the ratio to `lean` from the same run.",
        "\"= generate\": the variant's tokens and logprobs equal `generate`'s for the same seed, exactly.",
        "The machine is shared: the minimum of the repeats is the least disturbed figure.",
        "",
        *header_bullets(report["header"]),
        report["load"],
        "",
    ]
    for key, result in report["results"].items():
        low, high = result["prompt_tokens"]
        lines += [
            f"## {key}: {result['rows']} rows, prompts {low}-{high} tokens, {result['max_new_tokens']} new tokens, "
            f"engine {result['engine_dtype']}",
            "",
            f"Completions: {result['completion_tokens']['mean']:.1f} tokens on average, the longest "
            f"{result['completion_tokens']['max']}.",
            "",
            "| variant | s / call (median) | x lean | s / call (min) | x lean (min) | = generate |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, seconds in result["median_s"].items():
            ratio = result["ratio_to_lean"][name]
            fastest = result["min_s"][name]
            fastest_ratio = fastest / result["min_s"]["lean"]
            same = "yes" if result["equal_to_generate"][name] else "no"
            lines.append(f"| {name} | {seconds:.4f} | {ratio:.2f} | {fastest:.4f} | {fastest_ratio:.2f} | {same} |")
        if "compile_first_call_s" in result:
            lines += ["", f"torch.compile: first call (compilation) {result['compile_first_call_s']:.1f} s."]
        lines += ["", f"{result['repeats']} timed repeats.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few repeats, for a smoke test")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--shapes", default="vs_trl,quickstart,long_tail", help=f"comma separated, of {', '.join(SHAPES)}")
    p.add_argument("--compile", action="store_true", help="also time the lean loop on a torch.compile'd model")
    p.add_argument("--output", type=Path, help="write the Markdown report here (and the .json next to it)")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    repeats, warmup = (3, 1) if args.quick else (args.repeats, args.warmup)
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    results = run(shapes, repeats, warmup, args.compile)
    report = {
        "header": run_header("generation.py", argv if argv is not None else sys.argv[1:], "1 thread"),
        "load": load_bullet(load_start, os.getloadavg()[0]),
        "results": results,
    }
    text = render(report)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")
        args.output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
