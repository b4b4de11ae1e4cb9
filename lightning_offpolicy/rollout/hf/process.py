"""The embedded engine in its own process: generation beside training without sharing an interpreter.

Why: with ``AsyncSettings(max_staleness >= 1)`` an in-process :class:`~lightning_offpolicy.rollout.HFEngine`
generates in the producer thread while the trainer trains in the main thread. Both run Python between
their kernels and take turns on the GIL: on a small model each side runs ~10-40% slower beside the
other than alone (docs/reports/performance_async.md). :class:`HFProcessEngine` runs the same sampling loop in
a child process with its own interpreter, so the two sides only share the cores.

How: the engine keeps its own copy of the policy (as ``HFEngine(dtype=...)`` does) in shared memory.
The child gets that module once, at the first push, and its parameters are the same memory. A later
push is one in-place ``load_state_dict`` from the trainer's module (no serialization, no transfer);
the child reads the new weights at its next request. A request sends the prompt ids and the sampling
settings through a pipe and gets the completions back. The ``RolloutCallback`` never pushes while a
request is in flight (the producer's engine lock), so a generation never sees half-updated weights.
:meth:`~HFEngine.interrupt` sets a multiprocessing event the child checks before each forward pass:
with partial rollouts a push cuts the request in flight short instead of waiting for it.

The child is started with ``spawn`` (forking a process that runs threads is unsafe): like vLLM's
engine processes, it re-imports the main script, which needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch

from lightning_offpolicy.rollout.engine import Completion, SamplingConfig, checked_prompts
from lightning_offpolicy.rollout.hf.engine import HFEngine, check_shareable

#: What the error says when the child process could not start or died.
MAIN_GUARD_HINT = (
    "The engine process is started with `spawn`, which re-imports the main script: put the code that "
    'creates and uses the engine under `if __name__ == "__main__":`. A model class defined in the main '
    "script must be importable from a module instead."
)


class HFProcessEngine(HFEngine):
    """An :class:`~lightning_offpolicy.rollout.HFEngine` whose generation runs in a child process.

    Same sampling, same completions for the same seed and weights as ``HFEngine(dtype=...)``: the
    child runs ``HFEngine``'s own loop on the engine's copy of the weights, which lives in shared
    memory. Use it for asynchronous rollouts (``AsyncSettings(max_staleness >= 1)``) on a machine
    with a core to spare; synchronously it only adds the round trip of each request.

    Args:
        dtype: Precision of the engine's copy of the weights; ``None``: the trainer's dtype (the
            engine always keeps a copy: the child cannot use the trainer's own parameters).
        max_batch_size: Most sequences per ``generate`` call (0: all at once).
        pad_token_id: Padding id; ``None``: set by the ``RolloutCallback`` from the module's tokenizer.
        eos_token_id: Stop token id; ``None``: from the module's tokenizer.
        stop_token_ids: More ids that end a completion (see :class:`HFEngine`).
        start_timeout_s: Seconds the first push waits for the child process to start.
        request_timeout_s: Seconds a ``generate`` call waits for its answer (``None``: no limit).
    """

    def __init__(
        self,
        dtype: Literal["bfloat16", "float16", "float32"] | None = None,
        max_batch_size: int = 0,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        start_timeout_s: float = 300.0,
        request_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            dtype=dtype,
            max_batch_size=max_batch_size,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            stop_token_ids=stop_token_ids,
        )
        for name, value in (("start_timeout_s", start_timeout_s), ("request_timeout_s", request_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"HFProcessEngine.{name}={value!r} must be > 0.")
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self._process: Any = None
        self._conn: Connection | None = None

    @property
    def share_weights(self) -> bool:
        return False  # always a copy, in shared memory

    @property
    def process(self) -> Any:
        """The child process (``None`` before the first push and after :meth:`close`)."""
        return self._process

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        if isinstance(source, torch.nn.Module) and self.model is None:
            check_shareable(source, "HFProcessEngine", copies=True)
            model = copy.deepcopy(source).requires_grad_(False)
            if self.dtype is not None:
                model = model.to(getattr(torch, self.dtype))
            self.model = model.share_memory()
            self._start()
        elif self.model is None:
            raise ValueError("HFProcessEngine.update_weights got a state dict before any model; pass the module first.")
        else:  # in place: the child's parameters are these tensors
            state = source.state_dict() if isinstance(source, torch.nn.Module) else dict(source)
            self.model.load_state_dict(state)
        self.version = version

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        if self.model is None or self._conn is None:
            raise RuntimeError("HFProcessEngine has no weights yet: call update_weights(module, version) first.")
        if self.pad_token_id is None or self.eos_token_id is None:
            raise RuntimeError("HFProcessEngine needs pad_token_id and eos_token_id (or set_special_tokens(...)).")
        prompt_ids = checked_prompts(prompt_ids, "HFProcessEngine.generate")
        request = (prompt_ids, sampling, seed, self.version, self.pad_token_id, self.eos_token_id, self.stop_ids)
        return self._ask(("generate", request))

    def close(self) -> None:
        conn, process = self._conn, self._process
        self._conn = self._process = None
        self.model = None
        if conn is not None:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            conn.close()
        if process is not None:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    # ------------------------------------------------------------------------------ the child process
    def _start(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        interrupt = context.Event()
        process = context.Process(
            target=_serve,
            args=(child, self.model, self.max_batch_size, torch.get_num_threads(), interrupt),
            name="HFProcessEngine",
            daemon=True,
        )
        try:
            process.start()
        except Exception as err:
            raise RuntimeError(f"HFProcessEngine: the engine process did not start: {err}. {MAIN_GUARD_HINT}") from err
        child.close()
        self._process, self._conn, self._interrupt = process, parent, interrupt
        self._receive(self.start_timeout_s, "start")

    def _ask(self, message: tuple[str, Any]) -> Any:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError) as err:
            raise self._died("a request") from err
        return self._receive(self.request_timeout_s, "a request")

    def _receive(self, timeout: float | None, during: str) -> Any:
        if not self._conn.poll(timeout):
            raise RuntimeError(
                f"HFProcessEngine: no answer from the engine process within {timeout} s during {during} "
                "(raise start_timeout_s / request_timeout_s if it is only slow)."
            )
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as err:
            raise self._died(during) from err
        if status == "error":
            raise RuntimeError(f"HFProcessEngine: the engine process failed: {payload}")
        return payload

    def _died(self, during: str) -> RuntimeError:
        process = self._process
        if process is not None:
            process.join(timeout=5)
        code = None if process is None else process.exitcode
        return RuntimeError(
            f"HFProcessEngine: the engine process exited (code {code}) during {during}. {MAIN_GUARD_HINT}"
        )


def _serve(conn: Connection, model: torch.nn.Module, max_batch_size: int, threads: int, interrupt: Any) -> None:
    """The child: answer generation requests with ``HFEngine``'s loop on the shared-memory ``model``."""
    torch.set_num_threads(threads)
    engine = HFEngine(max_batch_size=max_batch_size)
    engine.model = model  # dtype None: the engine uses the module as it is (its memory is the parent's copy)
    engine._interrupt = interrupt  # the parent's interrupt() sets it; each generate call consumes it
    conn.send(("ok", None))
    while True:
        try:
            kind, request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if kind == "close":
            return
        try:
            prompts, sampling, seed, version, pad, eos, stop = request
            engine.pad_token_id, engine.eos_token_id, engine.stop_token_ids = pad, eos, stop
            engine.version = version
            answer: tuple[str, Any] = ("ok", engine.generate(prompts, sampling, seed))
        except Exception as err:  # noqa: BLE001 - reported to the parent, which raises
            answer = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}")
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):  # the parent closed the engine while this request ran
            return
