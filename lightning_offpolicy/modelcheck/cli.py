"""``lightning-offpolicy check-model``: does every installed engine get the weights of *this* model right?

    lightning-offpolicy check-model path/to/checkpoint          # the user's own config, shrunk
    lightning-offpolicy check-model --family qwen2-tied gemma2  # the built-in families
    lightning-offpolicy check-model --family all --engines hf   # every family, embedded engines only

For each model it builds a tiny random model of the same config
(:func:`~lightning_offpolicy.modelcheck.families.tiny_like`: the architecture, tied or untied output
layer, attention and experts layout kept; no weights are read, nothing is downloaded), runs the
conformance cells of
:mod:`~lightning_offpolicy.modelcheck.matrix` on the engines installed, and prints one row per
model: ``ok`` or why not. Exit status 1 when a cell fails. docs/training.md, "Weight sync across model families".
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

from lightning_offpolicy.modelcheck.families import FAMILIES, build_tiny, family_config, tiny_like
from lightning_offpolicy.modelcheck.matrix import (
    CELLS,
    Cell,
    check_hf_engines,
    check_lora_adapter,
    check_server,
    check_trainer_paths,
    check_vllm,
)

__all__ = ["format_table", "main", "run"]

_ENGINES = ("vllm", "lora-adapter", "server", "hf")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-offpolicy check-model",
        description=(
            "Check that each installed engine has the trainer's weights after a sync, on a tiny random model of "
            "your checkpoint's config (nothing is read but config.json). One row per model: ok, or why not."
        ),
    )
    parser.add_argument("model_dirs", nargs="*", help="checkpoint directories (only their config.json is read)")
    parser.add_argument(
        "--family",
        nargs="+",
        default=[],
        metavar="NAME",
        help=f"built-in families to check as well ('all' for every one): {', '.join(FAMILIES)}",
    )
    parser.add_argument(
        "--engines",
        default="vllm,hf",
        help="comma-separated engines to check: vllm (in-process, memory and file transports, LoRA merged), "
        "lora-adapter (vLLM applying a LoRA adapter itself; one more start per model), server (a local vllm serve "
        "synced by RemoteVLLMEngine through files; one more start per model), hf "
        "(HFEngine bfloat16 and HFProcessEngine). vLLM's cells say 'not checked' where vLLM is not installed.",
    )
    parser.add_argument("--no-lora", action="store_true", help="leave out the LoRA merged cell")
    parser.add_argument(
        "--output",
        default=None,
        help="also write the table, with the versions it was measured with, to this Markdown file "
        "(the engines' own logs go to the console, not into it)",
    )
    return parser


Row = tuple[str, bool, list[Cell]]


def run(models: Sequence[tuple[str, object]], engines: Sequence[str], lora: bool = True) -> list[Row]:
    """The cells of each ``(label, config)``: ``(label, tied, cells)``; the trainer's own paths always."""
    from lightning_offpolicy.rollout.vllm.offline import vllm_available

    have_vllm = vllm_available()
    rows = []
    for label, config in models:
        tiny = tiny_like(config)
        cells: list[Cell] = [check_trainer_paths(build_tiny(tiny))]
        if "vllm" in engines:
            cells += check_vllm(build_tiny(tiny), lora=lora) if have_vllm else _not_checked(CELLS[:4])
        if "lora-adapter" in engines:
            cells += [check_lora_adapter(build_tiny(tiny))] if have_vllm else _not_checked(["vllm lora adapter"])
        if "server" in engines:
            cells += [check_server(build_tiny(tiny))] if have_vllm else _not_checked(["vllm server file"])
        if "hf" in engines:
            cells += check_hf_engines(build_tiny(tiny))
        rows.append((label, bool(getattr(tiny, "tie_word_embeddings", False)), cells))
    return rows


def _not_checked(names: Sequence[str]) -> list[Cell]:
    return [Cell(name, True, None, "vLLM not installed: not checked") for name in names]


def format_table(rows: list[Row]) -> str:
    """A Markdown table: one row per model, one column per cell (``ok`` / ``refused`` / ``FAIL``), then the reasons."""
    names = [name for name in CELLS if any(c.name == name for _, _, cells in rows for c in cells)]
    extra = sorted({c.name for _, _, cells in rows for c in cells} - set(names))
    names += extra
    lines = ["| model | tied | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    notes = []
    for label, tied, cells in rows:
        by_name = {c.name: c for c in cells}
        marks = []
        for name in names:
            cell = by_name.get(name)
            if cell is None:
                marks.append("-")
            elif not cell.ok:
                marks.append("**FAIL**")
                notes.append(f"- {label}, {name}: {cell.detail}")
            elif cell.detail.startswith("refused:"):
                marks.append("refused")
                notes.append(f"- {label}, {name}: {cell.detail}")
            elif cell.detail and cell.max_abs_diff is None:
                marks.append("not checked")
            else:
                marks.append("ok" if cell.max_abs_diff is None else f"ok ({cell.max_abs_diff:.1e})")
        lines.append(f"| {label} | {'yes' if tied else 'no'} | " + " | ".join(marks) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(_ENGINES))
    if unknown or not engines:
        _parser().error(f"--engines: unknown {unknown or 'empty'}; choose from {', '.join(_ENGINES)}")
    families = list(FAMILIES) if "all" in args.family else args.family
    bad = [name for name in families if name not in FAMILIES]
    if bad:
        _parser().error(f"--family: unknown {bad}; known: all, {', '.join(FAMILIES)}")
    if not families and not args.model_dirs:
        _parser().error("give a checkpoint directory, or --family NAME")
    models: list[tuple[str, object]] = []
    for directory in args.model_dirs:
        if not os.path.isfile(os.path.join(directory, "config.json")):
            _parser().error(f"{directory!r} has no config.json: give a Hugging Face checkpoint directory")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory)
        models.append((f"{directory} ({type(config).__name__.removesuffix('Config')})", config))
    models += [(name, family_config(name)) for name in families]
    logging.getLogger("vllm").setLevel(logging.WARNING)
    begin = time.perf_counter()
    rows = run(models, engines, lora=not args.no_lora)
    failed = sum(not c.ok for _, _, cells in rows for c in cells)
    summary = f"{len(rows)} model(s), {failed} failed cell(s), {time.perf_counter() - begin:.0f} s"
    print(format_table(rows) + "\n\n" + summary)
    if args.output:
        words = list(argv) if argv is not None else sys.argv[1:]
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        report = [
            "# check-model",
            "",
            f"- **Command**: `lightning-offpolicy check-model {' '.join(words)}`",
            f"- **Versions**: {_versions()}",
            f"- **Date**: {date}",
            "",
            format_table(rows),
            "",
            summary,
            "",
        ]
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write("\n".join(report))
    return 1 if failed else 0


def _versions() -> str:
    import torch
    import transformers

    from lightning_offpolicy.rollout.vllm.offline import vllm_available

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    if vllm_available():
        import vllm

        parts.append(f"vLLM {vllm.__version__}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
