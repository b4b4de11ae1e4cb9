"""The calculator tool-use task, SFT on conversations, and the tiny tool-use checkpoint (Qwen2.5 template)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask, multiply, product_reward, stated_integers
from lightning_offpolicy.demo.chat_sft import conversation_ids, masked_sft_step, sft_on_conversations
from lightning_offpolicy.demo.tiny_bpe import tiny_config, train_bpe_tokenizer
from lightning_offpolicy.demo.tool_use import TOOL_TOKENS, qwen2_5_chat_template

META = {"a": 48213, "b": 7261, "answer": 350074593}  # 48213 * 7261 by hand: 337,491,000 + 12,583,593
# Bounds on the default build's greedy success over 200 held-out prompts: what was measured when the recipe
# was set lies well inside them, the margin is for other CPUs' rounding; above the ceiling RL has nothing to raise.
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 48213, "b": 7261}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    """A BPE tokenizer with the Qwen2.5 template, trained on a few rendered conversations."""
    task = MultiplyToolTask()
    rng = random.Random(0)
    render = train_bpe_tokenizer(["-"], vocab_size=300, chat_template=qwen2_5_chat_template())
    corpus = [
        render.apply_chat_template(task.reference_conversation(*task.sample(rng)), tools=[multiply], tokenize=False)
        for _ in range(32)
    ]
    return train_bpe_tokenizer(
        corpus, vocab_size=400, chat_template=qwen2_5_chat_template(), added_tokens=TOOL_TOKENS, pre_tokenizer="qwen2"
    )


def test_reward_by_hand():
    task = MultiplyToolTask()
    assert multiply(48213, 7261) == 350074593
    assert task.reward("The answer is 350074593.", META) == 1.0
    assert task.reward("48213 * 7261 = 350,074,593", META) == 1.0  # other numbers and thousands commas are fine
    assert task.reward("The answer is 350074594.", META) == 0.0
    assert task.reward("The answer is 3500745930.", META) == 0.0  # digits glued on: another number
    assert task.reward("The answer is 350074593.", {**META, "truncated": True}) == 0.0
    assert task.reward("The answer is 350074593.", {**META, "truncated": False, "turns": 2}) == 1.0
    assert task.reward(CALL.replace("7261", '7261, "c": 350074593'), META) == 0.0  # a last turn that calls a tool
    assert task.reward("", META) == 0.0
    assert product_reward(["q", "q"], ["350074593", "350074592"], [META, META]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="must match"):
        product_reward(["q"], [], [META])
    assert stated_integers("12,34 and 1,000 and 7") == [1000, 7]


def test_samples_and_the_tool_schema():
    from transformers.utils import get_json_schema

    task = MultiplyToolTask(a_digits=5, b_digits=4)
    prompt, meta = task.sample(random.Random(1))
    assert prompt == f"What is {meta['a']} * {meta['b']}?"
    assert 10_000 <= meta["a"] < 100_000 and 1_000 <= meta["b"] < 10_000 and meta["answer"] == meta["a"] * meta["b"]
    assert task.reward(task.reference_completion(meta), meta) == 1.0
    schema = get_json_schema(multiply)["function"]
    assert schema["name"] == "multiply" and schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    with pytest.raises(ValueError, match="a_digits"):
        MultiplyToolTask(a_digits=0)


def test_template_is_trl_qwen2_5_byte_for_byte():
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    assert qwen2_5_chat_template() == chat_template_utils.qwen2_5_chat_template


def test_tool_tokens_are_single_non_special_ids(tokenizer):
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in TOOL_TOKENS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 4
    # Not special, as in Qwen2.5: decoding without special tokens keeps them (a parser finds the call).
    assert tokenizer.decode(tokenizer(CALL + "<|im_end|>").input_ids, skip_special_tokens=True) == CALL
    # One token per digit, the same after a space as after a newline.
    assert tokenizer.tokenize(" 481") == ["Ġ", "4", "8", "1"] and tokenizer.tokenize("\n481")[1:] == ["4", "8", "1"]


def test_autotokenizer_loads_the_same_tokenizer(tokenizer, tmp_path):
    """AutoTokenizer of a qwen2 checkpoint rebuilds Qwen2's pre-tokenizer; trained with it, ids do not change."""
    from transformers import AutoTokenizer

    tiny_config("qwen2", 448, pad_token_id=0, eos_token_id=2).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == qwen2_5_chat_template()
    messages = MultiplyToolTask().reference_conversation("What is 48213 * 7261?\n\n  Thanks!", META)
    text = tokenizer.apply_chat_template(messages, tools=[multiply], tokenize=False)
    assert loaded.apply_chat_template(messages, tools=[multiply], tokenize=False) == text
    assert loaded(text).input_ids == tokenizer(text).input_ids
    assert loaded.decode(loaded(CALL).input_ids, skip_special_tokens=True) == CALL
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_sft_mask_covers_exactly_the_assistant_tokens(tokenizer):
    messages = MultiplyToolTask().reference_conversation("What is 48213 * 7261?", META)
    ids, mask = conversation_ids(tokenizer, messages, tools=[multiply])
    system = tokenizer.apply_chat_template(messages[:1], tools=[multiply], tokenize=False).split("<|im_start|>user")[0]
    # Hand-rendered: the glue and tool result untrained, each assistant turn trained through its <|im_end|>.
    pieces = [
        (system + "<|im_start|>user\nWhat is 48213 * 7261?<|im_end|>\n<|im_start|>assistant\n", 0),
        (CALL + "<|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\n350074593\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("The answer is 350074593.<|im_end|>", 1),
    ]
    expected_ids = [i for text, _ in pieces for i in tokenizer(text, add_special_tokens=False).input_ids]
    expected_mask = [m for text, m in pieces for _ in tokenizer(text, add_special_tokens=False).input_ids]
    assert ids == expected_ids and mask == expected_mask
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tools=[multiply], tokenize=False)[:-1]
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        conversation_ids(tokenizer, messages[1:], tools=[multiply])


