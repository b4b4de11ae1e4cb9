"""RemoteVLLMEngine(weight_sync.lora="adapter") against a real vLLM server with runtime LoRA loading.

The tests run on the session's shared server (tests/vllm_fixtures.py: ``launch_local_server(enable_lora=True,
max_lora_rank=8)``, float32, from the tiny checkpoint). The reference is the trainer's peft model:
its float32 teacher-forced logprobs (adapter on, and off for the base). Each test makes its own
engines (an engine pushes the base weights at its first sync, so a test does not depend on what
an earlier one left in the server). The server-configuration errors that need another server
(LoRA off, runtime loading off) run against stand-ins that answer as vLLM 0.32 does. Measured
numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.rollout.engine import Completion, SamplingConfig
from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine, launch_local_server
from lightning_offpolicy.rollout.vllm.settings import RemoteWeightSyncSettings
from tests.test_remote_vllm import _models
from tests.test_vllm_lora import RANK, _bit_identical, _ckpt_lora, _lora, _optimizer_step, _snapshot
from tests.vllm_fixtures import (
    SERVER_MAX_LORA_RANK,
    requires_vllm,
    residuals,
    reverse_prompts,
    teacher_forced_logprobs,
)

peft = pytest.importorskip("peft")

#: Largest |server - peft model| per-token logprob residual accepted (float32 on both sides).
LOGPROB_TOL = 1e-4
MEASURED: dict[str, float] = {}


# ---------------------------------------------------------------------- helpers


def _served(base_url: str) -> list[str]:
    """The names the server answers to (``/v1/models``: the base model, then the adapters loaded)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as answer:
        return [m["id"] for m in json.load(answer)["data"]]


