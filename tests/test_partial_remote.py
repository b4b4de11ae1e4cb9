"""Partial rollouts on RemoteVLLMEngine: ``interrupt()`` cuts a streamed generate short, the server aborts.

Against a real vLLM server (``launch_local_server``, the session's shared one, float32, as in
tests/test_remote_vllm.py) and, for the stream protocol's edge cases, a small stand-in server
that streams server-sent events. References: an uninterrupted call with the same seed, the
trainer's float32 teacher-forced logprobs under each weight set, and the server's own
Prometheus counters (/metrics) for whether it stopped generating after the disconnect.
Measured numbers are printed (``pytest -s``). About 2-4 minutes on a 2-core CPU machine.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.rollout.engine import INTERRUPTED, InterruptibleEngine, SamplingConfig
from lightning_offpolicy.rollout.partial import PartialStats, generate_resumable
from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine
from lightning_offpolicy.rollout.vllm.settings import ConnectionSettings, RemoteWeightSyncSettings
from lightning_offpolicy.rollout.vllm.streamed import StreamedChoices
from tests.module_helpers import perturbed
from tests.vllm_fixtures import requires_vllm, residuals, reverse_prompts, teacher_forced_logprobs

#: Largest |server - trainer| per-token logprob residual accepted at equal float32 weights (as test_remote_vllm).
LOGPROB_MAX_TOL = 1e-4
#: The stop id: one the tiny checkpoint (and the perturbed copy of the segments test) rarely
#: samples at TEMPERATURE, so that nearly every completion runs to max_new_tokens unless
#: interrupted. No id is never sampled: past its answer the model wanders, and at temperature 1
#: every one of its 64 ids turns up in 240-token completions. At 0.5 this one did not in 61 440
#: tokens sampled by the server nor in 92 160 sampled by each model with transformers, but a
#: test run sees it now and then; the tests accept the rare completion that stops on it (a
#: finished completion must keep "stop" through an interrupt anyway).
RARE_STOP = 58
TEMPERATURE = 0.5
#: Longest completions the module's server takes (its max_model_len is the model's 256, prompts ~12 tokens).
LONG = 240


# ---------------------------------------------------------------------- helpers


def _metrics(base_url: str) -> dict[str, float]:
    """The server's request gauges and generated-token counter (its Prometheus text on /metrics)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    out = {"in_flight": 0.0, "generated": 0.0}
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            out["in_flight"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:generation_tokens_total"):
            out["generated"] += float(line.rsplit(" ", 1)[1])
    return out


def _settled(base_url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """The server's metrics once no request is running or waiting (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (m := _metrics(base_url))["in_flight"] > 0:
        assert time.monotonic() < deadline, f"the server still has {m['in_flight']} requests after {timeout_s} s"
        time.sleep(0.05)
    return m


def _ran_to_the_end(c) -> bool:
    """Ran to max_new_tokens, or (rarely) stopped on the stop id."""
    return (c.finish_reason, len(c.token_ids)) == ("length", LONG) or (
        c.finish_reason == "stop" and c.token_ids[-1] == RARE_STOP and len(c.token_ids) <= LONG
    )


class InterruptAfterTokens:
    """Calls ``engine.interrupt()`` once the call in flight has received ``tokens`` streamed tokens (summed
    over its requests), from the thread that read the last of them: the interrupt surely lands inside the
    call, at a known point of it (no clock, no polling of the server). Records when, how many tokens had
    come, what each sample had by then (its tokens, and its finish reason if it had ended) and, with
    ``base_url``, the server's generated-token counter read right after the interrupt.

    Not "and a token of every sample": the requests are sent a little apart and, on a loaded machine, the
    server streams them far apart (the last one's first token can come after most others have ended).

    Installed on :class:`StreamedChoices` with ``monkeypatch``; fires once.
    """

    def __init__(
        self, engine: RemoteVLLMEngine, monkeypatch: pytest.MonkeyPatch, tokens: int, base_url: str | None = None
    ) -> None:
        self.at: float | None = None
        self.received = 0  # tokens received when the interrupt was sent
        self.had: list[tuple[str | None, list[int]]] = []  # (finish reason or None, tokens) of each sample then
        self.server_generated: float | None = None  # the server's counter right after the interrupt
        lock, add = threading.Lock(), StreamedChoices.add
        answers: list[StreamedChoices] = []  # the requests that have answered

        def counting_add(choices: StreamedChoices, event) -> None:
            add(choices, event)
            with lock:
                if self.at is not None:
                    return
                if not any(a is choices for a in answers):
                    answers.append(choices)
                received = sum(len(t) for a in answers for t in a.tokens)
                if received >= tokens:
                    self.at, self.received = time.perf_counter(), received
                    self.had = [
                        (reason, list(sample))
                        for a in answers
                        for sample, reason in zip(a.tokens, a.finish_reasons, strict=True)
                    ]
                    engine.interrupt()
                    if base_url is not None:
                        self.server_generated = _metrics(base_url)["generated"]

        monkeypatch.setattr(StreamedChoices, "add", counting_add)

    @property
    def ended(self) -> list[tuple[str, list[int]]]:
        """The samples that had ended when the interrupt was sent."""
        return [(reason, tokens) for reason, tokens in self.had if reason is not None]


class InterruptOnceSent:
    """Calls ``engine.interrupt()`` right after the first ``/v1/completions`` request of the next call is
    written to its socket, before its answer is read: for a request that does not stream (whose
    answer comes whole at its end). Installed on the engine's HTTP client with ``monkeypatch``."""

    def __init__(self, engine: RemoteVLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at: float | None = None
        send = engine._http._send

        def interrupting_send(conn, method, path, body, accept):
            if self.at is None and path.endswith("/v1/completions"):
                getresponse = conn.getresponse

                def interrupted_getresponse(*args, **kwargs):
                    self.at = time.perf_counter()
                    engine.interrupt()
                    return getresponse(*args, **kwargs)

                conn.getresponse = interrupted_getresponse
            return send(conn, method, path, body, accept)

        monkeypatch.setattr(engine._http, "_send", interrupting_send)


# ---------------------------------------------------------------------- the module's real server


@pytest.fixture
def server(vllm_server):
    """The session's shared vLLM server (tests/vllm_fixtures.py)."""
    return vllm_server


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("partial_weights")


def _engine(server, weights_dir: Path, stream: bool | None = None) -> RemoteVLLMEngine:
    return RemoteVLLMEngine(
        server.base_url,
        eos_token_id=RARE_STOP,
        stop_token_ids=[],
        request_timeout_s=300,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir)),
        connection=ConnectionSettings(stream=stream),
    )


@pytest.fixture
def engine(server, weights_dir):
    """An engine set up for partial rollouts: every request streams."""
    eng = _engine(server, weights_dir, stream=True)
    yield eng
    eng.close()


@requires_vllm
@pytest.mark.slow
def test_interrupt_returns_the_tokens_so_far_at_once_and_the_server_stops(engine, server, trainer_model, monkeypatch):
    """Test 1 and 2: a long call interrupted once a fifth of its tokens have arrived returns at once (it
    receives little of what remained), with the seeded draws so far and the trainer's logprobs; the server
    aborts (its own generated-token counter moves little after an interrupt)."""
    assert isinstance(engine, InterruptibleEngine)
    prompts = reverse_prompts(8, seed=1)
    long = SamplingConfig(max_new_tokens=LONG, temperature=TEMPERATURE, samples_per_prompt=8)
    engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)  # connect, warm up

    before = _settled(server.base_url)
    began = time.perf_counter()
    full = engine.generate(prompts, long, seed=3)
    full_s = time.perf_counter() - began
    full_tokens = _settled(server.base_url)["generated"] - before["generated"]
    assert all(_ran_to_the_end(c) for c in full)
    assert sum(c.finish_reason == "stop" for c in full) <= len(full) // 8
    assert full_tokens == sum(len(c.token_ids) for c in full)

    before = _settled(server.base_url)
    # Once a fifth of the tokens have come.
    trigger = InterruptAfterTokens(engine, monkeypatch, int(0.2 * full_tokens), server.base_url)
    began = time.perf_counter()
    cut = engine.generate(prompts, long, seed=3)
    ended = time.perf_counter()
    assert trigger.at is not None and trigger.server_generated is not None, "the call ended before the interrupt"
    latency_s = ended - trigger.at
    cut_tokens = _settled(server.base_url)["generated"] - before["generated"]
    at_interrupt = trigger.server_generated - before["generated"]
    received = sum(len(c.token_ids) for c in cut)
    print(
        f"\nfull call {full_s:.2f} s ({full_tokens:.0f} tokens); interrupted at {trigger.at - began:.2f} s with "
        f"{trigger.received} tokens received ({at_interrupt:.0f} generated), returned {1000 * latency_s:.1f} ms "
        f"later with {received} tokens; the server generated {cut_tokens:.0f}; ended before the interrupt: "
        f"{collections.Counter(reason for reason, _ in trigger.ended)}"
    )
    # "At once" in tokens, not seconds (the machine's load moves seconds): of what the call still had to receive
    # at the interrupt, it received well under half; a call that kept reading its streams would receive all of it.
    late = received - trigger.received
    assert late < 0.5 * (full_tokens - trigger.received), (late, full_tokens, trigger.received)
    for c, f in zip(cut, full, strict=True):
        assert len(c.logprobs) == len(c.token_ids) and c.policy_version == 0
        assert c.token_ids == f.token_ids[: len(c.token_ids)]  # the same seeded draws, cut short
        if c.finish_reason == INTERRUPTED:
            assert len(c.token_ids) < len(f.token_ids)
        else:  # it ended before the interrupt landed: the full call's, finish reason included ("stop", or
            # "length" when its request ran ahead of the others: they are sent a little apart)
            assert (c.finish_reason, c.token_ids) == (f.finish_reason, f.token_ids)
    # Each sample keeps every token it had received by the trigger (tokens on their way as the interrupt landed
    # may add to them), and one that had ended keeps its finish reason.
    unmatched = list(cut)
    for reason, tokens in sorted(trigger.had, key=lambda had: -len(had[1])):
        match = next(c for c in unmatched if c.token_ids[: len(tokens)] == tokens)
        assert reason is None or (match.finish_reason, match.token_ids) == (reason, tokens)
        unmatched.remove(match)
    # Of those still running at the trigger, only one whose last tokens were on their way as the interrupt
    # landed can end too.
    running = len(cut) - len(trigger.ended)
    assert running > 0 and sum(c.finish_reason == INTERRUPTED for c in cut) >= 0.8 * running
    # The logprobs of the partial tokens are those of the distribution sampled from (test 2).
    reference = teacher_forced_logprobs(trainer_model, prompts, cut, TEMPERATURE)
    res = residuals([c.logprobs for c in cut], reference)
    print(f"partial tokens: |server - trainer| logprob max {res.max():.3g} over {res.numel()} tokens")
    assert res.max() <= LOGPROB_MAX_TOL
    assert trigger.received <= received <= cut_tokens  # and none is left running (_settled)

    # The server aborts the requests when their connections close: of what a call still had to generate at
    # the interrupt, it generates well under half (a server that kept going generates all of it). Shown on a
    # call far longer than the server can finish while the client reads its first tokens: on a loaded
    # machine the client reads the streams seconds behind the server, which can have ended the call above.
    many = SamplingConfig(max_new_tokens=LONG, temperature=TEMPERATURE, samples_per_prompt=64)
    requested = len(prompts) * many.samples_per_prompt * LONG
    before = _settled(server.base_url)
    with monkeypatch.context() as patch:
        trigger = InterruptAfterTokens(engine, patch, 1, server.base_url)
        engine.generate(prompts, many, seed=4)
    assert trigger.server_generated is not None, "the call ended before the interrupt"
    generated = _settled(server.base_url)["generated"] - before["generated"]
    at_interrupt = trigger.server_generated - before["generated"]
    print(f"{requested} tokens asked for: {at_interrupt:.0f} generated at the interrupt, {generated:.0f} in all")
    assert generated - at_interrupt < 0.5 * (requested - at_interrupt), (generated, at_interrupt, requested)

    again = engine.generate(prompts[:2], SamplingConfig(max_new_tokens=16, temperature=TEMPERATURE), seed=3)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 16 for c in again)  # consumed


