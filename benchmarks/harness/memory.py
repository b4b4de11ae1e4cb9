"""This process's memory as Linux reports it: resident set, its peak, the machine's RAM."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

#: Bytes per MB in the reports (decimal, as the tables' "MB" columns).
MB = 1e6


def _proc_kib(path: str, field: str) -> int | None:
    """A ``kB`` field of a /proc file (``field:  value kB``); ``None`` where unreadable."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def status_kib(field: str) -> int | None:
    """A ``kB`` field of this process's /proc/self/status (``VmRSS``, ``VmHWM``); ``None`` where unreadable."""
    return _proc_kib("/proc/self/status", field)


def mem_total_bytes() -> int | None:
    """The machine's RAM from /proc/meminfo (``None`` where it cannot be read)."""
    kib = _proc_kib("/proc/meminfo", "MemTotal")
    return None if kib is None else kib * 1024


def mem_available_bytes() -> int | None:
    """The memory the kernel can give without swapping, from /proc/meminfo (``None`` where unreadable)."""
    kib = _proc_kib("/proc/meminfo", "MemAvailable")
    return None if kib is None else kib * 1024


def rss_bytes() -> int:
    """This process's resident set size (psutil where /proc is missing)."""
    kib = status_kib("VmRSS")
    if kib is None:
        import psutil  # type: ignore[import-not-found]

        return psutil.Process().memory_info().rss
    return kib * 1024


def reset_peak() -> bool:
    """Reset the resident-set peak (``VmHWM``) to the current size.

    Returns:
        Whether it could be reset; where not, :func:`peak_bytes` reads the process's lifetime peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_kib("VmHWM") is not None
    except OSError:
        return False


def peak_bytes(reset_ok: bool) -> int:
    """The resident-set peak since :func:`reset_peak` (``reset_ok``), else since the process started."""
    if reset_ok:
        return status_kib("VmHWM") * 1024
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if sys.platform == "darwin" else ru * 1024


def mb(value: float) -> str:
    """Bytes as whole MB with thousands separators."""
    return f"{value / MB:,.0f}"


def mb_diff(value: float) -> str:
    """A difference in MB: signed, and a plain 0 below 0.5 MB (no "-0")."""
    return "0" if abs(value) < 0.5 * MB else f"{value / MB:+,.0f}"
