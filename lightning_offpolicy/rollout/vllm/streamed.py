"""The samples of one streamed ``/v1/completions`` answer, put together event by event.

Used by :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`: a streamed answer
(server-sent events) lets an interrupt keep the tokens received so far; an unstreamed answer reads
as a single event.
"""

from __future__ import annotations

from typing import Any

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.rollout.engine import INTERRUPTED
from lightning_offpolicy.rollout.vllm.base import RawSample

__all__ = ["StreamedChoices"]

_NO_TOKEN_IDS = "RemoteVLLMEngine: the server returned no token ids (it needs `return_token_ids`: vLLM >= 0.10)."


class StreamedChoices:
    """The ``n`` samples of one ``/v1/completions`` request, put together from the events of its streamed answer.

    Each event's ``choices`` hold, per sample (``index``), the tokens of that chunk
    (``token_ids``), their logprobs (``logprobs.token_logprobs``), with ``top_logprobs`` the top
    tokens' logprobs (``logprobs.top_logprobs``: ``{"token_id:N": logprob}`` per token, ``-inf`` sent
    as -9999.0) and, in the sample's last chunk, its ``finish_reason``. A whole (unstreamed) answer
    reads as one event.
    """

    def __init__(self, n: int, top_logprobs: bool = False) -> None:
        self.n = n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float | None]] = [[] for _ in range(n)]
        self.top: list[list[dict[int, float]]] | None = [[] for _ in range(n)] if top_logprobs else None
        self.finish_reasons: list[Any] = [None] * n
        self.stop_reasons: list[Any] = [None] * n
        self.seen = [False] * n

    def add(self, event: Any) -> None:
        choices = event.get("choices") if isinstance(event, dict) else None
        if not isinstance(choices, list):
            raise RuntimeError(
                f"RemoteVLLMEngine: an answer of the server to generate has no choices ({str(event)[:200]}): is "
                "base_url a vLLM server?"
            )
        for choice in choices:
            index = choice.get("index", 0) if isinstance(choice, dict) else None
            if not is_int(index) or not 0 <= index < self.n:
                raise RuntimeError(
                    f"RemoteVLLMEngine: the server answered for sample {index!r} of a request for {self.n} samples."
                )
            tokens = choice.get("token_ids")
            if not isinstance(tokens, list):
                raise RuntimeError(_NO_TOKEN_IDS)
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
                logprobs = [None] * len(tokens)  # the shared answer checks name the missing logprobs
            self.seen[index] = True
            self.tokens[index] += tokens
            self.logprobs[index] += logprobs
            if self.top is not None:
                self.top[index] += _top_logprobs(choice, len(tokens))
            reason = choice.get("finish_reason")
            if reason == INTERRUPTED:  # only this engine marks a sample interrupted, when its interrupt() cut it
                raise RuntimeError(
                    f"RemoteVLLMEngine: the server ended a sample with finish_reason={reason!r}; expected 'stop' "
                    "or 'length'."
                )
            if reason is not None:
                self.finish_reasons[index] = reason
                self.stop_reasons[index] = choice.get("stop_reason")

    def samples(self, interrupted: bool) -> list[RawSample]:
        """The samples as the shared checks read them: those without a finish reason
        :data:`INTERRUPTED` when the answer was cut short (an answer read to its end has one for each)."""
        if not interrupted and not all(self.seen):
            raise RuntimeError(
                f"RemoteVLLMEngine: the server answered for {sum(self.seen)} of the {self.n} samples of a request."
            )
        if any(
            reason is not None and not tokens for tokens, reason in zip(self.tokens, self.finish_reasons, strict=True)
        ):
            raise RuntimeError(_NO_TOKEN_IDS)  # max_tokens >= 1: a finished sample has at least one token
        tops = self.top if self.top is not None else [None] * self.n
        return [
            RawSample(
                tokens,
                logprobs,
                INTERRUPTED if reason is None and interrupted else reason,
                stop_reason,
                top_logprobs=top,
            )
            for tokens, logprobs, reason, stop_reason, top in zip(
                self.tokens, self.logprobs, self.finish_reasons, self.stop_reasons, tops, strict=True
            )
        ]


#: The OpenAI-compatible server sends a logprob of ``-inf`` as this (JSON has no infinity).
_SERVER_NEG_INF = -9999.0


def _top_logprobs(choice: dict[str, Any], count: int) -> list[dict[int, float]]:
    """The chunk's ``top_logprobs`` as ``{token id: logprob}`` per token (``-inf`` restored)."""
    top = (choice.get("logprobs") or {}).get("top_logprobs")
    if not isinstance(top, list) or len(top) != count:
        raise RuntimeError(
            "RemoteVLLMEngine: the server returned no top logprobs for some generated tokens (the sampling mask "
            "of top-k / top-p needs them: logprobs=N in the request)."
        )
    out = []
    for position in top:
        entries = {}
        for name, logprob in (position or {}).items():
            if not (isinstance(name, str) and name.startswith("token_id:")):
                raise RuntimeError(
                    f"RemoteVLLMEngine: a top logprob is keyed {name!r}, not 'token_id:N' (the request sets "
                    "return_tokens_as_token_ids)."
                )
            value = float(logprob)
            entries[int(name.split(":", 1)[1])] = float("-inf") if value <= _SERVER_NEG_INF else value
        out.append(entries)
    return out