@requires_vllm
@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, None])
def test_an_interrupt_with_no_call_in_flight_cuts_the_next_call_only(server, weights_dir, stream):
    """Test 4: the next call returns at once, interrupted, without sending anything; the one after runs normally."""
    engine = _engine(server, weights_dir, stream=stream)
    prompts = reverse_prompts(4, seed=2)
    cfg = SamplingConfig(max_new_tokens=32, temperature=TEMPERATURE, samples_per_prompt=2)
    reference = engine.generate(prompts, cfg, seed=7)
    engine.interrupt()
    engine.interrupt()  # twice: still one interrupt, consumed by one call
    before = _settled(server.base_url)
    began = time.perf_counter()
    early = engine.generate(prompts, cfg, seed=7)
    early_s = time.perf_counter() - began
    assert [(c.prompt_index, c.finish_reason, c.token_ids, c.logprobs) for c in early] == [
        (i, INTERRUPTED, [], []) for i in range(4) for _ in range(2)
    ]
    assert early_s < 1.0 and _metrics(server.base_url)["generated"] == before["generated"]
    again = engine.generate(prompts, cfg, seed=7)
    assert [(c.token_ids, c.finish_reason) for c in again] == [(c.token_ids, c.finish_reason) for c in reference]
    assert engine._streaming  # stream=None: streaming since the interrupt, with the same draws
    engine.close()


