"""The requests of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`: one ``/v1/completions``
body per prompt (the sampling settings made explicit, the stop ids the engine's), sent at most
``max_concurrent_requests`` at a time, each streamed or not and cut short by an interrupt
(docs/remote_vllm.md, "What the engine guarantees")."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lightning_offpolicy.rollout.engine import SamplingConfig
from lightning_offpolicy.rollout.vllm.base import RawSample
from lightning_offpolicy.rollout.vllm.http import HTTPStatusError, StreamInterrupt
from lightning_offpolicy.rollout.vllm.kept_sets import KEPT_SET_KEY
from lightning_offpolicy.rollout.vllm.streamed import StreamedChoices

__all__ = ["RemoteRequests"]

_T = TypeVar("_T")


class RemoteRequests:
    """The request steps of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`.

    A mixin: it reads the engine's ``request_model``, ``stop_ids``, ``stream_interval``,
    ``max_concurrent_requests``, ``request_timeout_s``, ``_http``, ``_closed``, its sampling tags
    and top-logprob count (``VLLMEngineBase``) and ``_collective_rpc``, and keeps its thread pool in
    ``_pool`` (under ``_pool_lock``). Under top-k / top-p it starts and takes the workers' kept-set
    records (:mod:`~lightning_offpolicy.rollout.vllm.kept_sets`).
    """

    def _stream_completion(self, body: dict[str, Any], n: int, interrupt: StreamInterrupt) -> list[RawSample]:
        """The ``n`` samples of one ``/v1/completions`` request (streamed or not), the unfinished ones
        :data:`INTERRUPTED` when ``interrupt`` cut it short."""
        choices = StreamedChoices(n, top_logprobs=body["logprobs"] > 0)
        if not interrupt.is_set():  # once interrupted, the requests still queued are not sent
            complete = self._http.stream(
                "/v1/completions",
                body,
                timeout=self.request_timeout_s,
                what="generate",
                on_event=choices.add,
                interrupt=interrupt,
            )
            if complete:
                return choices.samples(interrupted=False)
        return choices.samples(interrupted=True)

    def _start_kept_set_records(self) -> bool:
        """Have the server's workers record the kept sets of top-k / top-p (the kit's receiver does;
        ``False`` for a server without it, whose top logprobs then show the kept sets)."""
        try:
            results = self._collective_rpc("lo_record_kept_sets", "the kept-set recorder's start")
        except HTTPStatusError:  # no such method: a server started without the kit's receiver
            return False
        return bool(results) and all(str(result) == "True" for result in results)

    def _take_kept_sets(self, tags: list[str]) -> dict[str, Any]:
        """What the server's first worker recorded for the requests tagged ``tags`` (forgotten there)."""
        # vLLM asks for the arguments of a /collective_rpc serialized as strings.
        results = self._collective_rpc("lo_take_kept_sets", "lo_take_kept_sets", args=[json.dumps(tags)])
        if not results or not isinstance(results[0], dict):
            raise RuntimeError(f"RemoteVLLMEngine: the server answered lo_take_kept_sets with {results!r}.")
        return results[0]

    def _completion_bodies(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int | None]
    ) -> tuple[list[dict[str, Any]], list[str] | None]:
        """The request of each prompt, and under a sampling mask the tags they carry (``None`` otherwise)."""
        tags = self._sampling_tags(sampling, len(prompts))
        streaming = self._streaming  # read once: an interrupt from another thread may turn it on meanwhile
        bodies = [
            self._completion_body(prompt, sampling, seed, streaming, None if tags is None else tags[i])
            for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))
        ]
        return bodies, tags

    def _completion_body(
        self, prompt: list[int], sampling: SamplingConfig, seed: int | None, streaming: bool, tag: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.request_model,
            "prompt": prompt,
            "n": sampling.samples_per_prompt,
            "max_tokens": sampling.max_new_tokens,
            **sampling.sampler_settings(),  # temperature 0 when greedy (vLLM's argmax); top_k 0: off
            # Neutral, explicitly: otherwise the server takes them from the checkpoint's
            # generation_config.json (unless started with --generation-config vllm), and a penalty
            # would change the distribution sampled from without the trainer knowing.
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            # The sampled token's logprob, and under a sampling mask the top ones that show the kept support.
            "logprobs": self._top_logprobs(sampling),
            # Stop on the engine's stop ids and only on them, as HFEngine / VLLMEngine: without
            # ignore_eos the server would decide the stop ids itself.
            "ignore_eos": True,
            "stop_token_ids": self.stop_ids,
            "return_token_ids": True,
            # Name the logprob tokens "token_id:N": no tokenizer needed (--skip-tokenizer-init).
            "return_tokens_as_token_ids": True,
            # Streamed (once interrupts are in use), so that an interrupt has the tokens sampled so far.
            "stream": streaming,
        }
        if streaming:
            body["stream_interval"] = self.stream_interval
        if seed is not None:
            body["seed"] = seed
        if tag is not None:  # under a sampling mask: the tag the workers record the kept sets under
            body["vllm_xargs"] = {KEPT_SET_KEY: tag}
        return body

    def _map(self, fn: Callable[[Any], _T], items: Sequence[Any]) -> list[_T]:
        """``fn`` over ``items``, at most ``max_concurrent_requests`` in flight; the first error cancels the rest."""
        if len(items) == 1:
            return [fn(items[0])]
        with self._pool_lock:  # close() may run in another thread: never use a pool it has shut down
            if self._closed:
                raise RuntimeError("RemoteVLLMEngine was closed during generate.")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_concurrent_requests, thread_name_prefix="RemoteVLLMEngine"
                )
            pool = self._pool
        futures: list[concurrent.futures.Future[_T]] = []
        try:
            for item in items:
                futures.append(pool.submit(fn, item))  # raises RuntimeError once close() shut the pool down
            # Each request ends within its own deadline, so waiting for them in turn cannot hang.
            return [f.result() for f in futures]
        except (concurrent.futures.CancelledError, RuntimeError) as err:
            for f in futures:
                f.cancel()
            if self._closed:  # close() from another thread cancelled the queue / shut the pool down
                raise RuntimeError("RemoteVLLMEngine was closed during generate.") from err
            raise
        except BaseException:
            for f in futures:
                f.cancel()
            raise
