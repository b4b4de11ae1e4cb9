"""Session-scoped fixtures for the real-vLLM tests: one tiny checkpoint, one shared engine, one server.

Starting vLLM costs ~20-45 s on a 2-core CPU machine, so the tests share one in-process engine
and one ``vllm serve`` (tests/test_remote_vllm.py, tests/test_partial_remote.py). Tests that
change their weights restore them before they end; a test that closes one leaves its holder to
start a fresh one if a later test asks for it again.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine, vllm_available
from lightning_offpolicy.rollout.vllm.settings import StartSettings, WeightSyncSettings

#: The reason of :data:`requires_vllm` (tests/conftest.py groups the tests that carry it).
VLLM_MISSING = "vLLM is not installed"
requires_vllm = pytest.mark.skipif(not vllm_available(), reason=VLLM_MISSING)

#: Start settings of the vLLM tests' engines and servers (float32, as the trainer, so the residual is the engine's own);
#: the shared engine takes them but ``dtype`` (its default "auto" gives float32 from the float32 module).
#: ``max_model_len`` is left unset, as by default: the engine runs at the model's context (256 tokens).
ENGINE_START = StartSettings(dtype="float32", gpu_memory_utilization=0.3, kv_cache_space_gib=1)


def engine_arguments(**kwargs) -> dict:
    """``kwargs`` for a :class:`VLLMEngine`, its ``start`` / ``weight_sync`` given as dicts of their fields and built
    here into :class:`StartSettings` / :class:`WeightSyncSettings` (a bad field raises here, as the settings do)."""
    built = {"start": StartSettings, "weight_sync": WeightSyncSettings}
    return {name: built[name](**value) if name in built else value for name, value in kwargs.items()}


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny Llama warmed up on ``reverse``, saved as a checkpoint directory."""
    from lightning_offpolicy.demo.tiny import prepare_tiny_checkpoint

    return prepare_tiny_checkpoint("reverse", directory=tmp_path_factory.mktemp("vllm") / "tiny-reverse")


@pytest.fixture
def trainer_model(tiny_ckpt):
    """A fresh float32 transformers copy of the checkpoint (the trainer's side)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()


#: A test's report carries, under this name in its user properties, the seconds its setup spent starting a
#: resource shared by the session (an engine, a server): not the test's own time (tests/conftest.py).
SHARED_SETUP = "shared_fixture_setup_s"


def shared_from(holder: EngineHolder | ServerHolder, request: pytest.FixtureRequest):
    """``holder.get()``, its time recorded on the test as a shared start (it starts the engine or server
    only when there is none; otherwise it takes no time)."""
    started = time.perf_counter()
    shared = holder.get()
    request.node.user_properties.append((SHARED_SETUP, time.perf_counter() - started))
    return shared


class EngineHolder:
    """Hands out the shared engine; starts a new one if the previous was closed."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.engine: VLLMEngine | None = None

    def get(self) -> VLLMEngine:
        if self.engine is None or self.engine._closed or self.engine._failure is not None:
            from transformers import LlamaForCausalLM

            if self.engine is not None:
                why = "closed" if self.engine._closed else f"failed ({self.engine._failure})"
                warnings.warn(f"the shared vLLM engine was {why}: starting another", stacklevel=2)
                self.engine.close()
            # model=None: the engine starts from the trainer's module at the first update_weights. Its dtype
            # is left at the default ("auto"): it follows that float32 module (test_vllm_fit checks).
            start = dataclasses.replace(ENGINE_START, dtype="auto")
            self.engine = VLLMEngine(model=None, eos_token_id=2, start=start)
            trainer = LlamaForCausalLM.from_pretrained(str(self.model), dtype=torch.float32).eval()
            self.engine.update_weights(trainer, 0)
        # An interrupt a test sent after its last call ended would cut the next test's first call.
        self.engine._interrupt.clear()
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


@pytest.fixture(scope="session")
def vllm_engine_holder(tiny_ckpt):
    holder = EngineHolder(tiny_ckpt)
    yield holder
    holder.close()


@pytest.fixture
def vllm_engine(vllm_engine_holder, request) -> VLLMEngine:
    """The session's shared engine (eos id 2), started from the tiny checkpoint's float32 module (float32)."""
    return shared_from(vllm_engine_holder, request)


