"""``lightning_offpolicy.data``: its lazy exports, and tokenizers / rewards importable without Lightning."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import lightning_offpolicy.data as data


def test_tokenizers_rewards_and_logprobs_load_no_lightning_in_a_fresh_interpreter():
    code = (
        "import sys, lightning_offpolicy.data.tokenizers, lightning_offpolicy.data.rewards, "
        "lightning_offpolicy.logprobs; "
        "print(sorted(m for m in ('lightning', 'transformers', 'vllm', 'torchmetrics') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", data.__all__)
def test_every_data_export_is_the_object_its_module_defines(name):
    module = importlib.import_module(data._EXPORTS[name])
    assert getattr(data, name) is getattr(module, name)
    assert name in dir(data)


def test_data_all_lists_exactly_the_exports_and_unknown_names_fail():
    assert sorted(data.__all__) == sorted(data._EXPORTS)
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        data.NotAThing  # noqa: B018


def test_the_tokenizers_module_keeps_every_name_it_had():
    from lightning_offpolicy.data import char_tokenizer, prompts, tokenizers

    assert tokenizers.CharTokenizer is char_tokenizer.CharTokenizer
    assert tokenizers.encode_prompt is prompts.encode_prompt
    assert tokenizers.HFTokenizer.__module__ == "lightning_offpolicy.data.tokenizers"  # class_path in YAML
    for name in tokenizers.__all__:
        assert hasattr(tokenizers, name), name
