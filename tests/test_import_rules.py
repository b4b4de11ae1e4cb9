"""The import rules of docs/architecture.md, read from the source (every import, deferred ones inside functions
included): the core never imports the demo, the Lightning-free packages stay Lightning-free, the batch types
import no metrics."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_offpolicy"

#: Packages (and modules) that import no Lightning, so they work from any trainer.
LIGHTNING_FREE = ("correction/", "rollout/", "train/", "logprobs/", "batch.py")
#: The modules that may import the demo besides the demo itself: the command line (its `selfcheck`).
DEMO_IMPORTERS = ("cli.py",)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or deferred (the package imports absolutely: a relative import
    raises, so that none slips past the rules)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: a relative import; the package imports absolutely")
            found.add(node.module)
    return found


def _modules() -> dict[str, set[str]]:
    modules = {str(p.relative_to(PACKAGE)): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(modules) > 100  # the package, not an empty glob
    return modules


def _importing(prefix: str, allowed_from) -> dict[str, list[str]]:
    return {
        name: sorted(m for m in imported if m == prefix or m.startswith(prefix + "."))
        for name, imported in _modules().items()
        if not allowed_from(name) and any(m == prefix or m.startswith(prefix + ".") for m in imported)
    }


def test_the_core_never_imports_the_demo():
    offenders = _importing("lightning_offpolicy.demo", lambda name: name.startswith("demo/") or name in DEMO_IMPORTERS)
    assert not offenders, f"modules that import the demo (tiny: specs go through resolve_model_spec): {offenders}"
    for name in DEMO_IMPORTERS:  # and those that may, only inside the function that needs it
        top = ast.parse((PACKAGE / name).read_text(encoding="utf-8")).body
        modules = {n.module for n in top if isinstance(n, ast.ImportFrom)}
        modules |= {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in modules if m.startswith("lightning_offpolicy.demo")}, name


def test_the_lightning_free_packages_import_no_lightning():
    offenders = _importing("lightning", lambda name: not name.startswith(LIGHTNING_FREE))
    assert not offenders, f"modules of {LIGHTNING_FREE} that import Lightning: {offenders}"


def test_the_batch_types_import_no_metrics():
    assert not {m for m in imports_of(PACKAGE / "batch.py") if m.startswith("lightning_offpolicy.metrics")}


def test_deferred_imports_are_read_and_relative_ones_refused(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import a.b\nfrom c import d\ndef f():\n    from lightning_offpolicy.demo import tiny\n")
    assert imports_of(path) == {"a.b", "c", "lightning_offpolicy.demo"}
    path.write_text("from . import sibling\n")
    with pytest.raises(AssertionError, match="relative import"):
        imports_of(path)
