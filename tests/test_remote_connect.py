"""RemoteVLLMEngine against hung servers: connecting, and the connect-time answers, are bounded by
``connection.connect_timeout_s``, much shorter than ``request_timeout_s``. Real sockets, no vLLM."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from lightning_offpolicy.rollout import RemoteVLLMEngine
from lightning_offpolicy.rollout.vllm.http import CONNECT_TIMEOUT_S
from lightning_offpolicy.rollout.vllm.settings import ConnectionSettings


class SilentServer:
    """Accepts every connection and never reads or answers (a hung server)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


class HangsOnServerInfo:
    """Answers ``/v1/models`` as vLLM does, then never answers ``/server_info`` (until closed)."""

    def __init__(self) -> None:
        released = self.released = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.startswith("/server_info"):
                    released.wait(30)
                    return
                data = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 256}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def test_a_server_that_accepts_and_never_answers_is_reported_within_connect_timeout_s(silent):
    engine = RemoteVLLMEngine(
        f"http://127.0.0.1:{silent.port}", eos_token_id=2, connection=ConnectionSettings(connect_timeout_s=0.5)
    )
    assert engine.request_timeout_s == 600  # the default request allowance is not what bounds a connect
    started = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"connect \(/v1/models\): the server at http://127\.0\.0\.1:\d+ accepted the connection but sent no "
        r"answer within connect_timeout_s=0\.5 s: it is hung.*connection\.connect_timeout_s if it is only slow",
    ):
        engine.connect()
    assert time.monotonic() - started < 3
    assert silent.accepted  # it really did accept
    engine.close()


def test_a_tls_handshake_that_never_completes_is_bounded_by_connect_timeout_s(silent):
    engine = RemoteVLLMEngine(
        f"https://127.0.0.1:{silent.port}", eos_token_id=2, connection=ConnectionSettings(connect_timeout_s=0.5)
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no connection to the vLLM server at .* within connect_timeout_s=0\.5 s"):
        engine.connect()
    assert time.monotonic() - started < 3
    engine.close()


def test_the_server_info_answer_is_bounded_by_connect_timeout_s_too():
    server = HangsOnServerInfo()
    try:
        engine = RemoteVLLMEngine(server.base_url, eos_token_id=2, connection=ConnectionSettings(connect_timeout_s=0.5))
        started = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"connect \(/server_info\): .*no answer within connect_timeout_s=0\.5 s"
        ):
            engine.connect()
        assert time.monotonic() - started < 3
        engine.close()
    finally:
        server.close()


def test_connect_timeout_defaults_well_below_the_request_timeout_and_is_checked():
    engine = RemoteVLLMEngine("http://127.0.0.1:1", eos_token_id=2)
    assert engine.connect_timeout_s == CONNECT_TIMEOUT_S == 30.0
    assert engine.connect_timeout_s * 20 <= engine.request_timeout_s
    for bad in (0, -1.0, float("nan"), "10", True):
        with pytest.raises(ValueError, match=r"ConnectionSettings\.connect_timeout_s=.* must be > 0"):
            RemoteVLLMEngine("http://127.0.0.1:1", connection=ConnectionSettings(connect_timeout_s=bad))
