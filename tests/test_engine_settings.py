"""The vLLM engines' grouped settings: each group checks its own fields, the engines read them, YAML nests them.

No engine is started here: both engines start lazily (the in-process one at its first call, the
remote one at its first request), so building them only validates and stores the settings.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_offpolicy.rollout.vllm.settings import (
    ConnectionSettings,
    RemoteWeightSyncSettings,
    StartSettings,
    WeightSyncSettings,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("settings_type", "kwargs", "match"),
    [
        (StartSettings, {"dtype": "fp8"}, r"StartSettings.dtype='fp8' is not known"),
        (StartSettings, {"max_model_len": 1}, r"StartSettings.max_model_len=1 must be an int >= 2"),
        (StartSettings, {"max_model_len": 64.0}, r"StartSettings.max_model_len=64.0 must be an int"),
        (StartSettings, {"gpu_memory_utilization": 0}, r"StartSettings.gpu_memory_utilization=0 must be in \(0, 1\]"),
        (StartSettings, {"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        (StartSettings, {"kv_cache_space_gib": 0}, r"StartSettings.kv_cache_space_gib=0 must be an int >= 1"),
        (StartSettings, {"seed": "0"}, r"StartSettings.seed='0' must be an int"),
        (WeightSyncSettings, {"transport": "nccl"}, r"WeightSyncSettings.transport='nccl' is not known"),
        (WeightSyncSettings, {"check": 1}, r"WeightSyncSettings.check=1 must be True or False"),
        (WeightSyncSettings, {"tolerance": 0.0}, r"WeightSyncSettings.tolerance=0.0 must be > 0"),
        (WeightSyncSettings, {"bucket_mb": 0}, r"WeightSyncSettings.bucket_mb=0 must be an int >= 1"),
        (WeightSyncSettings, {"lora": "dora"}, r"WeightSyncSettings.lora='dora' is not known"),
        (RemoteWeightSyncSettings, {"transport": "memory"}, r"RemoteWeightSyncSettings.transport='memory' is not"),
        (RemoteWeightSyncSettings, {"weights_dir": ""}, r"RemoteWeightSyncSettings.weights_dir='' must be a dir"),
        (RemoteWeightSyncSettings, {"server_weights_dir": "/srv"}, r"server_weights_dir is set but weights_dir is not"),
        (RemoteWeightSyncSettings, {"tolerance": -1}, r"RemoteWeightSyncSettings.tolerance=-1 must be > 0"),
        (RemoteWeightSyncSettings, {"lora": "full"}, r"RemoteWeightSyncSettings.lora='full' is not known"),
        (RemoteWeightSyncSettings, {"push_lora_base": "yes"}, r"push_lora_base='yes' must be True or False"),
        (RemoteWeightSyncSettings, {"share_with_group": 0}, r"share_with_group=0 must be True or False"),
        (RemoteWeightSyncSettings, {"master_address": ""}, r"master_address='' must be a host name"),
        (RemoteWeightSyncSettings, {"master_port": 70000}, r"master_port=70000 must be a port number"),
        (ConnectionSettings, {"api_key": ""}, r"ConnectionSettings.api_key must be a non-empty str"),
        (ConnectionSettings, {"connect_timeout_s": 0}, r"ConnectionSettings.connect_timeout_s=0 must be > 0"),
        (ConnectionSettings, {"max_concurrent_requests": 0}, r"max_concurrent_requests=0 must be an int >= 1"),
        (ConnectionSettings, {"stream": "always"}, r"ConnectionSettings.stream='always' must be True"),
        (ConnectionSettings, {"stream_interval": 0}, r"ConnectionSettings.stream_interval=0 must be an int >= 1"),
    ],
)
def test_each_group_refuses_a_bad_field_by_name(settings_type, kwargs, match):
    with pytest.raises(ValueError, match=match):
        settings_type(**kwargs)


def test_the_defaults_are_the_engines_documented_ones():
    assert StartSettings() == StartSettings("auto", None, 0.3, 1, 0)
    local = WeightSyncSettings()
    assert (local.transport, local.check, local.tolerance, local.bucket_mb, local.lora) == (
        "memory", True, None, 512, "merged"
    )  # fmt: skip
    remote = RemoteWeightSyncSettings()
    assert (remote.transport, remote.weights_dir, remote.check, remote.lora, remote.push_lora_base) == (
        "file", None, True, "merged", True
    )  # fmt: skip
    connection = ConnectionSettings()
    assert (connection.api_key, connection.connect_timeout_s, connection.max_concurrent_requests) == (None, 30.0, 32)
    assert (connection.stream, connection.stream_interval) == (None, 8)


def test_a_weights_dir_that_is_a_file_is_refused_and_a_path_is_kept_as_str(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        RemoteWeightSyncSettings(weights_dir=str(tmp_path / "file"))
    settings = RemoteWeightSyncSettings(weights_dir=tmp_path / "sync", server_weights_dir=Path("/mnt/sync"))
    assert (settings.weights_dir, settings.server_weights_dir) == (str(tmp_path / "sync"), "/mnt/sync")


def test_the_api_key_stays_out_of_the_repr():
    settings = ConnectionSettings(api_key="secret-key-123")
    assert "secret-key-123" not in repr(settings)
    assert settings.api_key == "secret-key-123"


def test_the_in_process_engine_reads_its_groups():
    pytest.importorskip("vllm")
    from lightning_offpolicy.rollout.vllm import VLLMEngine

    engine = VLLMEngine(
        start=StartSettings(
            dtype="bfloat16", max_model_len=96, gpu_memory_utilization=0.2, kv_cache_space_gib=2, seed=7
        ),
        weight_sync=WeightSyncSettings(transport="file", check=False, tolerance=0.25, bucket_mb=64, lora="adapter"),
    )
    assert (engine.dtype, engine.max_model_len, engine.gpu_memory_utilization) == ("bfloat16", 96, 0.2)
    assert (engine.kv_cache_space_gib, engine.seed) == (2, 7)
    assert (engine.weight_transport, engine.check_weight_sync, engine.weight_sync_tolerance) == ("file", False, 0.25)
    assert (engine.weight_bucket_mb, engine.lora_sync, engine.started) == (64, "adapter", False)
    with pytest.raises(TypeError, match=r"VLLMEngine.start must be a StartSettings .* got dict"):
        VLLMEngine(start={"dtype": "bfloat16"})
    with pytest.raises(TypeError, match=r"VLLMEngine.weight_sync must be a WeightSyncSettings"):
        VLLMEngine(weight_sync=RemoteWeightSyncSettings())
    with pytest.raises(ValueError, match=r"quantization='fp8', but weight_sync.transport='memory'"):
        VLLMEngine(engine_kwargs={"quantization": "fp8"})


def test_the_remote_engine_reads_its_groups(tmp_path, monkeypatch):
    from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    engine = RemoteVLLMEngine(
        "http://127.0.0.1:9/v1",
        weight_sync=RemoteWeightSyncSettings(
            weights_dir=str(tmp_path), server_weights_dir="/srv/sync", check=False, tolerance=0.5, lora="adapter",
            push_lora_base=False, share_with_group=True,
        ),
        connection=ConnectionSettings(
            api_key="k", connect_timeout_s=3.0, max_concurrent_requests=4, stream=True, stream_interval=2
        ),
    )  # fmt: skip
    assert (engine.weights_dir, engine.server_weights_dir) == (str(tmp_path), "/srv/sync")
    assert (engine.check_weight_sync, engine.weight_sync_tolerance, engine.lora_sync) == (False, 0.5, "adapter")
    assert (engine.push_lora_base, engine.share_weights_with_group, engine.weight_transport) == (False, True, "file")
    assert (engine.connect_timeout_s, engine.max_concurrent_requests, engine.concurrent_calls) == (3.0, 4, 4)
    assert (engine.stream, engine.stream_interval, engine._http.api_key) == (True, 2, "k")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert RemoteVLLMEngine("http://127.0.0.1:9")._http.api_key == "from-env"
    with pytest.raises(TypeError, match=r"RemoteVLLMEngine.connection must be a ConnectionSettings"):
        RemoteVLLMEngine("http://127.0.0.1:9", connection={"stream": True})
    with pytest.raises(ValueError, match=r"weight_sync.transport='nccl'\) needs weight_sync.master_address|no CUDA"):
        RemoteVLLMEngine("http://10.0.0.5:8000", weight_sync=RemoteWeightSyncSettings(transport="nccl"))


def test_launch_local_server_refuses_loose_start_settings_before_starting_anything(tmp_path):
    from lightning_offpolicy.rollout.vllm import launch_local_server

    with pytest.raises(TypeError, match=r"launch_local_server.start must be a StartSettings"):
        launch_local_server(tmp_path, start={"dtype": "float32"})


def test_yaml_and_the_command_line_nest_the_groups():
    pytest.importorskip("vllm")
    from tests.test_cli import parse

    cli = parse(
        "--config", str(ROOT / "configs" / "vllm.yaml"),
        "--rollout.engine.init_args.start.max_model_len=96",
        "--rollout.engine.init_args.weight_sync.transport=file",
        "--rollout.engine.init_args.weight_sync.tolerance=0.5",
    )  # fmt: skip
    (callback,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutCallback"]
    engine = callback.engine
    assert (engine.dtype, engine.max_model_len) == ("bfloat16", 96)  # dtype from the config's start mapping
    assert (engine.weight_transport, engine.weight_sync_tolerance, engine.weight_bucket_mb) == ("file", 0.5, 512)
