"""A JSON-over-HTTP client on the standard library for a vLLM server, and the URL helpers around it.

No HTTP library and no vLLM: a trainer host that only talks to a remote server needs neither.
:meth:`HTTPClient.stream` reads a streamed answer (server-sent events) and can be cut short from
another thread through a :class:`StreamInterrupt` (partial rollouts).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from lightning_offpolicy.rollout.vllm.errors import DEV_MODE_HINT, SERVE_HINT

__all__ = [
    "CONNECT_TIMEOUT_S",
    "HTTPClient",
    "HTTPStatusError",
    "StreamInterrupt",
    "host_for_url",
    "is_loopback",
    "parse_base_url",
]

#: Default longest wait for a TCP connection, and for the first answers of a server at connect time
#: (``RemoteVLLMEngine``'s ``connection.connect_timeout_s``): a server that does not accept within it is down or
#: unreachable, one that accepts but does not answer ``/v1/models`` / ``/server_info`` within it is
#: hung. The first ``/server_info`` collects the server's environment, which takes seconds on a
#: loaded machine (docs/remote_vllm.md has the figures); the default leaves room for a busier one
#: and is still far shorter than the default ``request_timeout_s``.
CONNECT_TIMEOUT_S = 30.0

#: Most bytes one read of a streamed answer takes (vLLM sends one chunk of some hundred bytes per event).
_READ_SIZE = 1 << 16


class HTTPStatusError(RuntimeError):
    """The server answered with an HTTP error status (the message includes the server's own)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class StreamInterrupt:
    """A one-shot signal that cuts :meth:`HTTPClient.stream` calls short, from any thread.

    :meth:`set` shuts down the socket of every stream reading under it, so a thread blocked on
    one wakes at once, and a stream that starts afterwards returns before sending its request.
    Shutting the socket down also tells the server the client has gone: vLLM aborts the request.
    :meth:`HTTPClient.close` is one too, over every request of its client.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._sockets: set[socket.socket] = set()

    def set(self) -> None:
        """Cut every stream under this signal short, now and from now on (thread-safe, returns at once)."""
        with self._lock:
            self._set = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)

    def is_set(self) -> bool:
        return self._set

    def _attach(self, sock: socket.socket) -> bool:
        """Watch ``sock``; ``False`` (not watched) when the signal is already set."""
        with self._lock:
            if self._set:
                return False
            self._sockets.add(sock)
            return True

    def _detach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)


class HTTPClient:
    """A JSON-over-HTTP client on ``http.client``: one connection per request, every error a ``RuntimeError``.

    A connection per request (no keep-alive pool): the server closes idle connections after 5 s,
    longer than a training step, and a fresh loopback / LAN connection costs well under a
    millisecond next to a generation. :meth:`close` shuts the sockets of requests in flight so
    a thread blocked on one wakes at once.
    """

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        prefix: str,
        api_key: str | None,
        base_url: str,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.scheme, self.host, self.port, self.prefix = scheme, host, port, prefix
        self.connect_timeout_s = connect_timeout_s
        self.api_key = api_key
        self.base_url = base_url
        # Watches the sockets of the requests in flight (taken right after connect: http.client drops
        # ``conn.sock`` when an answer says "Connection: close", while the answer is still read from it).
        self._closing = StreamInterrupt()

    def close(self) -> None:
        self._closing.set()

    @property
    def _closed(self) -> bool:
        return self._closing.is_set()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float,
        what: str,
        timeout_setting: str = "request_timeout_s",
        text: bool = False,
    ) -> Any:
        """Send ``body`` as JSON, return the parsed JSON answer (``None`` for an empty one).

        ``timeout`` bounds the connection (at most ``connect_timeout_s``) and then the answer;
        ``timeout_setting`` is the setting that gave it, named when it passes. ``text``: the
        answer is plain text (vLLM's adapter routes), returned as a ``str``.
        """
        conn, sock = self._open(timeout, what)
        try:
            try:
                response = self._send(conn, method, path, body, accept="application/json")
                raw = response.read()
            except TimeoutError as err:
                raise self._timed_out(what, timeout, timeout_setting) from err
            except (http.client.HTTPException, ConnectionError, OSError) as err:
                raise self._dropped(what, err) from err
        finally:
            self._release(conn, sock)
        self._check_status(response.status, raw, path, what)
        if text:
            return raw.decode("utf-8", errors="replace")
        if not raw.strip():
            return None
        return self._json(raw, path, what)

    def stream(
        self,
        path: str,
        body: dict[str, Any],
        *,
        timeout: float,
        what: str,
        on_event: Callable[[Any], None],
        interrupt: StreamInterrupt,
    ) -> bool:
        """POST ``body`` as JSON and hand each event of the answer to ``on_event`` as it comes, interruptibly.

        A streamed answer (``"stream": true`` in ``body``) is read as server-sent events
        (``data: {...}`` lines, ``data: [DONE]`` last); one JSON document (a request that does not
        stream, or a server that ignored ``stream``) is read whole and is the one event.
        ``timeout`` bounds the whole answer, not each read.

        Returns ``True`` when the answer was read to its end, ``False`` when ``interrupt`` cut it
        short (before the request was sent, or while reading: the events seen so far were handed
        on, and the connection is closed, which makes vLLM abort the request).

        Raises:
            RuntimeError: As :meth:`request` (the server unreachable or gone, ``timeout`` passed, an
                HTTP error status, :meth:`close` called), or the server reported an error mid-stream.
        """
        deadline = time.monotonic() + timeout
        conn, sock = self._open(timeout, what)
        status, raw, finished = 0, b"", False
        try:
            if not interrupt._attach(sock):
                return False  # interrupted before anything was sent: nothing was generated
            accept = "text/event-stream" if body.get("stream") else "application/json"
            response = self._send(conn, "POST", path, body, accept=accept)
            status = response.status
            if status >= 400:
                raw = response.read()
            elif (response.getheader("Content-Type") or "").startswith("text/event-stream"):
                finished = self._read_events(sock, response, deadline, on_event, interrupt, path, what)
            else:  # one JSON document (a server or proxy that does not stream)
                _set_timeout(sock, deadline)
                document = response.read()
                # A read the interrupt cut short leaves a truncated document, which never parses.
                if not interrupt.is_set() or _parses(document):
                    on_event(self._json(document, path, what))
                    finished = True
        except TimeoutError as err:
            if not interrupt.is_set():
                raise self._timed_out(what, timeout) from err
        except (http.client.HTTPException, ConnectionError, OSError) as err:
            # The interrupt's socket shutdown surfaces as one of these (or as the end of the answer).
            if self._closed or not interrupt.is_set():
                raise self._dropped(what, err) from err
        finally:
            interrupt._detach(sock)
            self._release(conn, sock)
        if status >= 400:
            self._check_status(status, raw, path, what)
        if finished:
            return True
        if self._closed:
            raise RuntimeError(f"RemoteVLLMEngine was closed during {what}.")
        if interrupt.is_set():
            return False
        raise RuntimeError(
            f"RemoteVLLMEngine: the streamed answer of {self.base_url}{path} to {what} ended before its last event "
            "(data: [DONE]): did the server crash or restart? Check its log."
        )

    # ------------------------------------------------------------------ internals

    def _open(self, timeout: float, what: str) -> tuple[http.client.HTTPConnection, socket.socket]:
        """A connection to the server (and its socket, registered for :meth:`close`), request deadline set."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        connect_s = min(self.connect_timeout_s, timeout)
        conn = cls(self.host, self.port, timeout=connect_s)
        if self._closed:
            raise RuntimeError(f"RemoteVLLMEngine was closed before {what}.")
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
                f"{_setting(connect_s, self.connect_timeout_s, timeout)} during {what}: check the address, the "
                "network and any firewall between this machine and the server."
            ) from err
        except OSError as err:  # unknown host, no route, ...
            raise RuntimeError(
                f"RemoteVLLMEngine: cannot connect to the vLLM server at {self.base_url} during {what} ({err}): "
                "check the host name / address in base_url."
            ) from err
        sock = conn.sock
        # Checked and registered at once: either close() sees this socket, or we see close().
        if not self._closing._attach(sock):
            conn.close()
            raise RuntimeError(f"RemoteVLLMEngine was closed during {what}.")
        sock.settimeout(timeout)
        return conn, sock

    def _release(self, conn: http.client.HTTPConnection, sock: socket.socket) -> None:
        self._closing._detach(sock)
        conn.close()
        sock.close()  # conn.close() leaves it to the answer when it said "Connection: close"

    def _send(
        self, conn: http.client.HTTPConnection, method: str, path: str, body: Any, accept: str
    ) -> http.client.HTTPResponse:
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn.request(method, self.prefix + path, body=data, headers=headers)
        return conn.getresponse()

    def _read_events(
        self,
        sock: socket.socket,
        response: http.client.HTTPResponse,
        deadline: float,
        on_event: Callable[[Any], None],
        interrupt: StreamInterrupt,
        path: str,
        what: str,
    ) -> bool:
        """Hand each ``data:`` event of a server-sent-event answer to ``on_event``; ``True`` at ``[DONE]``,
        ``False`` when the answer ends before it or ``interrupt`` is set."""
        pending = b""
        while True:
            _set_timeout(sock, deadline)  # the deadline of the whole stream, not of each read
            data = response.read1(_READ_SIZE)
            # After the interrupt's shutdown Linux still hands out what had arrived, and the server
            # sends more until it notices the disconnect: stop here rather than read on.
            if not data or interrupt.is_set():
                return False
            # Only complete lines are read: the tail of an answer cut short is dropped, not misread.
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):  # blank separators, comments, other fields
                    continue
                payload = line[len(b"data:") :].strip()
                if payload == b"[DONE]":
                    return True
                event = self._json(payload, path, what)
                # vLLM reports a request it rejects or fails once streaming has begun (HTTP 200 sent) so.
                if isinstance(event, dict) and "error" in event:
                    raise RuntimeError(
                        f"RemoteVLLMEngine: {what} failed: the vLLM server at {self.base_url} reported an error in "
                        f"its streamed answer: {error_message(payload)} (its log may say more)."
                    )
                on_event(event)

    def _json(self, raw: bytes, path: str, what: str) -> Any:
        try:
            return json.loads(raw)
        except ValueError as err:
            raise RuntimeError(
                f"RemoteVLLMEngine: {what}: the answer of {self.base_url}{path} is not JSON ({raw[:200]!r}): is "
                "base_url a vLLM server?"
            ) from err

    def _check_status(self, status: int, raw: bytes, path: str, what: str) -> None:
        if status < 400:
            return
        message = error_message(raw)
        hint = ""
        if status == 401:
            hint = " The server wants an API key: set RemoteVLLMEngine's connection.api_key (its --api-key)."
        elif status == 404 and not path.startswith("/v1"):
            hint = f" This endpoint needs dev mode: {DEV_MODE_HINT}."
        raise HTTPStatusError(
            f"RemoteVLLMEngine: {what} failed: the vLLM server at {self.base_url} answered HTTP {status} "
            f"{path.split('?')[0]}: {message}.{hint}",
            status,
        )

    def _timed_out(self, what: str, timeout: float, setting: str = "request_timeout_s") -> RuntimeError:
        if setting == "connect_timeout_s":
            return RuntimeError(
                f"RemoteVLLMEngine: {what}: the server at {self.base_url} accepted the connection but sent no answer "
                f"within connect_timeout_s={timeout:g} s: it is hung (or that port is not a vLLM server's). Check the "
                "server's log; raise RemoteVLLMEngine's connection.connect_timeout_s if it is only slow to answer."
            )
        return RuntimeError(
            f"RemoteVLLMEngine: {what} got no answer from {self.base_url} within request_timeout_s={timeout:g} s "
            "(server overloaded or hung? raise request_timeout_s if the work is legitimately that long)."
        )

    def _dropped(self, what: str, err: BaseException) -> RuntimeError:
        if self._closed:
            return RuntimeError(f"RemoteVLLMEngine was closed during {what}.")
        return RuntimeError(
            f"RemoteVLLMEngine: the vLLM server at {self.base_url} dropped the connection during {what} "
            f"({type(err).__name__}: {err}): did it crash or restart? Check its log."
        )


def _setting(seconds: float, connect_timeout_s: float, request_timeout_s: float) -> str:
    """``connect_timeout_s=30 s`` (or ``request_timeout_s=...``): the setting that bounded a wait of ``seconds``."""
    name = "connect_timeout_s" if connect_timeout_s <= request_timeout_s else "request_timeout_s"
    return f"{name}={seconds:g} s"


def _shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked on ``sock`` (and end the connection for the server); it may be closed already."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _parses(document: bytes) -> bool:
    try:
        json.loads(document)
    except ValueError:
        return False
    return True


def _set_timeout(sock: socket.socket, deadline: float) -> None:
    """Let the next read on ``sock`` block until ``deadline`` at most; ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


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
