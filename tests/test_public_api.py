"""The top-level public API: ``from lightning_offpolicy import OffPolicyRLModule`` and the rest."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import lightning_offpolicy


@pytest.mark.parametrize("name", lightning_offpolicy.__all__)
def test_every_public_name_is_the_object_its_module_defines(name):
    module = importlib.import_module(lightning_offpolicy._EXPORTS[name])
    assert getattr(lightning_offpolicy, name) is getattr(module, name)
    assert name in dir(lightning_offpolicy)


def test_the_documented_imports_work_and_unknown_names_fail():
    from lightning_offpolicy import OffPolicyRLModule, RolloutCallback, VLLMEngine  # noqa: F401

    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        lightning_offpolicy.NotAThing  # noqa: B018
    with pytest.raises(ImportError):
        from lightning_offpolicy import NotAThing  # noqa: F401
    assert lightning_offpolicy.__version__ != "0.0.0"  # installed (pip install -e .)


def test_importing_the_package_or_the_correction_core_loads_no_lightning():
    code = (
        "import sys, lightning_offpolicy, lightning_offpolicy.correction; "
        "print(sorted(m for m in ('lightning', 'transformers', 'vllm', 'torchmetrics') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_all_lists_exactly_the_exports():
    assert lightning_offpolicy.__all__ == sorted(lightning_offpolicy._EXPORTS)


MOVED = {
    "lightning_offpolicy.rollout.vllm_engine": ("lightning_offpolicy.rollout.vllm.inprocess", "VLLMEngine"),
    "lightning_offpolicy.rollout.remote_vllm": ("lightning_offpolicy.rollout.vllm", "launch_local_server"),
    "lightning_offpolicy.rollout.vllm_errors": ("lightning_offpolicy.rollout.vllm.errors", "INSTALL_HINT"),
    "lightning_offpolicy.rollout.vllm_process": ("lightning_offpolicy.rollout.vllm.process", "__name__"),
    "lightning_offpolicy.rollout.weight_sync": ("lightning_offpolicy.rollout.vllm.weight_sync", "SyncCheck"),
    "lightning_offpolicy.rollout.hf_engine": ("lightning_offpolicy.rollout.hf", "HFEngine"),
}


@pytest.fixture(scope="module")
def moved_imports() -> dict[str, str]:
    """One fresh interpreter imports every new module, then each old path in turn: per old path, the
    warning its first import raised (or the error of the check that failed)."""
    code = (
        "import importlib, json, sys, warnings\n"
        f"moved = {MOVED!r}\n"
        "for new, _ in moved.values():\n"
        "    importlib.import_module(new)\n"
        "out = {}\n"
        "for old, (new, name) in moved.items():\n"
        "    try:\n"
        "        with warnings.catch_warnings():\n"
        "            warnings.simplefilter('error')\n"
        "            try:\n"
        "                importlib.import_module(old)\n"
        "                out[old] = 'no warning'\n"
        "            except DeprecationWarning as w:\n"
        "                out[old] = str(w)\n"
        "        with warnings.catch_warnings():\n"
        "            warnings.simplefilter('ignore')\n"
        "            module = importlib.import_module(old)\n"
        "        assert module is sys.modules[new] and getattr(module, name) is getattr(sys.modules[new], name)\n"
        "        assert sys.modules[old] is sys.modules[new]\n"
        "    except Exception as err:\n"
        "        out[old] = f'failed: {err!r}'\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_still_imports_for_one_release_with_a_deprecation_warning(old, moved_imports):
    """A fresh interpreter: the warning fires at the first import, and the old path is the new module."""
    new, _ = MOVED[old]
    assert moved_imports[old] == f"{old} moved to {new}; the old path is removed in 0.2: import from {new} instead."
