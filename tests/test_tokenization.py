"""Tokenization follows the tokenizer: prompt encoding rule, add_bos, chat templates, stop ids.

Every tokenizer here is a real ``PreTrainedTokenizerFast`` built with ``tokenizers``, saved with
``save_pretrained`` and loaded through ``HFTokenizer(dir)``; the references are hand-computed ids,
the raw ``tokenizers`` encoder, or ``transformers``' own ``apply_chat_template``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.cli import OffPolicyCLI
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.data.tokenizers import CharTokenizer, HFTokenizer, encode_prompt
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import SamplingConfig
from lightning_offpolicy.rollout.engine import SpecialTokens, first_stop, generation_eos_ids
from lightning_offpolicy.rollout.hf.engine import HFEngine
from tests.tokenizer_builders import (
    BOS_ID,
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_WITH_BOS,
    EOS_ID,
    char_ids,
    save_char_tokenizer,
    save_gpt2_style_tokenizer,
)

USER = [{"role": "user", "content": "abc"}]
QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def reference_chat_ids(directory: Path, messages: list[dict], **kwargs) -> list[int]:
    """``transformers``' own rendering, loaded independently of HFTokenizer."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **kwargs
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


# ------------------------------------------------------------------------------ the encoding rule
def test_a_tokenizer_whose_rule_adds_no_bos_gets_none(tmp_path):
    """Issue 10's case: bos defined, never added by the rule -> the prompt is the char ids, nothing in front."""
    tok = HFTokenizer(save_char_tokenizer(tmp_path))
    assert tok.bos_token_id == BOS_ID  # the tokenizer has a bos ...
    assert tok.encode_prompt("copy abc:") == char_ids("copy abc:")  # ... that its rule does not add
    assert tok.encode("copy abc:") == char_ids("copy abc:")
    assert encode_prompt(tok, "ab") == char_ids("ab")


def test_a_tokenizer_whose_rule_adds_bos_gets_exactly_one(tmp_path):
    tok = HFTokenizer(save_char_tokenizer(tmp_path, bos_rule=True))
    assert tok.encode_prompt("copy abc:") == [BOS_ID, *char_ids("copy abc:")]
    # add_bos=True never doubles the rule's bos, even when the text itself starts with one.
    forced = HFTokenizer(tmp_path, add_bos=True)
    assert forced.encode_prompt("ab") == [BOS_ID, *char_ids("ab")]
    assert forced.encode_prompt("<s>ab") == [BOS_ID, *char_ids("ab")]


def test_bos_equal_to_eos_puts_no_eos_in_front(tmp_path):
    """GPT-2 style: bos == eos == <|endoftext|>; its rule adds nothing, so neither does the kit."""
    directory, raw = save_gpt2_style_tokenizer(tmp_path)
    tok = HFTokenizer(directory)
    assert tok.bos_token_id == tok.eos_token_id
    for text in ("hello world", "abc: a", "the first letter"):
        ids = tok.encode_prompt(text)
        assert ids == raw.encode(text).ids  # the raw `tokenizers` encoder, no transformers in between
        assert tok.eos_token_id not in ids
        assert tok.decode(ids) == text


def test_add_bos_overrides_the_rule(tmp_path):
    no_rule = save_char_tokenizer(tmp_path / "no_rule")
    with_rule = save_char_tokenizer(tmp_path / "with_rule", bos_rule=True)
    assert HFTokenizer(no_rule, add_bos=True).encode_prompt("ab") == [BOS_ID, *char_ids("ab")]
    assert HFTokenizer(no_rule, add_bos=False).encode_prompt("ab") == char_ids("ab")
    assert HFTokenizer(with_rule, add_bos=False).encode_prompt("ab") == char_ids("ab")
    assert HFTokenizer(with_rule, add_bos="auto").encode_prompt("ab") == [BOS_ID, *char_ids("ab")]
    # Per call, encode's own add_bos wins over the instance's setting.
    tok = HFTokenizer(with_rule, add_bos=False)
    assert tok.encode("ab", add_bos="auto") == [BOS_ID, *char_ids("ab")]
    assert tok.encode("ab", add_bos=True) == [BOS_ID, *char_ids("ab")]


def test_bad_options_are_named(tmp_path):
    directory = save_char_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="add_bos='yes'"):
        HFTokenizer(directory, add_bos="yes")
    with pytest.raises(ValueError, match="system_prompt"):
        HFTokenizer(directory, system_prompt="")
    with pytest.raises(ValueError, match="chat_template=True.*no chat template"):
        HFTokenizer(directory, chat_template=True)
    gpt2_dir, _ = save_gpt2_style_tokenizer(tmp_path / "gpt2")
    from transformers import AutoTokenizer

    no_bos = AutoTokenizer.from_pretrained(str(gpt2_dir))
    no_bos.bos_token = None
    no_bos.save_pretrained(str(tmp_path / "no_bos"))
    with pytest.raises(ValueError, match="add_bos=True.*no bos token"):
        HFTokenizer(tmp_path / "no_bos", add_bos=True)