def test_masked_sft_step_matches_whole_rows(tokenizer):
    """The shared-prefix step gives the loss and gradients of running every row whole."""
    from transformers import AutoModelForCausalLM

    task = MultiplyToolTask()
    rng = random.Random(2)
    rows = [conversation_ids(tokenizer, task.reference_conversation(*task.sample(rng)), [multiply]) for _ in range(3)]
    rows[1] = (rows[1][0][:-5], rows[1][1][:-5])  # rows of different lengths
    config = tiny_config("qwen2", 448, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double()
    # Reference: each row whole, one loss over all trained tokens.
    model.zero_grad()
    total, count = 0.0, 0
    for ids, mask in rows:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        labels = torch.where(torch.tensor(mask[1:], dtype=torch.bool), torch.tensor(ids[1:]), -100)
        total = total + F.cross_entropy(logits, labels, reduction="sum")
        count += sum(mask[1:])
    (total / count).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = masked_sft_step(model, optimizer, rows, pad_token_id=0)
    assert loss == pytest.approx(float(total.detach() / count), rel=1e-7)
    for name, p in model.named_parameters():
        # Qwen2's RMSNorm computes in float32 even in a float64 model: agreement to float32 rounding.
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-8, msg=name)


def test_sft_teaches_the_episode_and_the_loop_runs_the_tool(tokenizer):
    """A short warm-up on one conversation: the greedy episode calls the tool, reads its result, answers."""
    from transformers import AutoModelForCausalLM

    task = MultiplyToolTask()
    messages = task.reference_conversation("What is 48213 * 7261?", META)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", 448, pad_token_id=0, eos_token_id=2))
    losses = sft_on_conversations(model, tokenizer, [messages], steps=100, tools=[multiply], batch_size=1, lr=3e-3)
    assert losses[-1] < 0.05 * losses[0] and not model.training
    episode = _greedy_episode(model, tokenizer, max_turns=3)
    replies = [tokenizer.decode(t.completion.token_ids, skip_special_tokens=True) for t in episode.turns]
    assert replies == [CALL, "The answer is 350074593."]
    assert (episode.tool_calls, episode.tool_errors, episode.truncated) == (1, 0, False)
    assert task.reward(replies[-1], {**META, "truncated": episode.truncated}) == 1.0
    # The tool's result is in the context as the template renders it, not trained.
    result = tokenizer.decode(episode.turns[0].observation_ids)
    assert "<tool_response>\n350074593\n</tool_response>" in result
    # The same model with one turn allowed ends truncated, still calling the tool.
    cut = _greedy_episode(model, tokenizer, max_turns=1)
    assert cut.truncated and len(cut.turns) == 1


def _greedy_episode(model, tokenizer, max_turns: int):
    from lightning_offpolicy.rollout import HFEngine, SamplingConfig
    from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings

    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine.update_weights(model, 0)
    runner = EpisodeRunner(EpisodeSettings(tools=[multiply], max_turns=max_turns), tokenizer, engine.stop_ids)
    prompts = ["What is 48213 * 7261?"]
    sampling = SamplingConfig(max_new_tokens=40, samples_per_prompt=1, greedy=True)
    (episode,) = runner.run(prompts, [META], runner.prompt_ids(prompts), sampling, engine.generate, None, 0)
    return episode