def _complete(base_url: str, model: str) -> tuple[int, str]:
    """``(status, body)`` of a one-token completion request naming ``model``."""
    body = json.dumps({"model": model, "prompt": [1, 5], "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _residual(engine: RemoteVLLMEngine, model: torch.nn.Module, seed: int) -> tuple[float, float, list[Completion]]:
    """Max |server - peft model| logprob of the sampled tokens, and the mean |server - base model| (adapter off)."""
    prompts = reverse_prompts(8, seed=seed)
    completions = engine.generate(prompts, SamplingConfig(max_new_tokens=10, samples_per_prompt=2), seed=seed)
    sampled = [c.logprobs for c in completions]
    peft_lp = residuals(sampled, teacher_forced_logprobs(model, prompts, completions, 1.0))
    with model.disable_adapter():
        base = residuals(sampled, teacher_forced_logprobs(model, prompts, completions, 1.0))
    return float(peft_lp.max()), float(base.mean()), completions


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


@pytest.fixture(scope="module", autouse=True)
def _print_measured():
    yield
    print("\nMEASURED", {k: round(v, 6) for k, v in MEASURED.items()})


@pytest.fixture
def lora_server(vllm_server):
    """The session's server: it loads adapters up to the rank of this module's."""
    assert RANK <= SERVER_MAX_LORA_RANK
    return vllm_server


@pytest.fixture
def make_engine(lora_server, tmp_path):
    """Engines on the module's server (closed at the test's end), sharing one weights_dir; ``make(**fields)``: the
    other fields of the engine's ``weight_sync`` (``lora``, ``push_lora_base``)."""
    engines: list[RemoteVLLMEngine] = []

    def make(**fields) -> RemoteVLLMEngine:
        weight_sync = RemoteWeightSyncSettings(weights_dir=str(tmp_path / "weights"), **fields)
        engines.append(
            RemoteVLLMEngine(lora_server.base_url, eos_token_id=2, request_timeout_s=300, weight_sync=weight_sync)
        )
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def _info(lora: dict | None, env: dict) -> tuple[int, object]:
    """A /server_info answer as vLLM 0.32 gives it (``lora``: its ``lora_config``, ``None`` without --enable-lora)."""
    model = {"logprobs_mode": "processed_logprobs", "dtype": "torch.float32", "max_model_len": 256}
    return 200, {"vllm_config": {"model_config": model, "lora_config": lora}, "vllm_env": env, "system_env": {}}


# ---------------------------------------------------------------------- no vLLM server needed


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
def test_adapter_mode_checks_its_source_before_any_request(tmp_path):
    from transformers import LlamaForCausalLM

    from lightning_offpolicy.demo.tiny import tiny_llama_config

    with pytest.raises(ValueError, match=r"RemoteWeightSyncSettings\.lora='lora' is not known"):
        RemoteVLLMEngine("http://127.0.0.1:8000", weight_sync=RemoteWeightSyncSettings(lora="lora"))
    with pytest.raises(ValueError, match=r"RemoteWeightSyncSettings\.push_lora_base='no' must be True or False"):
        RemoteVLLMEngine("http://127.0.0.1:8000", weight_sync=RemoteWeightSyncSettings(push_lora_base="no"))
    # A closed port: a request would fail with "connection refused", not with these errors.
    engine = RemoteVLLMEngine(
        "http://127.0.0.1:9",
        eos_token_id=2,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path), lora="adapter"),
    )
    plain = LlamaForCausalLM(tiny_llama_config()).eval()
    with pytest.raises(TypeError, match=r"peft LoRA model, got LlamaForCausalLM.*weight_sync\.lora='merged'"):
        engine.update_weights(plain, 1)
    with pytest.raises(TypeError, match=r"weight_sync\.lora='merged'"):
        engine.update_weights(plain.state_dict(), 1)
    for config, feature in [
        (dict(use_dora=True), r"use_dora=True \(DoRA\)"),
        (dict(lora_bias=True), "lora_bias=True"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ]:
        model = _lora(LlamaForCausalLM(tiny_llama_config()).eval(), **config)
        with pytest.raises(NotImplementedError, match=rf"cannot apply this adapter \({feature}.*plain LoRA"):
            engine.update_weights(model, 1)
    assert not engine.connected and engine.version == 0 and list(tmp_path.iterdir()) == []
    engine.close()


def test_server_without_lora_support_is_a_clear_error(stand_in, tmp_path):
    model = _lora(_tiny_base())
    models = _models("m")
    no_lora = stand_in({("GET", "/v1/models"): models, ("GET", "/server_info"): _info(None, {})})
    engine = RemoteVLLMEngine(
        no_lora.base_url,
        eos_token_id=2,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path), lora="adapter"),
    )
    with pytest.raises(RuntimeError, match=r"without LoRA support.*--enable-lora --max-lora-rank 8 and "):
        engine.update_weights(model, 1)
    engine.close()

    no_runtime = stand_in(
        {
            ("GET", "/v1/models"): models,
            ("GET", "/server_info"): _info({"max_lora_rank": 8}, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": False}),
        }
    )
    engine = RemoteVLLMEngine(
        no_runtime.base_url,
        eos_token_id=2,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path), lora="adapter"),
    )
    with pytest.raises(RuntimeError, match="cannot load adapters at run time.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        engine.update_weights(model, 1)
    with pytest.raises(ValueError, match=r"rank 16 exceeds the server's --max-lora-rank 8.*--max-lora-rank 16"):
        engine.update_weights(_lora(_tiny_base(), r=16), 1)
    engine.close()

    # Not said in /server_info (another vLLM version): the missing route answers 404, after the base push.
    unsaid = stand_in(
        {
            ("GET", "/v1/models"): models,
            ("GET", "/server_info"): _info({"max_lora_rank": 8}, {}),
            ("POST", "/collective_rpc"): (200, {"results": [None]}),
            ("POST", "/reset_prefix_cache"): (200, {"success": True}),
        }
    )
    engine = RemoteVLLMEngine(
        unsaid.base_url,
        eos_token_id=2,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path), lora="adapter", check=False),
    )
    with pytest.raises(RuntimeError, match="no /v1/load_lora_adapter.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        engine.update_weights(model, 1)
    posts = [(path, body) for method, path, _, body in unsaid.requests if method == "POST"]
    # The receiver asked for once (this stand-in has none), then vLLM's own reload of the base.
    paths = [path for path, _ in posts]
    assert paths == ["/collective_rpc", "/collective_rpc", "/reset_prefix_cache", "/v1/load_lora_adapter"]
    assert [body["method"] for _, body in posts[:2]] == ["lo_receiver_version", "reload_weights"]
    assert engine.version == 0 and engine.adapter_name is None
    assert [p.name for p in engine._sync_dir.iterdir()] == []  # base file and the unloaded adapter's files gone
    engine.close()


def test_launcher_lora_argument_checks(tmp_path):
    with pytest.raises(ValueError, match="enable_lora"):
        launch_local_server(tmp_path, enable_lora="yes")
    with pytest.raises(ValueError, match=r"max_lora_rank=12 is not one vLLM accepts.*16"):
        launch_local_server(tmp_path, enable_lora=True, max_lora_rank=12)


def _tiny_base() -> torch.nn.Module:
    from lightning_offpolicy.demo.tiny import build_tiny_llama

    return build_tiny_llama()


# ---------------------------------------------------------------------- the module's real server


@requires_vllm
@pytest.mark.slow
def test_adapter_syncs_follow_the_peft_model(make_engine, lora_server, tiny_ckpt, monkeypatch):
    model = _ckpt_lora(tiny_ckpt)
    engine = make_engine(lora="adapter")
    reloads: list[str] = []
    reload = engine._reload_weights
    monkeypatch.setattr(engine, "_reload_weights", lambda path: (reloads.append(path), reload(path))[1])

    before = _snapshot(model)
    engine.update_weights(model, 0)  # the base weights, then the adapter
    assert _bit_identical(model, before), "the sync changed the trainer's weights"
    assert engine.server_lora_config["max_lora_rank"] == RANK and engine.server_runtime_lora is True
    assert engine.last_sync_check_max_abs_diff <= 1e-3
    first_name, first_dir = engine.adapter_name, engine._adapter_dir
    assert first_name.startswith("policy-v0-") and _served(lora_server.base_url) == [str(tiny_ckpt), first_name]
    other = make_engine()  # model=None takes the only model served: adapters listed beside it do not count
    other.connect()
    assert other.model_name == str(tiny_ckpt)
    MEASURED["first_sync_s"], MEASURED["first_sync_bytes"] = engine.last_sync_time_s, engine.last_sync_bytes
    residual, vs_base, _ = _residual(engine, model, seed=1)
    print(f"\nadapter v0 (first sync {engine.last_sync_time_s:.3f} s): |server - peft| max {residual:.3g}, "
          f"|server - base| mean {vs_base:.3g}")  # fmt: skip
    assert residual <= LOGPROB_TOL and vs_base > 0.05

    _optimizer_step(model, seed=2)
    engine.update_weights(model, 1)
    MEASURED["adapter_sync_s"] = engine.last_sync_time_s
    MEASURED["adapter_check_max_abs_diff"] = engine.last_sync_check_max_abs_diff
    residual, vs_base, completions = _residual(engine, model, seed=3)
    MEASURED["adapter_residual_max"] = residual
    print(f"adapter v1 (sync {engine.last_sync_time_s:.3f} s: write {engine.last_write_time_s:.3f}, load "
          f"{engine.last_reload_time_s:.3f}): |server - peft| max {residual:.3g}")  # fmt: skip
    assert residual <= LOGPROB_TOL and vs_base > 0.05
    assert engine.version == 1 and {c.policy_version for c in completions} == {1}
    assert len(reloads) == 1, "the base weights must be pushed once"

    # The old adapter is unloaded (the server no longer answers to its name) and its files are gone.
    name = engine.adapter_name
    assert name.startswith("policy-v1-") and name != first_name
    assert _served(lora_server.base_url) == [str(tiny_ckpt), name]
    status, body = _complete(lora_server.base_url, first_name)
    assert status == 404 and f"The model `{first_name}` does not exist" in body
    assert not first_dir.exists()
    # Only the current adapter's files remain (the base file went after its reload), private to the trainer.
    sync_dir = engine._sync_dir
    (adapter_dir,) = sync_dir.iterdir()
    assert engine._adapter_dir == adapter_dir and adapter_dir.name.endswith("-v1")
    assert {p.name for p in _files(adapter_dir)} == {"adapter_config.json", "adapter_model.safetensors"}
    assert engine.last_sync_bytes == sum(p.stat().st_size for p in _files(adapter_dir))
    assert sync_dir.stat().st_mode & 0o777 == 0o700 and adapter_dir.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in _files(adapter_dir))

    engine.close()  # unloads the adapter in use, removes the files
    assert _served(lora_server.base_url) == [str(tiny_ckpt)] and not sync_dir.exists()


