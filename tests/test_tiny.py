"""The tiny Llama, its SFT warm-up, the cached checkpoint and `tiny:` model specs."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import lightning_offpolicy.demo.tiny as tiny
from lightning_offpolicy.data.tasks import get_task
from lightning_offpolicy.data.tokenizers import CharTokenizer, load_tokenizer
from lightning_offpolicy.demo.checkpoint_cache import CACHE_ENV, MARKER_FILE
from lightning_offpolicy.demo.tiny import (
    build_tiny_llama,
    greedy_completions,
    greedy_reward,
    prepare_tiny_checkpoint,
    resolve_model_path,
    tiny_llama_config,
    warmup_sft,
)
from tests.module_helpers import TWO_RANK_START_METHOD


@pytest.fixture(autouse=True)
def _cache_and_threads(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # One thread: the model is tiny, and on a busy 2-core machine two threads run ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_config_shape():
    config = tiny_llama_config()
    assert config.vocab_size == 64 and config.hidden_size == 128 and config.intermediate_size == 256
    assert config.num_hidden_layers == 2 and config.num_attention_heads == 2 and config.num_key_value_heads == 2
    assert config.hidden_size // config.num_attention_heads == 64 == config.head_dim  # vLLM CPU attention
    assert config.max_position_embeddings == 256
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.tie_word_embeddings is False
    assert tiny_llama_config(num_hidden_layers=1).num_hidden_layers == 1


def test_build_is_seeded_float32_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = build_tiny_llama(seed=0), build_tiny_llama(seed=0), build_tiny_llama(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert not a.training


def test_warmup_lowers_loss_and_raises_greedy_reward():
    tok, task = CharTokenizer(), get_task("reverse")
    model = build_tiny_llama(seed=0)
    before = greedy_reward(model, tok, task, num_prompts=64)
    losses = warmup_sft(model, tok, task, steps=10, batch_size=64)
    after = greedy_reward(model, tok, task, num_prompts=64)
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3
    assert after > before + 0.1, (before, after)
    assert not model.training


def test_greedy_completions_stop_at_eos_and_are_batch_invariant():
    tok, task = CharTokenizer(), get_task("copy")
    model = build_tiny_llama(seed=0)
    with torch.no_grad():  # make eos the argmax after any prefix: every completion is empty
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id].fill_(1.0)
    assert greedy_completions(model, tok, ["copy ab=", "copy abcdef="], task.max_new_tokens) == ["", ""]
    model = build_tiny_llama(seed=3)
    prompts = ["copy ab=", "copy abcdef=", "rev abc="]
    together = greedy_completions(model, tok, prompts, task.max_new_tokens)
    alone = [greedy_completions(model, tok, [p], task.max_new_tokens)[0] for p in prompts]
    assert together == alone  # left padding does not change the answers
    assert all(len(c) <= task.max_new_tokens for c in together)


def test_prepare_checkpoint_caches_and_reloads(tmp_path):
    from transformers import LlamaForCausalLM

    start = time.perf_counter()
    path = prepare_tiny_checkpoint("copy", sft_steps=2, seed=0)
    first = time.perf_counter() - start
    assert path == tmp_path / "cache" / "tiny-copy-sft2-seed0"
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["spec"]["task"] == "copy" and marker["spec"]["sft_steps"] == 2
    assert 0.0 <= marker["greedy_reward"] <= 1.0
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    start = time.perf_counter()
    assert prepare_tiny_checkpoint("copy", sft_steps=2, seed=0) == path
    assert time.perf_counter() - start < min(first, 1.0)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tiny-copy-sft2-seed0.tmp")]

    tok = load_tokenizer(path)
    assert isinstance(tok, CharTokenizer)
    reloaded = LlamaForCausalLM.from_pretrained(path)
    expected = build_tiny_llama(seed=0)
    warmup_sft(expected, tok, get_task("copy"), steps=2, seed=0)
    ids = torch.tensor([tok.encode("copy abc=")])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected(ids).logits)


def test_interrupted_or_stale_builds_are_redone(tmp_path):
    target = tmp_path / "ckpt"
    leftover = tmp_path / ".ckpt.tmp-killed"  # what a killed build leaves behind
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    target.mkdir()  # an empty directory (e.g. created by hand) is filled
    assert prepare_tiny_checkpoint("addition", sft_steps=0, directory=target) == target.absolute()
    assert not leftover.exists()
    # A marker with another spec (or a missing marker file after an interruption) means rebuild.
    marker = json.loads((target / MARKER_FILE).read_text())
    marker["spec"]["seed"] = 99
    (target / MARKER_FILE).write_text(json.dumps(marker))
    prepare_tiny_checkpoint("addition", sft_steps=0, directory=target)
    assert json.loads((target / MARKER_FILE).read_text())["spec"]["seed"] == 0
    # A directory holding something else is never overwritten.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing"):
        prepare_tiny_checkpoint("addition", sft_steps=0, directory=other)
    assert (other / "notes.txt").read_text() == "mine"


def test_concurrent_callers_share_one_build(tmp_path, monkeypatch):
    builds = []
    real_warmup = tiny.warmup_sft

    def counting_warmup(*args, **kwargs):
        builds.append(1)
        time.sleep(0.2)
        return real_warmup(*args, **kwargs)

    monkeypatch.setattr(tiny, "warmup_sft", counting_warmup)
    results, errors = [], []

    def call():
        try:
            results.append(prepare_tiny_checkpoint("reverse", sft_steps=1, seed=2))
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results[0] == results[1] and (results[0] / MARKER_FILE).is_file()
    assert len(builds) == 1


def test_resolve_model_path_parsing(monkeypatch):
    calls = []
    monkeypatch.setattr(tiny, "prepare_tiny_checkpoint", lambda task, **kw: calls.append((task, kw)) or f"/x/{task}")
    assert resolve_model_path("tiny:reverse") == "/x/reverse"
    assert resolve_model_path("tiny:addition?sft_steps=300&seed=1") == "/x/addition"
    assert resolve_model_path("tiny:copy?sft_lr=1e-3") == "/x/copy"
    assert calls == [("reverse", {}), ("addition", {"sft_steps": 300, "seed": 1}), ("copy", {"sft_lr": 1e-3})]
    assert resolve_model_path("/some/local/dir") == "/some/local/dir"
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    for bad, match in [
        ("tiny:reverse?sft_steps", "bad query string"),
        ("tiny:reverse?steps=3", "unknown option 'steps'"),
        ("tiny:reverse?seed=x", "not an integer"),
        ("tiny:reverse?seed=1&seed=2", "twice"),
        ("tiny:reverse?sft_lr=fast", "not a number"),
        ("tiny:", "names no task"),
        ("tiny:nope", "available tasks"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_model_path(bad)
    assert len(calls) == 3


def test_resolve_model_path_builds_a_checkpoint(tmp_path):
    path = resolve_model_path("tiny:copy?sft_steps=0&seed=4")
    assert path == str(tmp_path / "cache" / "tiny-copy-sft0-seed4")
    assert (tmp_path / "cache" / "tiny-copy-sft0-seed4" / MARKER_FILE).is_file()
    # A non-default learning rate gets its own directory.
    path = resolve_model_path("tiny:copy?sft_steps=0&seed=4&sft_lr=0.01")
    assert path == str(tmp_path / "cache" / "tiny-copy-sft0-seed4-lr0.01")
    assert torch.get_num_threads() == 1  # the build restores the caller's thread count


def test_prepare_checkpoint_argument_errors():
    with pytest.raises(ValueError, match="available tasks"):
        prepare_tiny_checkpoint("nope")
    with pytest.raises(ValueError, match="sft_steps"):
        prepare_tiny_checkpoint("copy", sft_steps=-1)
    with pytest.raises(ValueError, match="sft_lr"):
        prepare_tiny_checkpoint("copy", sft_steps=0, sft_lr=0.0)
    assert tiny.DEFAULT_SFT_STEPS.keys() == tiny.DEFAULT_SFT_LR.keys()


def _build_on_rank_1(rank: int, port: int, directory: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 1:
            prepare_tiny_checkpoint("copy", sft_steps=1, directory=directory)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_a_build_on_a_ddp_rank_other_than_0_writes_the_weights(tmp_path):
    """transformers writes a model only on rank 0 once torch.distributed is up; the cache is built by whichever
    rank takes its lock first. A marker without weights used to be left (and kept for good: it read as built)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = tmp_path / "ckpt"
    torch.multiprocessing.start_processes(
        _build_on_rank_1, args=(port, str(target)), nprocs=2, start_method=TWO_RANK_START_METHOD
    )
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    # The marker without the weights (what the bug left) is rebuilt, not taken for a finished build.
    (target / "model.safetensors").unlink()
    assert prepare_tiny_checkpoint("copy", sft_steps=1, directory=target) == target.absolute()
    assert (target / "model.safetensors").is_file()
