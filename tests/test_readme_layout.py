"""README's Layout against the tree: every package and top-level module is named, every name exists.

Packages and top-level modules are checked both ways; a module inside a package only when the README
names it (a package may split a module without touching the README).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_offpolicy"
#: An entry: a package (``name/``) or a module (``name.py``) in the name column, a description after it.
ENTRY = re.compile(r"^(?P<indent> {2,8})(?P<name>[a-z_]+(/|\.py))(?: {2,}(?P<text>.*))?$")
MODULE = re.compile(r"\b([a-z_]+\.py)\b")


def layout_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    lines = block.splitlines()[1:]  # after the fence's language tag (none)
    assert lines[0] == "lightning_offpolicy/", "the block starts at the package"
    return lines[1:]


def layout_entries() -> dict[str, list[str]]:
    """Path relative to the package (``rollout/vllm/``, ``cli.py``) -> the modules its description names."""
    entries: dict[str, list[str]] = {}
    parents: list[tuple[int, str]] = []  # (indent, path) of the enclosing packages
    current = None
    for line in layout_block():
        match = ENTRY.match(line)
        if match is None:  # a description's continuation line
            assert current is not None and line.startswith(" " * 20), f"not an entry or a continuation: {line!r}"
            entries[current] += MODULE.findall(line)
            continue
        indent = len(match["indent"])
        while parents and parents[-1][0] >= indent:
            parents.pop()
        current = (parents[-1][1] if parents else "") + match["name"]
        assert current not in entries, f"{current} named twice"
        entries[current] = MODULE.findall(match["text"] or "")
        if current.endswith("/"):
            parents.append((indent, current))
    return entries


def test_every_package_and_top_level_module_is_named_and_nothing_else():
    entries = layout_entries()
    packages = {
        str(path.parent.relative_to(PACKAGE)) + "/" for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE
    }
    top_level = {path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    assert {e for e in entries if e.endswith("/")} == packages
    assert {e for e in entries if "/" not in e} == top_level


def test_every_module_a_package_entry_names_exists():
    for entry, modules in layout_entries().items():
        for module in modules:
            where = PACKAGE / entry / module if entry.endswith("/") else PACKAGE / module
            assert where.is_file(), f"README's Layout names {entry}{module}: no such file"


def test_the_parser_reads_nested_packages_and_their_modules():
    entries = layout_entries()
    assert "check.py" in entries["rollout/vllm/sync/"]
    assert "engine.py" in entries["rollout/"]
    assert entries["cli.py"] == []