def test_char_tokenizer_keeps_its_bos():
    tok = CharTokenizer()
    assert tok.encode_prompt("copy abc=") == [tok.bos_token_id, *tok.encode("copy abc=", add_bos=False)]
    assert encode_prompt(tok, "ab") == tok.encode("ab")
    with pytest.raises(TypeError, match="CharTokenizer.encode_prompt.*chat template"):
        tok.encode_prompt(USER)


def test_encode_prompt_with_a_raw_transformers_tokenizer(tmp_path):
    """A mixin user's module may hold the transformers tokenizer itself: its rule is used too."""
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(save_char_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)))
    assert encode_prompt(raw, "ab") == char_ids("ab")
    assert encode_prompt(raw, USER) == char_ids("u: abc.a:")


# ------------------------------------------------------------------------------ chat templates
def test_chat_prompt_ids_equal_apply_chat_template(tmp_path):
    directory = save_char_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)
    tok = HFTokenizer(directory)
    assert tok.encode_prompt(USER) == reference_chat_ids(directory, USER) == char_ids("u: abc.a:")
    dialog = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "xyz"},
    ]
    assert tok.encode_prompt(dialog) == reference_chat_ids(directory, dialog)
    # A text prompt with chat_template=True is one user message.
    assert HFTokenizer(directory, chat_template=True).encode_prompt("abc") == reference_chat_ids(directory, USER)


def test_system_prompt_goes_first(tmp_path):
    directory = save_char_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)
    tok = HFTokenizer(directory, chat_template=True, system_prompt="be brief")
    expected = reference_chat_ids(directory, [{"role": "system", "content": "be brief"}, *USER])
    assert expected == char_ids("s: be brief.u: abc.a:")
    assert tok.encode_prompt("abc") == expected
    assert tok.encode_prompt(USER) == expected
    with pytest.raises(ValueError, match="already starts with a system message"):
        tok.encode_prompt([{"role": "system", "content": "other"}, *USER])
    # A system prompt that a plain text prompt would silently drop is an error.
    with pytest.raises(ValueError, match="system_prompt is set but the prompt is a plain text"):
        HFTokenizer(directory, system_prompt="be brief").encode_prompt("abc")


def test_a_template_that_writes_bos_gets_exactly_one(tmp_path):
    """Llama-3 style: the template writes the bos; its rule would add another. The prompt has one."""
    directory = save_char_tokenizer(tmp_path, bos_rule=True, chat_template=CHAT_TEMPLATE_WITH_BOS)
    expected = reference_chat_ids(directory, USER)
    assert expected == [BOS_ID, *char_ids("u: abc.a:")]
    assert HFTokenizer(directory).encode_prompt(USER) == expected
    assert HFTokenizer(directory, add_bos=True).encode_prompt(USER) == expected
    assert HFTokenizer(directory, add_bos=False).encode_prompt(USER) == expected[1:]


def test_bad_chat_prompts_are_named(tmp_path):
    no_template = HFTokenizer(save_char_tokenizer(tmp_path / "plain"))
    with pytest.raises(ValueError, match="needs a chat template"):
        no_template.encode_prompt(USER)
    tok = HFTokenizer(save_char_tokenizer(tmp_path / "chat", chat_template=CHAT_TEMPLATE))
    with pytest.raises(ValueError, match="message 1 .*'role'"):
        tok.encode_prompt([USER[0], {"content": "no role"}])
    with pytest.raises(ValueError, match="empty list"):
        tok.encode_prompt([])
    with pytest.raises(TypeError, match="got int"):
        tok.encode_prompt(7)