@requires_vllm
@pytest.mark.slow
def test_adapter_sync_that_did_not_arrive_is_caught(make_engine, tiny_ckpt, monkeypatch):
    model = _ckpt_lora(tiny_ckpt)
    engine = make_engine(lora="adapter")
    engine.update_weights(model, 10)  # a good sync: the check's reference point
    monkeypatch.setattr(engine, "_load_adapter", lambda name, path: None)  # written, never loaded
    _optimizer_step(model, seed=4)
    with pytest.raises(RuntimeError, match="did not arrive"):
        engine.update_weights(model, 11)
    assert engine.version == 10 and engine.adapter_name.startswith("policy-v10-")
    monkeypatch.undo()
    engine.update_weights(model, 11)
    assert engine.version == 11 and engine.last_sync_check_max_abs_diff <= 1e-3


@requires_vllm
@pytest.mark.slow
def test_rank_above_the_servers_limit_is_refused(make_engine, tiny_ckpt):
    engine = make_engine(lora="adapter")
    model = _lora(_tiny_base(), r=2 * RANK)
    with pytest.raises(ValueError, match=rf"rank {2 * RANK} exceeds the server's --max-lora-rank {RANK}"):
        engine.update_weights(model, 1)
    assert engine.connected and engine._sync_dir is None  # refused before anything was written


