"""What every report shares: the machine, date, code and command lines, the load, and writing it out."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from harness.memory import mem_total_bytes

#: The repository's root (the scripts' folders are one level below it).
ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def code_line() -> str:
    """The measured commit, and whether lightning_offpolicy/ has uncommitted changes (read-only git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "lightning_offpolicy"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:
        return "unknown (no git)"
    return f"commit {head}" + (" + uncommitted changes in lightning_offpolicy/" if dirty else "")


def machine_line(*extras: str) -> str:
    """CPU, cores, RAM, torch and Python versions, then ``extras`` (settings a benchmark depends on)."""
    import torch

    mem = mem_total_bytes()
    parts = [
        cpu_model(),
        f"nproc={os.cpu_count()}",
        *([f"RAM {mem / 1024**3:.1f} GiB"] if mem else []),
        f"torch {torch.__version__}",
        f"Python {platform.python_version()}",
        *extras,
    ]
    return ", ".join(parts)


def run_header(script: str, argv: list[str], *machine_extras: str) -> dict[str, str]:
    """The machine, date, code and command of a run, as every report's JSON header holds them.

    Args:
        script: the script's file name under ``benchmarks/``.
        argv: its command-line arguments.
        machine_extras: settings the measurement depends on, appended to the machine line.
    """
    import datetime
    import shlex

    return {
        "machine": machine_line(*machine_extras),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code_line(),
        "command": " ".join(shlex.quote(a) for a in ["python", f"benchmarks/{script}", *argv]),
    }


def header_bullets(header: dict[str, str]) -> list[str]:
    """The markdown lines of :func:`run_header`."""
    return [
        f"- **Machine**: {header['machine']}",
        f"- **Date**: {header['date']}",
        f"- **Code**: {header['code']}",
        f"- **Command**: `{header['command']}`",
    ]


def load_bullet(start: float, end: float) -> str:
    """The 1-minute load average at the start and the end of a run: how busy the shared machine was."""
    return f"- **Load average** (1 min) at the start / end: {start:.1f} / {end:.1f} on {os.cpu_count()} cores"


def method_sections(method: str, *before: str) -> list[str]:
    """The report lines from the note on the shared machine to the Results heading.

    Args:
        method: the report's method text.
        before: lines between the note and the Method heading (what else the reader must know first).
    """
    return [
        "The machine is shared and noisy: read the ratios (measured within one run), not the seconds.",
        *before,
        "",
        "## Method",
        "",
        method,
        "",
        "## Results",
        "",
    ]


def write_report(output: Path | None, markdown: str, payload: Any) -> None:
    """Print the report; with ``output``, write it there and ``payload`` as JSON beside it (``.json``)."""
    print(markdown)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(markdown)
        output.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")


def load_prose(script: str | Path) -> dict[str, str]:
    """The fixed prose of a script's report, kept out of its code, by section.

    Args:
        script: the script's path (``__file__``); its prose is ``templates/<stem>.md`` beside it.

    Returns:
        Section name -> text. A section starts at a line ``<!-- prose: NAME -->`` and runs to the next
        such line or the end of the file; its text has neither the newline after its marker nor the one
        before the next marker (or ending the file).
        A text may hold ``str.format`` fields, which the script fills.
    """
    path = Path(script).resolve().parent / "templates" / (Path(script).stem + ".md")
    sections: dict[str, str] = {}
    name, lines = None, []
    for line in path.read_text().split("\n"):
        if line.startswith("<!-- prose: ") and line.endswith(" -->"):
            if name is not None:
                sections[name] = "\n".join(lines)
            name, lines = line[len("<!-- prose: ") : -len(" -->")], []
        elif name is not None:
            lines.append(line)
    if name is not None:
        sections[name] = "\n".join(lines).removesuffix("\n")
    return sections