# ------------------------------------------------------------------------------ path from the model
def test_path_none_waits_for_the_model_directory(tmp_path):
    tok = HFTokenizer(add_bos=True)
    assert not tok.loaded
    with pytest.raises(RuntimeError, match="not loaded yet"):
        tok.encode_prompt("ab")
    tok.load(save_char_tokenizer(tmp_path))
    assert tok.encode_prompt("ab") == [BOS_ID, *char_ids("ab")]
    with pytest.raises(ValueError, match="needs its `path`"):
        OffPolicyRLModule(model=torch.nn.Linear(2, 2), tokenizer=HFTokenizer())


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama + the no-bos char tokenizer (with a chat template) in one directory, as a user's checkpoint;
    its generation config lists two eos ids."""
    from lightning_offpolicy.demo.tiny import build_tiny_llama

    directory = tmp_path_factory.mktemp("hf_ckpt")
    model = build_tiny_llama(vocab_size=64, seed=3)
    model.generation_config.eos_token_id = [EOS_ID, 7]
    model.save_pretrained(str(directory))
    save_char_tokenizer(directory, chat_template=CHAT_TEMPLATE)
    return directory


def test_cli_sets_tokenizer_options_without_repeating_the_path(tmp_path, hf_checkpoint):
    config = {
        "model": {
            "model": str(hf_checkpoint),
            "tokenizer": {
                "class_path": "lightning_offpolicy.data.tokenizers.HFTokenizer",
                "init_args": {"add_bos": True, "chat_template": True, "system_prompt": "be brief"},
            },
        }
    }
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = OffPolicyCLI(
        OffPolicyRLModule,
        PromptDataModule,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(QUICKSTART), "--config", str(path), "--trainer.logger=false"],
        auto_configure_optimizers=False,
    )
    tok = cli.model.tokenizer
    assert isinstance(tok, HFTokenizer) and not tok.loaded
    assert (tok.add_bos, tok.chat_template, tok.system_prompt) == (True, True, "be brief")
    cli.model.configure_model()
    assert cli.model.tokenizer is tok and tok.path == str(hf_checkpoint)
    expected = reference_chat_ids(hf_checkpoint, [{"role": "system", "content": "be brief"}, *USER])
    assert tok.encode_prompt("abc") == [BOS_ID, *expected]
    # Command-line form, and a `tiny:` (char) checkpoint with an HFTokenizer is a clear error.
    cli = OffPolicyCLI(
        OffPolicyRLModule,
        PromptDataModule,
        subclass_mode_data=True,
        run=False,
        args=[
            "--config",
            str(QUICKSTART),
            "--model.model=tiny:copy",
            "--model.tokenizer=lightning_offpolicy.data.tokenizers.HFTokenizer",
            "--model.tokenizer.add_bos=false",
            "--trainer.logger=false",
        ],
        auto_configure_optimizers=False,
    )
    assert cli.model.tokenizer.add_bos is False
    with pytest.raises(ValueError, match="holds a CharTokenizer"):
        cli.model.configure_model()


# ------------------------------------------------------------------------------ stop ids
def test_generation_eos_ids_and_stop_ids():
    from transformers import GenerationConfig

    class Model:
        generation_config = GenerationConfig(eos_token_id=[2, 7])

    assert generation_eos_ids(Model()) == [2, 7]
    Model.generation_config = GenerationConfig(eos_token_id=5)
    assert generation_eos_ids(Model()) == [5]
    assert generation_eos_ids(object()) == []
    engine = SpecialTokens()
    engine.set_special_tokens(0, 7, stop_token_ids=[2, 7])
    assert engine.stop_ids == [7, 2]  # the tokenizer's eos first, no repeats
    assert first_stop([5, 6, 2, 7], [7, 2]) == (3, "stop")
    assert first_stop([5, 6], [7, 2]) == (2, "length")
    with pytest.raises(ValueError, match="HFEngine.stop_token_ids=\\[-1\\]"):
        HFEngine(stop_token_ids=[-1])


class _CaptureRollout(Callback):
    def __init__(self) -> None:
        self.rollouts = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rollouts.append(batch.rollout)


class _Prompts(L.LightningDataModule):
    def __init__(self, prompts: list) -> None:
        super().__init__()
        self.prompts = prompts

    def train_dataloader(self):
        return DataLoader([PromptBatch(list(self.prompts))], batch_size=None, collate_fn=lambda batch: batch)

    @staticmethod
    def reward_fn(prompts, completions, metadata):
        return [float(len(c)) for c in completions]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "messages"])
def test_rollout_prompts_follow_the_tokenizer_and_stop_on_every_eos(hf_checkpoint, chat):
    """End to end: the callback's prompt ids are the tokenizer's (no bos for this one, or the chat
    template's), and the engine stops on both eos ids of the model's generation config."""
    prompts = [USER, [{"role": "user", "content": "xyz"}]] if chat else ["copy abc:", "copy xyz:"]
    expected = [
        reference_chat_ids(hf_checkpoint, p) if chat else char_ids(p)  # hand / transformers reference
        for p in prompts
    ]
    module = OffPolicyRLModule(model=str(hf_checkpoint))
    capture = _CaptureRollout()
    rollout_cb = RolloutCallback(sampling=SamplingConfig(max_new_tokens=24, samples_per_prompt=16), seed=1)
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rollout_cb, capture],
    )
    trainer.fit(module, datamodule=_Prompts(prompts))
    assert isinstance(module.tokenizer, HFTokenizer)
    (rollout,) = capture.rollouts
    width = rollout.prompt_length
    for row in range(rollout.num_sequences):
        prompt = rollout.input_ids[row, :width][rollout.attention_mask[row, :width].bool()].tolist()
        assert prompt == expected[int(rollout.group_ids[row])]
        if not chat:
            assert BOS_ID not in prompt
    assert rollout_cb.engine.stop_ids == [EOS_ID, 7]
    stops_seen = set()
    for row in range(rollout.num_sequences):
        n = int(rollout.response_mask[row].sum())
        response = rollout.input_ids[row, width : width + n].tolist()
        assert not {EOS_ID, 7} & set(response[:-1])  # nothing runs past a stop id
        if response[-1] in (EOS_ID, 7):
            stops_seen.add(response[-1])
    assert stops_seen == {EOS_ID, 7}, stops_seen  # 32 samples of 24 tokens from a random model hit both