@requires_vllm
@pytest.mark.slow
def test_adapter_bytes_against_merged_and_a_served_base(make_engine, tiny_ckpt):
    """Bytes per sync, adapter << merged; ``push_lora_base=False`` on a server that does (not) serve the base."""
    from transformers import LlamaForCausalLM

    model = _ckpt_lora(tiny_ckpt)
    adapter = make_engine(lora="adapter")
    adapter.update_weights(model, 0)
    _optimizer_step(model, seed=5)
    adapter.update_weights(model, 1)
    adapter_bytes, adapter_s = adapter.last_sync_bytes, adapter.last_sync_time_s
    adapter.close()
    merged = make_engine(lora="merged")
    merged.update_weights(model, 2)  # the server's base weights are now W + scaling B A
    merged_bytes, merged_s = merged.last_sync_bytes, merged.last_sync_time_s
    merged_residual, vs_base, _ = _residual(merged, model, seed=6)
    assert merged_residual <= LOGPROB_TOL and vs_base > 0.05
    lora_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    base_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    # Each file: its float32 tensors plus a header (and the adapter's config) of a few KiB at most.
    assert 4 * lora_params < adapter_bytes < 4 * lora_params + 4096
    assert 4 * base_params < merged_bytes < 4 * base_params + 4096
    ratio = merged_bytes / adapter_bytes
    MEASURED.update(
        adapter_bytes=adapter_bytes,
        merged_bytes=merged_bytes,
        adapter_s=adapter_s,
        merged_s=merged_s,
        ratio=ratio,
        merged_residual_max=merged_residual,
    )
    print(f"\nbytes per sync: adapter {adapter_bytes} ({adapter_s:.3f} s), merged {merged_bytes} ({merged_s:.3f} s): "
          f"x{ratio:.1f}")  # fmt: skip
    assert ratio > 0.9 * base_params / lora_params > 30  # the parameter ratio, less the adapter's config file

    # push_lora_base=False trusts the server's base: the self-check catches one that is not the trainer's.
    trusting = make_engine(lora="adapter", push_lora_base=False)
    with pytest.raises(RuntimeError, match="weight-sync check failed"):
        trusting.update_weights(model, 3)
    assert trusting.version == 0
    merged.update_weights(LlamaForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval(), 4)
    served_base = make_engine(lora="adapter", push_lora_base=False)
    served_base.update_weights(model, 5)  # no base push: the adapter only
    assert served_base.last_sync_check_max_abs_diff <= 1e-3
    assert served_base.last_sync_bytes == adapter_bytes
