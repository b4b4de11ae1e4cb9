"""Small modules stay small: no module of the package over :data:`MAX_LINES` lines (the limit's one place).

A module that grows past it splits along its seams (docs/architecture.md); an exception would be named
in :data:`EXCEPTIONS` with its reason. There is none.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_offpolicy"

#: The most lines a module of the package may have.
MAX_LINES = 500

#: Modules allowed past MAX_LINES (path relative to the package -> why). Empty on purpose.
EXCEPTIONS: dict[str, str] = {}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_is_over_the_limit():
    sizes = {str(path.relative_to(PACKAGE)): _lines(path) for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(sizes) > 100  # the package, not an empty glob
    over = {name: n for name, n in sizes.items() if n > MAX_LINES and name not in EXCEPTIONS}
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"
    assert set(EXCEPTIONS) <= set(sizes), "an exception names a module that no longer exists"


def test_the_line_count_is_what_wc_counts(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("a = 1\n\nb = 2\n", encoding="utf-8")
    assert _lines(sample) == 3