@requires_vllm
@pytest.mark.slow
def test_by_default_requests_stream_from_the_first_interrupt_on(server, weights_dir, monkeypatch):
    """stream=None: the call the first interrupt cuts short did not stream, so its unfinished completions
    keep no tokens (and the server aborts it all the same); the calls after it stream and keep theirs: every
    token received before the interrupt, and any that came as it landed."""
    engine = _engine(server, weights_dir)
    prompts = reverse_prompts(8, seed=3)
    # More than the server can generate while the client reads its first tokens (on a loaded machine the client
    # reads the streams seconds behind the server): an interrupt always leaves most of the call to abort.
    cfg = SamplingConfig(max_new_tokens=LONG, temperature=TEMPERATURE, samples_per_prompt=32)
    engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)  # connect, warm up
    requested = len(prompts) * cfg.samples_per_prompt * LONG
    kept = []
    for streaming in (False, True):
        assert engine._streaming is streaming
        with monkeypatch.context() as patch:
            before = _settled(server.base_url)
            if streaming:  # interrupt once four samples' worth of tokens have streamed
                trigger = InterruptAfterTokens(engine, patch, 4 * LONG, server.base_url)
            else:  # an answer that does not stream comes whole at its end: interrupt once the request is sent
                trigger = InterruptOnceSent(engine, patch)
            cut = engine.generate(prompts, cfg, seed=3)
            assert trigger.at is not None, "the call ended before the interrupt"
        total = _settled(server.base_url)["generated"]
        # Aborted on the disconnect: of what the call still had to generate at the interrupt, the server
        # generated well under half (all of it when a server keeps going).
        at_interrupt = trigger.server_generated - before["generated"] if streaming else 0
        generated = total - before["generated"]
        assert generated - at_interrupt < 0.5 * (requested - at_interrupt), (generated, at_interrupt, requested)
        running = len(cut) - (len(trigger.ended) if streaming else 0)
        assert sum(c.finish_reason == INTERRUPTED for c in cut) >= 0.8 * running
        kept.append(sum(len(c.token_ids) for c in cut if c.finish_reason == INTERRUPTED))
    streamed = sum(len(c.token_ids) for c in cut)  # of the streaming call (a sample that stopped early keeps its own)
    assert kept[0] == 0 and streamed >= trigger.received >= 4 * LONG, (kept, streamed, trigger.received)
    engine.close()


