"""CharTokenizer / HFTokenizer / load_tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_offpolicy.data.tokenizers import (
    CHAR_TOKENIZER_FILE,
    DEFAULT_ALPHABET,
    UNKNOWN_CHAR,
    CharTokenizer,
    HFTokenizer,
    load_tokenizer,
)
from lightning_offpolicy.rollout import SamplingConfig


def test_default_alphabet_covers_tasks_and_fits_the_tiny_model():
    tok = CharTokenizer()
    for char in "0123456789abcdefghijklmnopqrstuvwxyz +=":
        assert char in DEFAULT_ALPHABET
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) <= 64
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_round_trip_and_special_tokens():
    tok = CharTokenizer()
    text = "rev abcd=12+34 xyz"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert min(ids[1:]) >= 3 and max(ids) < tok.vocab_size
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids + [tok.eos_token_id, tok.pad_token_id])) == text
    # decode does not stop at eos; special tokens are spelled out when not skipped.
    with_eos = tok.encode("ab") + [tok.eos_token_id] + tok.encode("c", add_bos=False)
    assert tok.decode(with_eos) == "abc"
    assert tok.decode(with_eos, skip_special_tokens=False) == "<bos>ab<eos>c"
    assert tok.batch_decode([tok.encode("a"), tok.encode("b")]) == ["a", "b"]
    assert tok.encode("") == [tok.bos_token_id]


def test_unknown_character_is_named():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'Q'"):
        tok.encode("abQ")
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("abca")
    # Ids beyond the alphabet (model vocab 64 > tokenizer vocab) decode to a marker, never crash.
    assert tok.decode([5, 63]) == tok.decode([5]) + UNKNOWN_CHAR


def test_custom_alphabet_ids():
    tok = CharTokenizer("xyz")
    assert tok.vocab_size == 6
    assert tok.encode("zyx", add_bos=False) == [5, 4, 3]


def test_save_and_load(tmp_path):
    tok = CharTokenizer("abc=+")
    path = tok.save_pretrained(tmp_path / "tok")
    assert path.name == CHAR_TOKENIZER_FILE
    assert json.loads(path.read_text())["alphabet"] == "abc=+"
    loaded = CharTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded == tok and loaded.encode("a+b=") == tok.encode("a+b=")
    assert isinstance(load_tokenizer(tmp_path / "tok"), CharTokenizer)
    with pytest.raises(FileNotFoundError):
        CharTokenizer.from_pretrained(tmp_path / "missing")


def _write_hf_tokenizer(directory):
    """A small word-level HF tokenizer built locally (no hub), without a pad token."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.save_pretrained(str(directory))


def test_hf_adapter_same_api(tmp_path):
    _write_hf_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.pad_token_id == tok.eos_token_id == 1  # pad falls back to eos
    assert tok.bos_token_id == 0
    ids = tok.encode("hello world")
    assert ids == [2, 3]  # the tokenizer's own rule adds no bos (tests/test_tokenization.py has every case)
    assert tok.encode("hello world", add_bos=True) == [0, 2, 3]
    assert tok.decode(ids + [1]).split() == ["hello", "world"]
    assert tok.vocab_size == 5
    tok.save_pretrained(tmp_path / "copy")
    assert HFTokenizer.from_pretrained(tmp_path / "copy", add_bos=True).encode_prompt("world") == [0, 3]


# ------------------------------------------------------------------------------ a model directory without a tokenizer
def _save_weights_only(directory):
    """config.json + weights of a tiny Qwen2 and no tokenizer files: what `model.save_pretrained(dir)` alone writes."""
    from transformers import AutoModelForCausalLM

    from lightning_offpolicy.demo.tiny_bpe import tiny_config

    config = tiny_config("qwen2", vocab_size=64, pad_token_id=0, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def test_a_model_directory_without_tokenizer_files_fails_at_load_naming_them(tmp_path):
    """transformers builds an empty tokenizer from config.json alone; the fit used to fail at the first rollout
    with "HFEngine.generate: every prompt needs at least one token"."""
    import lightning as L

    from lightning_offpolicy.data.tasks import PromptDataModule
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.rollout import HFEngine

    directory = _save_weights_only(tmp_path / "weights-only")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[RolloutCallback(engine=HFEngine(), sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=4))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=8)
    with pytest.raises(FileNotFoundError) as error:
        trainer.fit(OffPolicyRLModule(model=str(directory)), data)
    message = str(error.value)
    assert f"HFTokenizer: '{directory}' holds no tokenizer files" in message
    assert "missing: tokenizer.json (or a vocabulary file" in message and "; tokenizer_config.json;" in message
    assert "the directory holds config.json, generation_config.json, model.safetensors" in message
    assert f"tokenizer.save_pretrained('{directory}')" in message
    assert "model.tokenizer: {class_path: lightning_offpolicy.data.tokenizers.HFTokenizer" in message


def test_tokenizer_settings_without_a_vocabulary_are_refused(tmp_path):
    """tokenizer_config.json without tokenizer.json or a vocabulary file. Beside a model's config.json transformers
    builds the model_type's tokenizer of special tokens only, which encodes every text to no ids; alone it fails
    with "Couldn't instantiate the backend tokenizer"."""
    from tests.tokenizer_builders import save_char_tokenizer

    directory = save_char_tokenizer(tmp_path / "tok")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="has no vocabulary: transformers could not build a tokenizer") as error:
        HFTokenizer(directory)
    assert "missing: tokenizer.json (or a vocabulary file" in str(error.value)
    _save_weights_only(directory)  # config.json (model_type qwen2) beside it
    with pytest.raises(ValueError, match=r"has no vocabulary: transformers built a tokenizer of \d+ ids") as error:
        HFTokenizer(directory)
    assert "missing: tokenizer.json (or a vocabulary file" in str(error.value)
    assert "tokenizer_config.json;" not in str(error.value)  # it is there


def test_the_tokenizer_named_in_the_message_loads_beside_a_weights_only_directory(tmp_path):
    """The remedy the message names: `model.tokenizer` with the tokenizer's own path (YAML / command line)."""
    from lightning.pytorch import LightningDataModule

    from lightning_offpolicy.cli import OffPolicyCLI
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from tests.tokenizer_builders import save_char_tokenizer

    weights = _save_weights_only(tmp_path / "weights-only")
    tokenizer_dir = save_char_tokenizer(tmp_path / "tok")
    cli = OffPolicyCLI(
        OffPolicyRLModule,
        LightningDataModule,
        subclass_mode_data=True,
        run=False,
        auto_configure_optimizers=False,
        args=[
            "--data=lightning_offpolicy.data.tasks.PromptDataModule",
            f"--model.model={weights}",
            "--model.tokenizer=lightning_offpolicy.data.tokenizers.HFTokenizer",
            f"--model.tokenizer.init_args.path={tokenizer_dir}",
        ],
    )
    cli.model.configure_model()
    assert cli.model.tokenizer.path == str(tokenizer_dir)
    assert cli.model.tokenizer.encode("abc") == [13, 14, 15]
