"""Stepping vLLM's offline engine through streamed requests that an interrupt can cut short."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lightning_offpolicy.rollout.engine import INTERRUPTED
from lightning_offpolicy.rollout.vllm.base import RawSample

__all__ = ["run_requests"]


def run_requests(
    engine: Any,
    prompts: list[list[int]],
    params: list[Any],
    lora: Any,
    interrupt: threading.Event,
    new_request_id: Callable[[], str],
) -> list[list[RawSample]]:
    """``llm.generate``'s loop over ``engine`` (``llm.llm_engine``), stepped here so that an interrupt can abort it.

    Args:
        engine: The ``LLMEngine`` to add the requests to and step.
        prompts: Token ids of each request's prompt.
        params: One ``SamplingParams`` per prompt (set to stream their outputs here).
        lora: The ``LoRARequest`` every request uses, or ``None``.
        interrupt: Set from another thread to cut the call short.
        new_request_id: Returns a request id not used before on this engine.

    Returns:
        Per prompt, its ``n`` samples.

    Requests stream their new tokens (``RequestOutputKind.DELTA``): when ``interrupt`` is
    set, the unfinished requests are aborted between two engine steps and their samples come
    back :data:`~lightning_offpolicy.rollout.engine.INTERRUPTED` with the tokens so far.
    """
    from vllm.sampling_params import RequestOutputKind

    request_ids = []
    for prompt, param in zip(prompts, params, strict=True):
        param.output_kind = RequestOutputKind.DELTA
        request_id = new_request_id()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, param, lora_request=lora)
        request_ids.append(request_id)
    n = params[0].n if params else 1
    top = bool(params) and bool(params[0].logprobs)
    samples = {
        rid: [RawSample([], [], INTERRUPTED, top_logprobs=[] if top else None) for _ in range(n)] for rid in request_ids
    }
    unfinished = set(request_ids)
    while unfinished:
        if interrupt.is_set():
            engine.abort_request(sorted(unfinished))
            break
        for output in engine.step():
            if output.request_id not in samples:
                continue  # a late output of a request aborted by an earlier call
            for piece in output.outputs:
                _extend(samples[output.request_id][piece.index], piece)
            if output.finished:
                unfinished.discard(output.request_id)
    return [samples[rid] for rid in request_ids]


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
