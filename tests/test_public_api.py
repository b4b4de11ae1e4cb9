"""The top-level public API: ``from lightning_offpolicy import OffPolicyRLModule`` and the rest."""

from __future__ import annotations

import importlib
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