def alive(procs: list) -> list:
    """The ``psutil.Process`` objects of ``procs`` still running (zombies count as gone)."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


#: The shared server loads LoRA adapters at run time up to this rank (tests/test_remote_lora.py's adapters):
#: one server for the adapter tests and the others, whose base-model requests the LoRA layers leave as they are.
SERVER_MAX_LORA_RANK = 8


class ServerHolder:
    """Hands out the shared ``vllm serve`` (float32, the model's own context, runtime LoRA loading up to
    :data:`SERVER_MAX_LORA_RANK`); starts a new one if the previous was closed. At the end no process of any
    server it started may be left."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.server = None
        self.processes: list = []

    def get(self):
        from lightning_offpolicy.rollout.vllm import launch_local_server

        if self.server is None or not self.server.alive:
            if self.server is not None:  # a test closed it, or it died: say so (a restart costs ~25 s)
                warnings.warn(
                    f"the shared vLLM server is gone (exit status {self.server.process.poll()}): starting another",
                    stacklevel=2,
                )
            self.server = launch_local_server(
                self.model,
                start=ENGINE_START,
                enable_lora=True,
                max_lora_rank=SERVER_MAX_LORA_RANK,
                startup_timeout_s=600,
            )
            self.processes += self.server.processes()
            print(f"\nvLLM server started in {self.server.start_time_s:.1f} s at {self.server.base_url}")
        return self.server

    def close(self) -> list[str]:
        """Stop the server; the names of the processes of its servers still alive (none expected)."""
        if self.server is not None:
            self.server.close()
        return [p.name() for p in alive(self.processes)]


@pytest.fixture(scope="session")
def vllm_server_holder(tiny_ckpt):
    holder = ServerHolder(tiny_ckpt)
    yield holder
    left = holder.close()
    assert left == [], f"processes of the test vLLM server left running: {left}"


@pytest.fixture
def vllm_server(vllm_server_holder, request):
    """The session's shared ``vllm serve`` of the tiny checkpoint (float32, max_model_len 256, LoRA enabled)."""
    return shared_from(vllm_server_holder, request)


# ---------------------------------------------------------------------- shared references


def reverse_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompt id lists of the ``reverse`` task (character tokenizer, with bos)."""
    import random

    from lightning_offpolicy.data.tasks import get_task
    from lightning_offpolicy.data.tokenizers import CharTokenizer

    task, tok, rng = get_task("reverse"), CharTokenizer(), random.Random(seed)
    return [tok.encode(task.sample(rng)[0], add_bos=True) for _ in range(n)]


@torch.no_grad()
def teacher_forced_logprobs(model, prompts, completions, temperature: float) -> list[list[float]]:
    """The trainer's float32 logprobs of each completion, one unpadded row at a time (the reference)."""
    from lightning_offpolicy.logprobs import causal_lm_token_logprobs

    out = []
    for c in completions:
        if not c.token_ids:  # an interrupted completion that kept no token: nothing to score
            out.append([])
            continue
        prompt = prompts[c.prompt_index]
        ids = torch.tensor([prompt + c.token_ids])
        lp = causal_lm_token_logprobs(
            model, ids, torch.ones_like(ids), response_start=len(prompt), temperature=temperature
        )
        out.append(lp[0, : len(c.token_ids)].tolist())
    return out


def residuals(engine_lp: list[list[float]], trainer_lp: list[list[float]]) -> torch.Tensor:
    """|engine - trainer| per generated token, flattened."""
    return torch.tensor(
        [abs(a - b) for e, t in zip(engine_lp, trainer_lp, strict=True) for a, b in zip(e, t, strict=True)]
    )


def lose_syncs(patch: pytest.MonkeyPatch, engine) -> None:
    """Make ``engine``'s weight syncs silently not arrive (the peer bug the sync check catches).

    Whatever the transport: the file reload (``_reload_weights``) and the in-memory bucket load
    (``_load_bucket``, in-process engines) do nothing.
    """
    patch.setattr(engine, "_reload_weights", lambda *args, **kwargs: None)
    if hasattr(engine, "_load_bucket"):
        patch.setattr(engine, "_load_bucket", lambda *args, **kwargs: None)


# ---------------------------------------------------------------------- stand-in servers


class _StandIn:
    """A small HTTP server answering ``(method, path)`` from ``routes`` with ``(status, json)``; records requests."""

    def __init__(self, routes: dict[tuple[str, str], tuple[int, object]]) -> None:
        self.routes = routes
        self.requests: list[tuple[str, str, dict, object]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.split("?")[0]
                owner.requests.append((self.command, self.path, dict(self.headers), body))
                status, payload = owner.routes.get((self.command, path), (404, {"detail": "Not Found"}))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:  # quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in():
    """Start :class:`_StandIn` servers (``stand_in(routes)``); all closed at the end of the test."""
    servers: list[_StandIn] = []

    def make(routes):
        servers.append(_StandIn(routes))
        return servers[-1]

    yield make
    for s in servers:
        s.close()
