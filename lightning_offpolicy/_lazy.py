"""Package names that load on first use (PEP 562), for the package's ``__init__`` modules.

A package that exports a class from a heavy module (Lightning, transformers) stays cheap to import:
the module is imported when the name is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose names load on first use.

    Args:
        namespace: The package's ``globals()``: a name read once is stored there, so later look-ups
            do not call ``__getattr__`` again.
        exports: Public name -> the module that defines (or re-exports) it.

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package's ``__init__``.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
