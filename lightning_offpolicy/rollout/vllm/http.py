"""A JSON-over-HTTP client on the standard library for a vLLM server, and the URL helpers around it.

No HTTP library and no vLLM: a trainer host that only talks to a remote server needs neither.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from lightning_offpolicy.rollout.vllm.errors import DEV_MODE_HINT, SERVE_HINT

__all__ = ["CONNECT_TIMEOUT_S", "HTTPClient", "HTTPStatusError", "host_for_url", "is_loopback", "parse_base_url"]

#: Longest wait for a TCP connection (a server that does not accept within this is down or unreachable).
CONNECT_TIMEOUT_S = 10.0


class HTTPStatusError(RuntimeError):
    """The server answered with an HTTP error status (the message includes the server's own)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class HTTPClient:
    """A JSON-over-HTTP client on ``http.client``: one connection per request, every error a ``RuntimeError``.

    A connection per request (no keep-alive pool): the server closes idle connections after 5 s,
    longer than a training step, and a fresh loopback / LAN connection costs well under a
    millisecond next to a generation. :meth:`close` shuts the sockets of requests in flight so
    a thread blocked on one wakes at once.
    """

    def __init__(self, scheme: str, host: str, port: int, prefix: str, api_key: str | None, base_url: str) -> None:
        self.scheme, self.host, self.port, self.prefix = scheme, host, port, prefix
        self.api_key = api_key
        self.base_url = base_url
        self._active: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            active = list(self._active)
        for conn in active:
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def request(self, method: str, path: str, body: Any = None, *, timeout: float, what: str) -> Any:
        """Send ``body`` as JSON, return the parsed JSON answer (``None`` for an empty one)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=min(CONNECT_TIMEOUT_S, timeout))
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RemoteVLLMEngine was closed before {what}.")
            self._active.add(conn)
        try:
            try:
                conn.connect()
            except ConnectionRefusedError as err:
                raise RuntimeError(
                    f"RemoteVLLMEngine: cannot connect to the vLLM server at {self.base_url} (connection refused) "
                    f"during {what}: is it running, listening on that host and port (--host / --port), and reachable "
                    f"from this machine? Start it with: {SERVE_HINT}."
                ) from err
            except TimeoutError as err:
                raise RuntimeError(
                    f"RemoteVLLMEngine: no connection to the vLLM server at {self.base_url} within "
                    f"{min(CONNECT_TIMEOUT_S, timeout):g} s during {what}: check the address, the network and any "
                    "firewall between this machine and the server."
                ) from err
            except OSError as err:  # unknown host, no route, ...
                raise RuntimeError(
                    f"RemoteVLLMEngine: cannot connect to the vLLM server at {self.base_url} during {what} ({err}): "
                    "check the host name / address in base_url."
                ) from err
            if self._closed:  # close() ran while we connected: its socket shutdown may have missed us
                raise RuntimeError(f"RemoteVLLMEngine was closed during {what}.")
            conn.sock.settimeout(timeout)
            conn.request(method, self.prefix + path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except TimeoutError as err:
            raise RuntimeError(
                f"RemoteVLLMEngine: {what} got no answer from {self.base_url} within request_timeout_s={timeout:g} s "
                "(server overloaded or hung? raise request_timeout_s if the work is legitimately that long)."
            ) from err
        except (http.client.HTTPException, ConnectionError, OSError) as err:
            if self._closed:
                raise RuntimeError(f"RemoteVLLMEngine was closed during {what}.") from err
            raise RuntimeError(
                f"RemoteVLLMEngine: the vLLM server at {self.base_url} dropped the connection during {what} "
                f"({type(err).__name__}: {err}): did it crash or restart? Check its log."
            ) from err
        finally:
            with self._lock:
                self._active.discard(conn)
            conn.close()
        if response.status >= 400:
            message = error_message(raw)
            hint = ""
            if response.status == 401:
                hint = " The server wants an API key: pass RemoteVLLMEngine(api_key=...) (its --api-key)."
            elif response.status == 404 and not path.startswith("/v1"):
                hint = f" This endpoint needs dev mode: {DEV_MODE_HINT}."
            raise HTTPStatusError(
                f"RemoteVLLMEngine: {what} failed: the vLLM server at {self.base_url} answered HTTP {response.status} "
                f"{path.split('?')[0]}: {message}.{hint}",
                response.status,
            )
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as err:
            raise RuntimeError(
                f"RemoteVLLMEngine: {what}: the answer of {self.base_url}{path} is not JSON ({raw[:200]!r}): is "
                "base_url a vLLM server?"
            ) from err


def error_message(raw: bytes) -> str:
    """The server's own error message from an error body (vLLM: ``{"error": {"message": ...}}``)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:2000] or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:2000]
    return text[:2000]


def parse_base_url(base_url: Any) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path prefix)`` of a server URL; raises ``ValueError`` naming the setting."""
    if not isinstance(base_url, str) or not base_url.strip():
        raise ValueError(
            f"RemoteVLLMEngine.base_url={base_url!r} must be the server's URL, e.g. 'http://127.0.0.1:8000'."
        )
    try:
        parts = urlsplit(base_url.strip())
        port = parts.port
    except ValueError as err:
        raise ValueError(f"RemoteVLLMEngine.base_url={base_url!r} is not a valid URL ({err}).") from err
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"RemoteVLLMEngine.base_url={base_url!r} must look like 'http://HOST:PORT' (scheme http or https and a "
            "host), e.g. 'http://127.0.0.1:8000'."
        )
    if parts.query or parts.fragment:
        raise ValueError(f"RemoteVLLMEngine.base_url={base_url!r} must not have a query or fragment.")
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):  # the OpenAI clients' convention: the engine adds /v1 itself
        prefix = prefix[: -len("/v1")]
    default_port = 443 if parts.scheme == "https" else 80
    return parts.scheme, parts.hostname, port or default_port, prefix


def host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything
