"""The top-level public API: ``from lightning_offpolicy import OffPolicyRLModule`` and the rest."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

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


def test_the_top_level_keeps_the_names_a_user_starts_from():
    assert len(lightning_offpolicy.__all__) <= 12
    for name in ("OffPolicyRLModule", "RolloutCallback", "HFEngine", "VLLMEngine", "OffPolicyCorrectionConfig"):
        assert name in lightning_offpolicy.__all__
    # The rest comes from its subpackage.
    assert not hasattr(lightning_offpolicy, "compute_correction")
    from lightning_offpolicy.correction import compute_correction  # noqa: F401


def test_the_type_checking_imports_name_the_same_objects_as_the_exports():
    tree = ast.parse(Path(lightning_offpolicy.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    imported = {alias.name: node.module for node in block.body for alias in node.names}
    assert sorted(imported) == lightning_offpolicy.__all__
    for name, module in imported.items():
        assert getattr(importlib.import_module(module), name) is getattr(lightning_offpolicy, name)