@requires_vllm
@pytest.mark.slow
def test_a_continued_completion_has_the_version_and_logprobs_of_each_segment(
    engine, server, trainer_model, monkeypatch
):
    """Test 3: generate_resumable, an interrupt in the first call and a push to perturbed weights before the
    continuation: each token has the logprob and the version of the weights that sampled it."""
    new = perturbed(trainer_model, 0.05)
    prompts = reverse_prompts(8, seed=1)
    sampling = SamplingConfig(max_new_tokens=LONG, temperature=TEMPERATURE, samples_per_prompt=4)
    engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2), seed=0)  # connect
    engine.update_weights(trainer_model, 0)  # version 0: the checkpoint (and the engine learns the vocabulary)
    first_segments = []
    generate = engine.generate

    def spy(prompt_ids, cfg, seed=None):
        out = generate(prompt_ids, cfg, seed=seed)
        if not first_segments:
            first_segments.extend(out)
        return out

    engine.generate = spy
    calls = {"n": 0}

    @contextlib.contextmanager
    def turn():
        calls["n"] += 1
        if calls["n"] == 1:  # interrupt the first call once it is under way
            trigger = InterruptAfterTokens(engine, monkeypatch, tokens=len(prompts) * 4 * 20)
            yield
            assert trigger.at is not None, "the first call ended before the interrupt"
            monkeypatch.undo()
            return
        if calls["n"] == 2:  # the push between the two segments
            engine.update_weights(new, 1)
        yield

    stats = PartialStats()
    try:
        completions = generate_resumable(engine, prompts, sampling, seed=2, turn=turn, stats=stats)
        assert stats.interrupted >= 0.8 * len(completions) and stats.continuation_calls >= 1
        assert all(_ran_to_the_end(c) for c in completions)
        old_lp = teacher_forced_logprobs(trainer_model, prompts, completions, TEMPERATURE)
        new_lp = teacher_forced_logprobs(new, prompts, completions, TEMPERATURE)
        worst = 0.0
        for c, first, under_old, under_new in zip(completions, first_segments, old_lp, new_lp, strict=True):
            cut = len(first.token_ids)
            assert c.token_ids[:cut] == first.token_ids
            if first.finish_reason == INTERRUPTED:  # continued under the new weights
                # (no tokens kept when the interrupt came before the completion's first streamed chunk)
                assert 0 <= cut < len(c.token_ids)
            else:  # it had stopped before the interrupt: not continued
                assert first.finish_reason == "stop" and c.token_ids == first.token_ids
            assert c.token_versions() == [0] * cut + [1] * (len(c.token_ids) - cut)
            lp = torch.tensor(c.logprobs)
            segments = (lp[:cut] - torch.tensor(under_old[:cut]), lp[cut:] - torch.tensor(under_new[cut:]))
            # A segment may be empty (cut == 0: interrupted before the completion's first chunk).
            worst = max(worst, *(float(d.abs().max()) for d in segments if d.numel()))
            # The two weight sets disagree on these tokens by far more than the tolerance.
            assert float((torch.tensor(under_old) - torch.tensor(under_new)).abs().max()) > 100 * LOGPROB_MAX_TOL
        assert any(0 < len(f.token_ids) for f in first_segments if f.finish_reason == INTERRUPTED)
        print(f"\nsegments: |server - trainer of the segment's weights| logprob max {worst:.3g}")
        assert worst <= LOGPROB_MAX_TOL
    finally:
        engine.generate = generate
        engine.update_weights(trainer_model, 0)  # the module's server goes back to the checkpoint


