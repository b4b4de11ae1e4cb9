"""What every benchmark report shares: the machine and code lines, and MB formatting.

The benchmarks run as scripts (``python benchmarks/<name>.py``), so this directory is on
``sys.path`` and they import it as ``_report``; the kit itself comes from the installed package.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


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
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "lightning_offpolicy"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:
        return "unknown (no git)"
    return f"commit {head}" + (" + uncommitted changes in lightning_offpolicy/" if dirty else "")


#: Bytes per MB in the reports (decimal, as the tables' "MB" columns).
MB = 1e6


def status_kib(field: str) -> int | None:
    """A ``kB`` field of this process's /proc/self/status (``VmRSS``, ``VmHWM``); ``None`` where unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def mem_total_bytes() -> int | None:
    """The machine's RAM from /proc/meminfo (``None`` where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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


def mb(value: float) -> str:
    """Bytes as whole MB with thousands separators."""
    return f"{value / MB:,.0f}"


def mb_diff(value: float) -> str:
    """A difference in MB: signed, and a plain 0 below 0.5 MB (no "-0")."""
    return "0" if abs(value) < 0.5 * MB else f"{value / MB:+,.0f}"


def run_header(script: str, argv: list[str], *machine_extras: str) -> dict[str, str]:
    """The machine, date, code and command of a run, as every report's JSON header holds them."""
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
