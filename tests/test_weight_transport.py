"""The in-memory weight sync of the in-process vLLM engine (shared-memory buckets) against the file path.

The bucket plan and the buffer are checked by hand on real model state dicts; on the session's
shared real engine, the weights a memory sync loads (in one bucket or in many) give the engine
bit-identical logprobs to the same weights loaded from safetensors files.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from lightning_offpolicy.demo.tiny import tiny_llama_config
from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine
from lightning_offpolicy.rollout.vllm.sync.check import trainer_probe_logprobs
from lightning_offpolicy.rollout.vllm.sync.export import unique_tensors
from lightning_offpolicy.rollout.vllm.sync.shared_weights import SharedWeightsBuffer, plan_buckets
from lightning_offpolicy.rollout.vllm.worker_extension import slot_views
from tests.vllm_fixtures import engine_arguments, requires_vllm


def _llama(**overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3, **overrides)).float()


def _layer_of(name: str) -> str | None:
    parts = name.split(".")
    return next((parts[i] for i in range(len(parts)) if parts[i].isdigit()), None)


@pytest.mark.parametrize("bucket_bytes", [1, 700_000, 10**9])
def test_buckets_keep_each_layer_whole_and_the_loose_tensors_last(bucket_bytes):
    state = unique_tensors(_llama().state_dict())
    buckets = plan_buckets(state, bucket_bytes, torch.bfloat16)
    assert [n for bucket in buckets for n in bucket] != [] and sorted(n for b in buckets for n in b) == sorted(state)
    # Every decoder layer's tensors in one bucket; the un-indexed ones (embedding, norm, lm_head) alone, last.
    homes = {}
    for index, bucket in enumerate(buckets):
        for name in bucket:
            homes.setdefault(_layer_of(name), set()).add(index)
    assert all(len(where) == 1 for where in homes.values()), homes
    assert set(buckets[-1]) == {n for n in state if _layer_of(n) is None}
    nbytes = {n: -(-t.numel() * 2 // 64) * 64 for n, t in state.items()}  # bfloat16, 64-byte slots
    layer_bytes = sum(nbytes[n] for n in state if _layer_of(n) == "0")
    per_bucket = max(1, bucket_bytes // layer_bytes)  # as many whole layers as fit, at least one
    assert len(buckets) - 1 == -(-3 // per_bucket)
    for bucket in buckets[:-1]:
        assert sum(nbytes[n] for n in bucket) <= max(bucket_bytes, layer_bytes)


def test_a_tied_output_layer_is_not_sent():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    state = Qwen2ForCausalLM(config).state_dict()
    assert "lm_head.weight" in state
    kept = unique_tensors(state)
    assert "lm_head.weight" not in kept and set(kept) == set(state) - {"lm_head.weight"}
    assert set(unique_tensors(_llama().state_dict())) == set(_llama().state_dict())  # untied: all of them


def test_the_buffer_holds_each_tensor_cast_and_aligned_and_close_deletes_it():
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.float32),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 3, 4, dtype=torch.float64).transpose(0, 2),  # not contiguous
    }
    buffer = SharedWeightsBuffer(bucket_bytes=1 << 20)
    buffer.ensure(4096)
    path = buffer.path
    assert path is not None and path.exists() and (path.stat().st_mode & 0o777) == 0o600
    if os.path.isdir("/dev/shm"):
        assert str(path).startswith("/dev/shm/")
    slots = buffer.fill(tensors.items(), torch.bfloat16)
    assert [s.offset % 64 for s in slots] == [0, 0, 0]
    assert [s.dtype for s in slots] == ["bfloat16", "int64", "bfloat16"]
    # Another mapping of the file (what a worker sees) holds exactly the cast tensors.
    seen = torch.from_file(str(path), shared=True, size=buffer.nbytes, dtype=torch.uint8)
    for slot, (name, tensor) in zip(slots, tensors.items(), strict=True):
        dtype = getattr(torch, slot.dtype)
        view = seen[slot.offset : slot.offset + tensor.numel() * dtype.itemsize].view(dtype).view(slot.shape)
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert slot.name == name and torch.equal(view, expected)
    buffer.ensure(100)  # big enough: the same file
    assert buffer.path == path
    buffer.ensure(buffer.nbytes + 1)  # too small: a new file, the old one deleted
    assert buffer.path != path and not path.exists()
    new_path = buffer.path
    buffer.close()
    assert not new_path.exists() and buffer.path is None


@requires_vllm
def test_views_vllm_still_holds_are_copied_out_before_the_pages_are_reused():
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    from lightning_offpolicy.rollout.vllm.worker_extension import _copy_out_held_views

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None: ...

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    pages = torch.arange(64, dtype=torch.uint8)
    view = pages[16:32].view(torch.float32)
    outside = torch.ones(4)
    info = get_layerwise_info(model[1])
    info.loaded_weights = [
        ("weight", inspect.signature(loader).bind(model[1].weight, view)),
        ("bias", inspect.signature(loader).bind(model[1].bias, outside)),
    ]
    _copy_out_held_views(model, pages)
    held = info.loaded_weights[0][1].arguments["loaded_weight"]
    assert torch.equal(held, view) and held.untyped_storage().data_ptr() != pages.untyped_storage().data_ptr()
    assert info.loaded_weights[1][1].arguments["loaded_weight"] is outside  # not a view of the pages: left
    pages.zero_()
    assert not torch.equal(held, view)  # the copy survives the pages' reuse
    info.reset()


@requires_vllm
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(weight_sync=dict(transport="nccl")), r"WeightSyncSettings\.transport='nccl' is not known"),
        (dict(weight_sync=dict(bucket_mb=0)), r"WeightSyncSettings\.bucket_mb=0 must be an int >= 1"),
        (dict(engine_kwargs={"worker_extension_cls": "my.Ext"}), "worker_extension_cls.*Leave it unset"),
        (
            dict(weight_sync=dict(transport="file"), engine_kwargs={"worker_extension_cls": "my.Ext"}),
            "worker_extension_cls",
        ),
        (dict(engine_kwargs={"quantization": "fp8"}), r"quantization.*weight_sync\.transport='file'"),
    ],
)
def test_bad_transport_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VLLMEngine(model="unused", **engine_arguments(**kwargs))
    if "quantization" in kwargs.get("engine_kwargs", {}):  # allowed with the file transport
        VLLMEngine(model="unused", **engine_arguments(**kwargs, weight_sync=dict(transport="file")))


@requires_vllm
def test_memory_and_file_syncs_give_bit_identical_engines(vllm_engine, trainer_model, tiny_ckpt):
    """The same trainer weights, moved in one bucket, in many, and through files: the same engine logprobs."""
    engine = vllm_engine
    assert engine.weight_transport == "memory" and engine.compute_dtype == torch.float32
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for param in trainer_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    probe = engine._probe(trainer_model)
    trainer = trainer_probe_logprobs(trainer_model, probe)
    seen = {}
    try:
        for label, transport, bucket_mb in (
            ("one bucket", "memory", 512),
            ("file", "file", 512),
            ("1 MiB", "memory", 1),
        ):
            engine.weight_transport, engine.weight_bucket_mb = transport, bucket_mb
            engine.update_weights(trainer_model, 30)
            seen[label] = engine._engine_probe_logprobs(probe)
            assert engine.last_sync_check_max_abs_diff <= 1e-3
            if transport == "memory":  # float32 engine: every (untied) float32 tensor once
                assert engine.last_sync_bytes == sum(t.numel() * 4 for t in trainer_model.state_dict().values())
        assert torch.equal(seen["one bucket"], seen["file"]) and torch.equal(seen["1 MiB"], seen["file"])
        assert float((seen["file"] - trainer).abs().max()) <= 1e-3
        buckets = plan_buckets(unique_tensors(trainer_model.state_dict()), 1 << 20, torch.float32)
        assert len(buckets) >= 2  # the 1 MiB case really went in several buckets
        # The workers keep their mapping; the file's name is gone after the first bucket (nothing left behind
        # in /dev/shm by a run that dies), and the later syncs above still arrived.
        assert engine._shared_weights.path is not None and not engine._shared_weights.path.exists()
    finally:
        engine.weight_transport, engine.weight_bucket_mb = "memory", 512
        from transformers import LlamaForCausalLM

        engine.update_weights(LlamaForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval(), 0)


def test_a_full_dev_shm_falls_back_to_a_temporary_file(monkeypatch, tmp_path, caplog):
    """A container's small /dev/shm (Docker: 64 MB): the buffer goes to an ordinary file instead of dying of SIGBUS."""
    import tempfile

    real_statvfs = os.statvfs

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full() if path == "/dev/shm" else real_statvfs(path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    buffer = SharedWeightsBuffer(bucket_bytes=1 << 20)
    with caplog.at_level("WARNING"):
        buffer.ensure(1 << 20)
    assert buffer.path is not None and buffer.path.parent == tmp_path
    assert "--shm-size" in caplog.text
    slots = buffer.fill([("w", torch.ones(8))], None)
    assert slots[0].dtype == "float32"
    buffer.close()


def test_send_moves_every_tensor_and_leaves_no_file_behind():
    """A receiver that maps the file at the first bucket, as a vLLM worker does, gets every tensor cast; the file's
    name is gone after the first bucket, also when that bucket's load fails."""
    state = unique_tensors(_llama().state_dict())
    received: dict[str, torch.Tensor] = {}
    mapped: dict[str, torch.Tensor] = {}

    def load(path, nbytes, slots, first, last):
        if path not in mapped:
            mapped[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        for name, view in slot_views(mapped[path], slots):  # as SharedWeightsReceiver reads them
            received[name] = view.clone()
        return "last" if last else "not last"

    buffer = SharedWeightsBuffer(bucket_bytes=300_000)
    moved, answer = buffer.send(state, torch.bfloat16, load)
    assert answer == "last"
    assert not buffer.path.exists() and len(mapped) == 1
    assert received.keys() == state.keys() and moved == sum(t.numel() * 2 for t in state.values())
    assert all(torch.equal(received[n], t.to(torch.bfloat16)) for n, t in state.items())
    buffer.send(state, torch.bfloat16, load)  # the next sync reuses the mapping under the same name
    assert len(mapped) == 1
    buffer.close()

    def failing(path, nbytes, slots, first, last):
        raise RuntimeError("the engine died")

    buffer = SharedWeightsBuffer(bucket_bytes=300_000)
    with pytest.raises(RuntimeError, match="died"):
        buffer.send(state, torch.bfloat16, failing)
    assert not buffer.path.exists()
    buffer.close()