# ---------------------------------------------------------------------- a stand-in streaming server


def _choice(index: int, tokens: list[int], finish: str | None = None) -> dict:
    return {
        "index": index,
        "text": "",
        "token_ids": tokens,
        "logprobs": {"token_logprobs": [-0.5 - 0.01 * t for t in tokens]},
        "finish_reason": finish,
        "stop_reason": tokens[-1] if finish == "stop" else None,
    }


class _StreamingStandIn:
    """Answers /v1/models and /server_info, and streams ``/v1/completions`` from ``script(body)``: a list of
    events (a dict, the bytes of a raw line, or a float: seconds to sleep); a request that does not
    stream gets the events' choices merged into one JSON document at the end. Records whether it
    saw the client go away."""

    def __init__(self, script) -> None:
        self.script = script
        self.bodies: list[dict] = []
        self.disconnected = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _json(self, payload: object) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/v1/models"):
                    self._json({"data": [{"id": "m", "max_model_len": 4096}]})
                else:
                    config = {"logprobs_mode": "processed_logprobs", "dtype": "torch.float32"}
                    self._json({"vllm_config": {"model_config": config}})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                if not body["stream"]:
                    self._document(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.end_headers()
                try:
                    for step in owner.script(body):
                        if isinstance(step, float):
                            time.sleep(step)
                            continue
                        line = step if isinstance(step, bytes) else b"data: " + json.dumps(step).encode()
                        self.wfile.write(line + b"\n\n")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    owner.disconnected.set()

            def _document(self, body: dict) -> None:
                merged: dict[int, dict] = {}
                for step in owner.script(body):
                    if isinstance(step, float):
                        time.sleep(step)
                    elif isinstance(step, dict):
                        for choice in step["choices"]:
                            into = merged.setdefault(choice["index"], _choice(choice["index"], []))
                            into["token_ids"] += choice["token_ids"]
                            into["logprobs"]["token_logprobs"] += choice["logprobs"]["token_logprobs"]
                            into["finish_reason"] = choice["finish_reason"]
                            into["stop_reason"] = choice["stop_reason"]
                try:
                    self._json({"choices": [merged[i] for i in sorted(merged)]})
                except (BrokenPipeError, ConnectionResetError):
                    owner.disconnected.set()

            def log_message(self, *args) -> None:  # quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def streaming_stand_in():
    servers: list[_StreamingStandIn] = []

    def make(script):
        servers.append(_StreamingStandIn(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _endless(body, steps: int = 600):
    """Sample 0 stops after two tokens; sample 1 (if asked for) trickles tokens until the client goes (or 30 s)."""
    yield {"choices": [_choice(0, [7])]}
    yield {"choices": [_choice(0, [9], "stop")]}
    if body["n"] > 1:
        for step in range(steps):
            yield {"choices": [_choice(1, [10 + step % 5])]}
            yield 0.05
        yield {"choices": [_choice(1, [11], "length")]}
    yield b"data: [DONE]"


def _wait_until(condition, timeout_s: float = 60.0) -> None:
    """Returns once ``condition()`` holds; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still not so after {timeout_s} s"
        time.sleep(0.01)


def test_interrupt_keeps_finished_samples_and_cuts_the_others(streaming_stand_in, monkeypatch):
    server = streaming_stand_in(_endless)
    engine = RemoteVLLMEngine(
        server.base_url,
        eos_token_id=2,
        stop_token_ids=[9],
        connection=ConnectionSettings(stream=True, stream_interval=3),
    )
    cfg = SamplingConfig(max_new_tokens=1000, samples_per_prompt=2)
    # Sample 0's two tokens and three of sample 1's: the interrupt lands inside the call, whatever the load.
    trigger = InterruptAfterTokens(engine, monkeypatch, tokens=2 + 3)
    finished, cut = engine.generate([[1, 5]], cfg)
    assert time.perf_counter() - trigger.at < 1.0  # (the stand-in would trickle for 30 s)
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_interval"] == 3 and body["n"] == 2
    assert (finished.finish_reason, finished.token_ids) == ("stop", [7, 9])
    assert cut.finish_reason == INTERRUPTED and 3 <= len(cut.token_ids) < 1000
    assert cut.token_ids == [10 + s % 5 for s in range(len(cut.token_ids))]
    assert cut.logprobs == pytest.approx([-0.5 - 0.01 * t for t in cut.token_ids])
    assert server.disconnected.wait(5)  # the stand-in saw the connection close
    assert engine.generate([[1, 5]], SamplingConfig(max_new_tokens=4, samples_per_prompt=1))  # consumed
    engine.close()


def test_the_stream_setting_decides_what_an_interrupt_keeps(streaming_stand_in, monkeypatch):
    """stream=None streams from the first interrupt on (the call it cuts keeps no tokens); False never streams."""
    server = streaming_stand_in(lambda body: _endless(body, steps=40))  # 2 s unstreamed
    cfg = SamplingConfig(max_new_tokens=1000, samples_per_prompt=2)
    for stream, kept_then in ((None, True), (False, False)):
        engine = RemoteVLLMEngine(
            server.base_url, eos_token_id=2, stop_token_ids=[9], connection=ConnectionSettings(stream=stream)
        )
        done = engine.generate([[1, 5]], cfg)  # not interrupted: one JSON answer, read whole
        assert server.bodies[-1]["stream"] is False and "stream_interval" not in server.bodies[-1]
        assert [c.finish_reason for c in done] == ["stop", "length"] and len(done[1].token_ids) == 41
        for kept in (False, kept_then):
            # Streamed: once sample 0 has ended and sample 1 has three tokens; unstreamed: once the request is sent.
            if kept:
                trigger = InterruptAfterTokens(engine, monkeypatch, tokens=2 + 3)
            else:
                trigger = InterruptOnceSent(engine, monkeypatch)
            sent = len(server.bodies)
            finished, cut = engine.generate([[1, 5]], cfg)
            assert time.perf_counter() - trigger.at < 1.0  # (the stand-in answers after 2 s)
            # A request cut right after it was written can reach the stand-in's handler after the call returns:
            # the next call waits for it, or the two bodies could be recorded in either order.
            _wait_until(lambda sent=sent: len(server.bodies) > sent)
            assert server.bodies[-1]["stream"] is kept
            # Unstreamed, the sample that had finished is lost with the rest: nothing of the answer arrived.
            assert (finished.finish_reason, finished.token_ids) == (("stop", [7, 9]) if kept else (INTERRUPTED, []))
            assert cut.finish_reason == INTERRUPTED and (len(cut.token_ids) >= 3 if kept else cut.token_ids == [])
        engine.close()


def test_stream_errors_are_clear(streaming_stand_in):
    cfg = SamplingConfig(max_new_tokens=8, samples_per_prompt=1)
    message = "token_id(s) [64] in stop_token_ids contain out-of-vocab token ids."
    failing = streaming_stand_in(
        lambda body: [{"error": {"message": message, "type": "BadRequestError"}}, b"data: [DONE]"]
    )
    with pytest.raises(RuntimeError, match=r"reported an error in its streamed answer: token_id\(s\) \[64\]"):
        RemoteVLLMEngine(failing.base_url, eos_token_id=2, connection=ConnectionSettings(stream=True)).generate(
            [[1, 5]], cfg
        )

    cut_off = streaming_stand_in(lambda body: [{"choices": [_choice(0, [7])]}])  # no finish, no [DONE]
    with pytest.raises(RuntimeError, match=r"ended before its last event \(data: \[DONE\]\)"):
        RemoteVLLMEngine(cut_off.base_url, eos_token_id=2, connection=ConnectionSettings(stream=True)).generate(
            [[1, 5]], cfg
        )

    unfinished = streaming_stand_in(lambda body: [{"choices": [_choice(0, [7])]}, b"data: [DONE]"])
    with pytest.raises(RuntimeError, match=r"finished with None"):  # not interrupted: no finish reason is an error
        RemoteVLLMEngine(unfinished.base_url, eos_token_id=2, connection=ConnectionSettings(stream=True)).generate(
            [[1, 5]], cfg
        )

    claims = streaming_stand_in(lambda body: [{"choices": [_choice(0, [7], INTERRUPTED)]}, b"data: [DONE]"])
    with pytest.raises(RuntimeError, match=r"finish_reason='interrupted'; expected 'stop' or 'length'"):
        RemoteVLLMEngine(claims.base_url, eos_token_id=2, connection=ConnectionSettings(stream=True)).generate(
            [[1, 5]], cfg
        )

    # request_timeout_s bounds the whole stream, not each read: a server that keeps trickling times out.
    trickling = streaming_stand_in(_endless)
    engine = RemoteVLLMEngine(
        trickling.base_url, eos_token_id=2, request_timeout_s=5, connection=ConnectionSettings(stream=True)
    )
    engine.connect()
    engine.request_timeout_s = 0.5
    began = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"request_timeout_s=0\.5"):
        engine.generate([[1, 5]], SamplingConfig(max_new_tokens=1000, samples_per_prompt=2))
    assert time.perf_counter() - began < 5

    # close() wakes a streamed generate in flight with RuntimeError.
    engine = RemoteVLLMEngine(trickling.base_url, eos_token_id=2, connection=ConnectionSettings(stream=True))
    errors: list[BaseException] = []

    def rollout() -> None:
        try:
            engine.generate([[1, 5]], SamplingConfig(max_new_tokens=1000, samples_per_prompt=2))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    sent = len(trickling.bodies)
    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    _wait_until(lambda: len(trickling.bodies) > sent or not thread.is_alive())  # the server has the request
    assert thread.is_alive(), errors
    began = time.perf_counter()
    engine.close()
    thread.join(5)
    assert not thread.is_alive() and time.perf_counter() - began < 5
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors


def test_stream_settings_are_checked():
    with pytest.raises(ValueError, match=r"ConnectionSettings\.stream='yes' must be True"):
        RemoteVLLMEngine("http://127.0.0.1:8000", connection=ConnectionSettings(stream="yes"))
    with pytest.raises(ValueError, match=r"ConnectionSettings\.stream_interval=0 must be an int >= 1"):
        RemoteVLLMEngine("http://127.0.0.1:8000", connection=ConnectionSettings(stream_interval=0))
    with pytest.raises(ValueError, match=r"ConnectionSettings\.stream_interval=2\.0 must be an int >= 1"):
        RemoteVLLMEngine("http://127.0.0.1:8000", connection=ConnectionSettings(stream_interval=2.0))


@requires_vllm
@pytest.mark.slow
def test_a_push_cuts_every_independent_episodes_turn_in_flight_and_each_goes_on_under_the_new_weights(
    server, weights_dir, trainer_model, monkeypatch
):
    """Episodes played independently on the server (each turn its own call), three of those calls held open
    mid-stream at once (only possible when calls run side by side), then a producer's push: one interrupt
    cuts all three, the sync takes the engine alone, and each cut turn goes on under the new weights: every
    token has the version and the logprob of the weights that sampled it, in the episode's own context."""
    from lightning_offpolicy.batch import PromptBatch
    from lightning_offpolicy.data.tokenizers import CharTokenizer
    from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings
    from lightning_offpolicy.rollout.producer import RolloutProducer
    from tests.engine_contract import Replies, turn_contexts
    from tests.test_async_rollout import fake_rollout, wait_for

    engine = RemoteVLLMEngine(
        server.base_url,
        eos_token_id=2,
        request_timeout_s=300,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir)),
        connection=ConnectionSettings(stream=True),
    )
    new = perturbed(trainer_model, 0.05)
    engine.update_weights(trainer_model, 0)
    tokenizer = CharTokenizer()
    runner = EpisodeRunner(EpisodeSettings(environment=lambda: Replies(3), max_turns=3), tokenizer, engine.stop_ids)
    texts = [tokenizer.decode(p) for p in reverse_prompts(8, seed=5)]
    sampling = SamplingConfig(max_new_tokens=40, temperature=1.0, samples_per_prompt=2)
    stats, played, first_call_done = PartialStats(), [], threading.Event()
    go, interrupted, lock, held = threading.Event(), threading.Event(), threading.Lock(), set()
    add, interrupt = StreamedChoices.add, engine.interrupt

    def held_add(choices: StreamedChoices, event) -> None:
        """A later turn's stream, not finished by this event, waits here for the push (three of them: the push)."""
        add(choices, event)
        if not first_call_done.is_set() or all(reason is not None for reason in choices.finish_reasons):
            return
        with lock:
            if interrupted.is_set():
                return
            held.add(id(choices))
            if len(held) >= 3:
                go.set()
        assert interrupted.wait(60)

    def recorded_interrupt() -> None:
        interrupt()
        interrupted.set()

    monkeypatch.setattr(StreamedChoices, "add", held_add)
    monkeypatch.setattr(engine, "interrupt", recorded_interrupt)
    producer: RolloutProducer

    def generate(ids, cfg, seed):
        out = generate_resumable(engine, ids, cfg, seed=seed, turn=producer.generation_turn, stats=stats)
        first_call_done.set()
        return out

    def produce(prompts, index):
        if index == 0:
            ids = runner.prompt_ids(prompts.prompts)
            played.extend(
                runner.run(prompts.prompts, [{}] * len(ids), ids, sampling, generate, 11, 0,
                           concurrent_episodes=engine.concurrent_calls)
            )  # fmt: skip
        return fake_rollout([0, 0]), 0.0

    producer = RolloutProducer(
        produce, iter([PromptBatch(prompts=texts)] + [PromptBatch(prompts=["x"])] * 10), max_staleness=1,
        steps_per_batch=1, first_index=0, trainer_version=0, engine_version=0, interrupt=engine.interrupt,
    )  # fmt: skip
    producer.start()
    try:
        assert go.wait(120), "three turns never streamed at once"
        with producer.engine_access():
            engine.update_weights(new, 1)
            producer.set_engine_version(1)
        wait_for(lambda: len(played) == 16, timeout=120)
    finally:
        interrupted.set()
        producer.close()
        runner.close()
    try:
        assert stats.interrupted >= 3, stats  # the three held turns, cut by one interrupt
        contexts, turns = turn_contexts(played)
        old_lp = teacher_forced_logprobs(trainer_model, contexts, turns, 1.0)
        new_lp = teacher_forced_logprobs(new, contexts, turns, 1.0)
        mixed = 0
        for c, under_old, under_new in zip(turns, old_lp, new_lp, strict=True):
            versions = c.token_versions()
            assert versions == sorted(versions) and set(versions) <= {0, 1}  # old tokens, then new ones
            mixed += len(set(versions)) == 2
            reference = [o if v == 0 else n for v, o, n in zip(versions, under_old, under_new, strict=True)]
            assert float((torch.tensor(c.logprobs) - torch.tensor(reference)).abs().max()) <= LOGPROB_MAX_TOL
        assert mixed >= 3  # the held turns had tokens and went on under the new weights
    finally:
        engine.update_weights(trainer_model, 0)  # the module's server goes back to the checkpoint
        engine.close()
