"""lightning_offpolicy.demo.tiny_bpe: a real-format checkpoint (Qwen2 / Llama, byte-level BPE, ChatML) built locally."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_offpolicy.data.tokenizers import HFTokenizer, load_tokenizer
from lightning_offpolicy.demo.tiny_bpe import (
    CHATML_TEMPLATE,
    build_bpe_checkpoint,
    chat_prompt_ids,
    sft_on_pairs,
    train_bpe_tokenizer,
)

CORPUS = [f"Calculate {a} + {b}." for a in range(10) for b in range(10)] + [str(n) for n in range(19)]


def test_tokenizer_is_byte_level_and_adds_no_special_token():
    tokenizer = train_bpe_tokenizer(CORPUS, vocab_size=300)
    assert len(tokenizer) <= 300
    # The tokenizer's own rule adds nothing: tokenizer(text) is the text's ids alone.
    ids = tokenizer("Calculate 3 + 4.").input_ids
    assert ids == tokenizer("Calculate 3 + 4.", add_special_tokens=False).input_ids
    assert tokenizer.bos_token_id is None and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0
    # Byte level: text the corpus never showed (accents, another script) still round-trips.
    for text in ("Calculate 3 + 4.", "héllo wörld", "Ωμέγα 42"):
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    # Merges were learnt from the corpus: its text takes fewer tokens than bytes.
    assert len(ids) < len(b"Calculate 3 + 4.")


def test_chat_prompt_is_chatml_with_the_generation_prompt():
    tokenizer = train_bpe_tokenizer(CORPUS, vocab_size=300)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Calculate 3 + 4."}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nCalculate 3 + 4.<|im_end|>\n<|im_start|>assistant\n"
    ids = chat_prompt_ids(tokenizer, "Calculate 3 + 4.")
    assert ids == tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    with_system = tokenizer.decode(chat_prompt_ids(tokenizer, "hi", system="Be brief."))
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_checkpoint_is_an_ordinary_hf_directory(tmp_path, architecture):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory = build_bpe_checkpoint(tmp_path / architecture, CORPUS, architecture=architecture, vocab_size=300)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == architecture
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 2, 64)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    # The embedding is the tokenizer's length rounded up to a multiple of 64.
    assert config["vocab_size"] == -(-len(tokenizer) // 64) * 64 >= len(tokenizer)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert GenerationConfig.from_pretrained(directory).eos_token_id == [im_end, end_of_text]
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.dtype == torch.float32
    # The kit loads it as any Hugging Face checkpoint, and renders chat prompts with its template.
    kit_tokenizer = load_tokenizer(directory)
    assert isinstance(kit_tokenizer, HFTokenizer)
    assert HFTokenizer(directory, chat_template=True).encode_prompt("Calculate 1 + 2.") == chat_prompt_ids(
        tokenizer, "Calculate 1 + 2."
    )
    # Loaded, the tokenizer encodes as the saved tokenizer.json does (the warm-up's ids): transformers
    # rebuilds a qwen2 tokenizer's pre-tokenizer, so a qwen2 checkpoint is trained with that one.
    from transformers import PreTrainedTokenizerFast

    saved = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    for text in ("Calculate 12 + 345.", "4607", "What is 48213 * 7261?"):
        assert tokenizer(text)["input_ids"] == saved(text)["input_ids"], text


def test_sft_on_pairs_learns_the_answers():
    from transformers import AutoModelForCausalLM

    from lightning_offpolicy.demo.tiny_bpe import tiny_config

    tokenizer = train_bpe_tokenizer(CORPUS, vocab_size=300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", 320, pad_token_id=0, eos_token_id=2))
    pairs = [("Calculate 1 + 2.", "3"), ("Calculate 4 + 4.", "8")]
    losses = sft_on_pairs(model, tokenizer, pairs, steps=60, batch_size=4, lr=3e-3)
    assert len(losses) == 60 and losses[-1] < 0.05 * losses[0]
    assert not model.training
    # Greedy answers are the trained ones, then <|im_end|>.
    for prompt, answer in pairs:
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        out = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == answer


def test_bad_arguments_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 must be an int >= 259"):
        train_bpe_tokenizer(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="no non-empty string"):
        train_bpe_tokenizer(["", None], vocab_size=300)
    with pytest.raises(ValueError, match="architecture='gpt2' is not known"):
        build_bpe_checkpoint(tmp_path, CORPUS, architecture="gpt2", vocab_size=300)
    with pytest.raises(ValueError, match="sft_steps=5 needs `sft_pairs`"):
        build_bpe_checkpoint(tmp_path, CORPUS, sft_steps=5)


def test_reasoning_gym_config_fits_a_built_checkpoint(tmp_path):
    """configs/reasoning_gym.yaml with model.model pointed at a freshly built checkpoint: a short CLI fit."""
    from pathlib import Path

    from lightning_offpolicy.cli import main

    root = Path(__file__).resolve().parents[1]
    directory = build_bpe_checkpoint(tmp_path / "model", CORPUS, vocab_size=300)
    main(
        [
            "fit",
            "--config",
            str(root / "configs" / "reasoning_gym.yaml"),
            f"--model.model={directory}",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    events = list((tmp_path / "runs" / "reasoning_gym").rglob("events.out.tfevents.*"))
    assert events, "the fit wrote no TensorBoard events"