def test_a_small_build_loads_as_an_ordinary_checkpoint_and_plays_episodes(tmp_path):
    """The build's pipeline on a short warm-up (the default one's success is measured by `make soak`, which
    builds it for configs/tool_use.yaml, and recorded in its marker)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from lightning_offpolicy.demo.checkpoint_cache import MARKER_FILE
    from lightning_offpolicy.demo.tool_use import prepare_tool_use_checkpoint, tool_use_success

    settings = {"sft_steps": 20, "num_conversations": 64}
    directory = prepare_tool_use_checkpoint(directory=tmp_path / "tool-use", eval_prompts=8, **settings)
    assert prepare_tool_use_checkpoint(directory=tmp_path / "tool-use", eval_prompts=8, **settings) == directory
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert tokenizer.chat_template == qwen2_5_chat_template()
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2"
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert GenerationConfig.from_pretrained(directory).eos_token_id == [im_end, end_of_text]
    assert all(len(tokenizer(t, add_special_tokens=False).input_ids) == 1 for t in TOOL_TOKENS)
    task = MultiplyToolTask()
    marker = json.loads((directory / MARKER_FILE).read_text())
    assert marker["greedy_success"] == pytest.approx(tool_use_success(model, tokenizer, task, num_prompts=8))


def test_the_template_ships_as_package_data():
    """pyproject.toml declares the template as package data of lightning_offpolicy.demo (a wheel holds it)."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = [
        p.relative_to(root / "lightning_offpolicy" / "demo").as_posix()
        for p in root.glob("lightning_offpolicy/demo/templates/*")
    ]
    assert "templates/qwen2_5.jinja" in shipped
    for path in shipped:
        assert any(fnmatch.fnmatch(path, glob) for glob in declared["lightning_offpolicy.demo"]), path


def test_bad_arguments_name_the_setting(tokenizer, tmp_path):
    from lightning_offpolicy.demo.tool_use import prepare_tool_use_checkpoint

    model = torch.nn.Linear(1, 1)
    user_only = [[{"role": "user", "content": "What is 1 * 2?"}]]
    with pytest.raises(ValueError, match="lr_schedule='linear'"):
        sft_on_conversations(model, tokenizer, user_only, steps=1, lr_schedule="linear")
    with pytest.raises(ValueError, match="conversation 0 has no assistant turn"):
        sft_on_conversations(model, tokenizer, user_only, steps=1)
    with pytest.raises(ValueError, match="unknown settings \\['sft_step'\\]"):
        prepare_tool_use_checkpoint(directory=tmp_path, sft_step=3)
    with pytest.raises(ValueError, match="pre_tokenizer='gpt2' is not known"):
        train_bpe_tokenizer(["a b"], vocab_size=300, pre_tokenizer="gpt2")
    with pytest.raises(ValueError, match="already special tokens"):
        train_bpe_tokenizer(["a b"], vocab_size=300, added_tokens=["<|im_end|>"])


def test_build_is_deterministic(tmp_path):
    """Two builds with one seed write the same tokenizer and the same weights, byte for byte."""
    from lightning_offpolicy.demo.tool_use import build_tool_use_checkpoint

    settings = dict(seed=3, sft_steps=3, num_conversations=40, vocab_size=400)
    first = build_tool_use_checkpoint(tmp_path / "one", **settings)
    second = build_tool_use_checkpoint(tmp_path / "two", **settings)
    assert first["final_loss"] == second["final_loss"]
    for name in ("tokenizer.json", "model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    other = build_tool_use_checkpoint(tmp_path / "three", **{**settings, "seed": 4})
    assert (tmp_path / "three" / "model.safetensors").read_bytes() != (
        tmp_path / "one" / "model.safetensors"
    ).read_bytes()
    assert other["final_loss"] != first["final_loss"]


def test_warm_up_data_has_as_many_short_products_as_long_ones():
    """Plain samples hold far fewer 6-digit products than 7-digit ones; the warm-up data holds as many of each."""
    from collections import Counter

    from lightning_offpolicy.demo.tool_use import _balanced_samples

    task = MultiplyToolTask()
    rng = random.Random(0)
    plain = Counter(len(str(task.sample(rng)[1]["answer"])) for _ in range(1000))
    assert plain[6] < plain[7] / 2 and set(plain) == {6, 7}
    samples = _balanced_samples(task, 200, seed=0)
    assert Counter(len(str(m["answer"])) for _, m in samples) == {6: 100, 7: 100}
    assert samples == _balanced_samples(task, 200, seed=0) and all(m["answer"] == m["a"] * m["b"] for _, m in samples)


def test_the_task_is_registered_for_the_prompt_datamodule():
    from lightning_offpolicy.data.tasks import TASKS, PromptDataModule

    assert TASKS["multiply"] is MultiplyToolTask
    data = PromptDataModule(task="multiply", prompts_per_step=4, num_train_prompts=16, num_val_prompts=4)
    prompt, meta = data.train_dataset[0]
    assert prompt == f"What is {meta['a']} * {meta['b']}?" and 1000 <= meta["a"] <= 9999 and 100 <= meta["b"] <= 999
    assert data.reward_fn([prompt], [f"The answer is {meta['a'] * meta['b']}."], [meta]) == [1.0]
    assert data.reward_fn([prompt], [f"The answer is {meta['a'] * meta['b']}."], [{**meta, "truncated": True}]) == [0.0]
