"""Stepping vLLM's offline engine through streamed requests that an interrupt can cut short, for all calls."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_offpolicy.rollout.engine import INTERRUPTED
from lightning_offpolicy.rollout.vllm.base import RawSample

__all__ = ["SharedStepping"]

_T = TypeVar("_T")


class SharedStepping:
    """``llm.generate``'s loop over one ``LLMEngine``, shared by the ``generate`` calls in flight.

    Each call queues its requests; whichever call holds the engine adds the queued requests, steps it
    and hands every output to the call whose request it is, the others wait for their requests to
    finish (or for the engine to be free). Calls from several threads (episodes that go on alone)
    thus share the engine's continuous batching, and a call never waits for another's requests to
    end before its own are added; one call alone runs ``llm.generate``'s loop. ``add_request``,
    ``step`` and ``abort_request`` are only called by the thread that holds the engine.
    """

    def __init__(self) -> None:
        self._engine_lock = threading.Lock()
        self._state = threading.Condition()  # guards the tables below; notified after each step
        self._samples: dict[str, list[RawSample]] = {}  # request id -> its samples, while its call runs
        self._unfinished: set[str] = set()  # queued or in the engine
        self._in_engine: set[str] = set()
        self._to_add: list[tuple[str, list[int], Any, Any]] = []
        self._to_abort: list[str] = []
        self._ids = itertools.count(1)

    def run(
        self, engine: Any, prompts: list[list[int]], params: list[Any], lora: Any, interrupt: threading.Event
    ) -> list[list[RawSample]]:
        """Sample ``prompts`` on ``engine`` (``llm.llm_engine``), stepped here so that an interrupt can abort them.

        Args:
            engine: The ``LLMEngine`` to add the requests to and step.
            prompts: Token ids of each request's prompt.
            params: One ``SamplingParams`` per prompt (set to stream their outputs here).
            lora: The ``LoRARequest`` every request uses, or ``None``.
            interrupt: Set from another thread to cut the call short.

        Returns:
            Per prompt, its ``n`` samples.

        Requests stream their new tokens (``RequestOutputKind.DELTA``): when ``interrupt`` is set,
        this call's unfinished requests are aborted (at the next engine step) and their samples
        come back :data:`~lightning_offpolicy.rollout.engine.INTERRUPTED` with the tokens so far.
        """
        from vllm.sampling_params import RequestOutputKind

        n = params[0].n if params else 1
        top = bool(params) and bool(params[0].logprobs)
        mine: list[str] = []
        with self._state:
            for prompt, param in zip(prompts, params, strict=True):
                param.output_kind = RequestOutputKind.DELTA
                request_id = f"lo-{next(self._ids)}"
                self._samples[request_id] = [
                    RawSample([], [], INTERRUPTED, top_logprobs=[] if top else None) for _ in range(n)
                ]
                self._unfinished.add(request_id)
                self._to_add.append((request_id, prompt, param, lora))
                mine.append(request_id)
            samples = [self._samples[request_id] for request_id in mine]
        try:
            while self._going_on(mine, interrupt):
                if not self._engine_lock.acquire(blocking=False):
                    with self._state:  # another call steps: woken by its next step, or when it stops stepping
                        if self._going_on(mine, interrupt):
                            self._state.wait(0.1)
                    continue
                try:
                    self._step(engine)
                finally:
                    self._engine_lock.release()
                    with self._state:
                        self._state.notify_all()  # a waiting call may take the engine over
        finally:
            with self._state:
                self._cancel(mine)
            self._flush_aborts(engine)
        return samples

    def between_steps(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` while no call steps the engine (a ``collective_rpc`` must not interleave with a step)."""
        with self._engine_lock:
            return fn()

    def _flush_aborts(self, engine: Any) -> None:
        """Abort the given-up requests before the call returns (a weight sync may follow), unless the thread
        that steps the engine does it first (at its next step)."""
        while True:
            with self._state:
                if not self._to_abort:
                    return
            if self._engine_lock.acquire(timeout=0.05):
                try:
                    with self._state:
                        to_abort, self._to_abort = self._to_abort, []
                    if to_abort:
                        engine.abort_request(to_abort)
                finally:
                    self._engine_lock.release()
                return

    def _going_on(self, mine: list[str], interrupt: threading.Event) -> bool:
        """Whether some of the call's requests are unfinished and it was not interrupted."""
        with self._state:
            return not interrupt.is_set() and any(request_id in self._unfinished for request_id in mine)

    def _cancel(self, mine: list[str]) -> None:
        """Forget the call's requests (under ``_state``): queued ones are not added, running ones aborted."""
        queued = set(mine)
        self._to_add = [entry for entry in self._to_add if entry[0] not in queued]
        self._to_abort += [request_id for request_id in mine if request_id in self._in_engine]
        for request_id in mine:
            self._samples.pop(request_id, None)
            self._unfinished.discard(request_id)
            self._in_engine.discard(request_id)

    def _step(self, engine: Any) -> None:
        """Add the queued requests, abort the cancelled ones, and run one engine step (holding the engine)."""
        with self._state:
            to_add, self._to_add = self._to_add, []
            to_abort, self._to_abort = self._to_abort, []
            self._in_engine.update(entry[0] for entry in to_add)
        for request_id, prompt, param, lora in to_add:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, param, lora_request=lora)
        if to_abort:
            engine.abort_request(to_abort)
        with self._state:
            if not self._in_engine:  # nothing to step for (a step would wait for outputs that never come)
                return
        outputs = engine.step()
        with self._state:
            for output in outputs:
                if output.request_id not in self._samples:
                    continue  # a late output of a request its call gave up
                for piece in output.outputs:
                    _extend(self._samples[output.request_id][piece.index], piece)
                if output.finished:
                    self._unfinished.discard(output.request_id)
                    self._in_engine.discard(output.request_id)
            self._state.notify_all()


def _extend(sample: RawSample, piece: Any) -> None:
    """Append a streamed ``vllm.CompletionOutput`` (its new tokens) to ``sample``."""
    tokens = list(piece.token_ids)
    sample.token_ids += tokens
    if sample.logprobs is not None:
        if piece.logprobs is not None and len(piece.logprobs) == len(tokens):
            sample.logprobs += [float(piece.logprobs[t][tok].logprob) for t, tok in enumerate(tokens)]
            if sample.top_logprobs is not None:
                sample.top_logprobs += [
                    {int(token): float(entry.logprob) for token, entry in position.items()}
                    for position in piece.logprobs
                ]
        else:  # the shared checks report the missing logprobs
            sample.logprobs = None
    if piece.finish_reason is not None:
        sample.finish_reason, sample.stop_reason = piece.finish_reason, piece.stop_reason
