"""One reward callable from a config value (an import path, a class and its init_args, or a callable), and its name."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["import_object", "resolve_one", "reward_name"]


def import_object(path: str, setting: str = "reward_fn") -> Any:
    """The object at ``path``: ``"pkg.module.name"`` or ``"pkg.module:name"`` (``name`` may be dotted).

    >>> import_object("lightning_offpolicy.data.rewards:math_answer").__class__.__name__
    'MathAnswerReward'
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"`{setting}`: expected an import path such as 'my_pkg.rewards.exact_match', got {path!r}.")
    path = path.strip()
    if ":" in path:
        module_name, _, attribute = path.partition(":")
        candidates = [(module_name, attribute)]
    else:
        # "a.b.c.d": try module "a.b.c" + attribute "d", then "a.b" + "c.d", ... (nested attributes).
        parts = path.split(".")
        candidates = [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]
    if not candidates or not all(module and attribute for module, attribute in candidates):
        raise ValueError(
            f"`{setting}`={path!r} is not an import path: write 'package.module.function' or 'package.module:function'."
        )
    errors = []
    for module_name, attribute in candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # Only "this very module is missing" means: try a shorter module path.
            if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
                errors.append(f"no module {error.name!r}")
                continue
            raise ImportError(f"`{setting}`={path!r}: importing {module_name!r} failed: {error}") from error
        except Exception as error:
            raise ImportError(
                f"`{setting}`={path!r}: importing {module_name!r} failed with {type(error).__name__}: {error}"
            ) from error
        value: Any = module
        try:
            for name in attribute.split("."):
                value = getattr(value, name)
        except AttributeError:
            errors.append(f"module {module_name!r} has no attribute {attribute!r}")
            continue
        return value
    raise ImportError(
        f"`{setting}`={path!r} could not be imported ({'; '.join(dict.fromkeys(errors))}). Check the spelling, and "
        "that the package is installed or its directory is on PYTHONPATH."
    )


def reward_name(fn: Any) -> str:
    """A readable name of a reward callable: ``module.function`` or ``module.Class(...)``."""
    if inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn):
        return f"{fn.__module__}.{fn.__qualname__}"
    cls = type(fn)
    return f"{cls.__module__}.{cls.__qualname__} instance"


def _build(value: Any, init_args: Mapping[str, Any] | None, path: str, setting: str) -> Callable[..., Any]:
    if inspect.isclass(value):
        try:
            value = value(**dict(init_args or {}))
        except TypeError as error:
            raise TypeError(
                f"`{setting}`={path!r} is a class; building it with init_args={dict(init_args or {})} failed: {error}"
            ) from error
    elif init_args:
        raise ValueError(f"`{setting}`={path!r} is not a class, so it takes no init_args (got {dict(init_args)}).")
    if not callable(value):
        raise TypeError(
            f"`{setting}`={path!r} is a {type(value).__name__}, not a callable "
            "(prompts, completions, metadata) -> list of floats."
        )
    return value


def resolve_one(fn: Any, init_args: Mapping[str, Any] | None, setting: str) -> Callable[..., Any]:
    """One reward callable from a callable or an import path (a class is built with ``init_args``)."""
    if isinstance(fn, str):
        return _build(import_object(fn, setting), init_args, fn, setting)
    if callable(fn) and not inspect.isclass(fn):
        if init_args:
            raise ValueError(f"`{setting}`: init_args apply to a class or an import path, not to {reward_name(fn)}.")
        return fn
    if inspect.isclass(fn):
        return _build(fn, init_args, fn.__qualname__, setting)
    raise TypeError(
        f"`{setting}` must be a callable, an import path string, a dict with 'fn', or a list of those; "
        f"got {type(fn).__name__}: {fn!r}."
    )
