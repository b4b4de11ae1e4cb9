"""Constructors that read at a glance: no public constructor of the package takes more than :data:`MAX_ARGUMENTS`.

A public constructor is the ``__init__`` of a public class that is not a dataclass (a dataclass of
settings is how a long list of arguments gets grouped, as ``RolloutCallback``'s are), and a public
``launch_*`` function (it builds a server). Read from the source (no import): ``self`` does not
count, ``*args`` / ``**kwargs`` do not either. Past the limit, group the settings the way
docs/architecture.md describes; an exception is named in :data:`EXCEPTIONS` with its reason, and
leaves the list once it is under the limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_offpolicy"

#: The most arguments a public constructor may take.
MAX_ARGUMENTS = 12

#: Constructors allowed past MAX_ARGUMENTS ("module path:name" -> why).
EXCEPTIONS: dict[str, str] = {
    "lightning/module.py:OffPolicyRLModule": (
        "a LightningModule's arguments are its hyperparameters: the CLI's `model.*` keys, saved flat in every "
        "checkpoint (`save_hyperparameters`), compared key by key on resume and passed back by "
        "`load_from_checkpoint`; its grouped ones already are dataclasses (`correction`, `loss`), and grouping "
        "the flat rest would rename every user's keys and stop existing checkpoints from loading"
    ),
}


def _count(arguments: ast.arguments, method: bool) -> int:
    named = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
    return named - 1 if method else named


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def constructor_sizes() -> dict[str, int]:
    """``"module path:name" -> arguments`` of every public constructor of the package."""
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef)) or node.name.startswith("_"):
                continue
            if isinstance(node, ast.ClassDef) and not _is_dataclass(node):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        sizes[f"{module}:{node.name}"] = _count(item.args, method=True)
            elif isinstance(node, ast.FunctionDef) and node.name.startswith("launch_"):
                sizes[f"{module}:{node.name}"] = _count(node.args, method=False)
    return sizes


def test_no_public_constructor_takes_more_than_the_limit():
    sizes = constructor_sizes()
    assert len(sizes) > 50  # the package's classes, not an empty walk
    over = {name: n for name, n in sizes.items() if n > MAX_ARGUMENTS and name not in EXCEPTIONS}
    assert not over, f"public constructors over {MAX_ARGUMENTS} arguments (group their settings): {over}"
    gone = set(EXCEPTIONS) - set(sizes)
    assert not gone, f"exceptions name constructors that no longer exist: {gone}"
    under = {name: sizes[name] for name in EXCEPTIONS if sizes[name] <= MAX_ARGUMENTS}
    assert not under, f"exceptions now within {MAX_ARGUMENTS} arguments: remove them from EXCEPTIONS: {under}"


def test_the_count_leaves_out_self_and_starred_arguments():
    tree = ast.parse("class A:\n    def __init__(self, a, /, b, *args, c, **kwargs): ...\ndef launch_x(a, b=1): ...\n")
    init = tree.body[0].body[0]
    assert _count(init.args, method=True) == 3
    assert _count(tree.body[1].args, method=False) == 2
