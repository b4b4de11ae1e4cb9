"""Old import paths that keep working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import sys
import warnings

#: The release that removes the old paths.
REMOVED_IN = "0.2"


def moved_module(old: str, new: str) -> None:
    """Make the module ``old`` (the caller, while it is imported) an alias of ``new``, and warn.

    ``sys.modules[old]`` becomes ``new``'s module object, so ``from old import Name`` and
    ``import old as m; m.Name`` see exactly the objects of ``new`` (one class, one ``isinstance``).
    """
    warnings.warn(
        f"{old} moved to {new}; the old path is removed in {REMOVED_IN}: import from {new} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
