"""The worker-side kept-set recorder's own logic (which rows, which request, what is sent back).

The recorder on a real vLLM worker (nuclei of every width against the trainer's float64 logits, on
``VLLMEngine`` and on a server) is in ``tests/engine_contract.py``; here the parts vLLM does not
exercise on CPU: a discarded partial-prefill row, rows of other requests, forgetting what nobody took.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_offpolicy.rollout.vllm import kept_sets
from lightning_offpolicy.rollout.vllm.base import RawSample, VLLMEngineBase
from lightning_offpolicy.rollout.vllm.kept_sets import KEPT_SET_KEY, KeptSetRecorder, decode_kept_sets, encode_kept_sets

NEG_INF = float("-inf")


@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=40), max_size=30))
def test_kept_sets_survive_the_encoding(tokens):
    arrays = [np.array(ids, dtype=np.int32) for ids in tokens]
    assert decode_kept_sets(encode_kept_sets(arrays)) == tokens


class Worker(KeptSetRecorder):
    """A worker with the attributes the recorder reads (vLLM's model runner holds the same names)."""

    def __init__(self) -> None:
        def forward(logits, generators, k, p):
            return logits.argmax(-1), logits  # the rows handed in are already the processed logprobs

        self.model_runner = SimpleNamespace(
            sampler=SimpleNamespace(topk_topp_sampler=SimpleNamespace(forward=forward)),
            input_batch=SimpleNamespace(req_ids=[]),
            requests={},
            discard_request_mask=SimpleNamespace(np=np.zeros(8, dtype=bool)),
        )

    def step(self, rows: dict[str, list[float]], discard: tuple[int, ...] = ()) -> None:
        runner = self.model_runner
        runner.input_batch.req_ids = list(rows)
        runner.discard_request_mask.np[:] = False
        runner.discard_request_mask.np[list(discard)] = True
        runner.sampler.topk_topp_sampler.forward(torch.tensor(list(rows.values())), {}, None, None)

    def add(self, req_id: str, tag: str | None) -> None:
        extra = None if tag is None else {KEPT_SET_KEY: tag}
        self.model_runner.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))


def test_each_tagged_row_is_recorded_under_its_request_and_sample_and_taken_once():
    worker = Worker()
    assert worker.lo_record_kept_sets() and worker.lo_record_kept_sets()  # idempotent: wrapped once
    for req_id, tag in (("0_lo-7-ab12cd34", "t7"), ("1_lo-7-ab12cd34", "t7"), ("lo-8-ef56ab78", "t8")):
        worker.add(req_id, tag)
    worker.add("other-1", None)  # a request that is not the kit's (e.g. the sync check's probe)
    worker.add("lo-9-00000000", "t9")
    worker.step(
        {
            "0_lo-7-ab12cd34": [-1.0, NEG_INF, -0.5, NEG_INF],
            "other-1": [-1.0, -1.0, -1.0, -1.0],
            "1_lo-7-ab12cd34": [NEG_INF, -0.1, NEG_INF, NEG_INF],
            "lo-8-ef56ab78": [-1.4, -1.4, -1.4, -1.4],  # nothing cut: the whole vocabulary
            "lo-9-00000000": [-1.0, NEG_INF, NEG_INF, NEG_INF],  # a partial prefill: vLLM discards its sample
        },
        discard=(4,),
    )
    worker.step({"1_lo-7-ab12cd34": [NEG_INF, NEG_INF, NEG_INF, 0.0]})
    taken = worker.lo_take_kept_sets(["t7", "t8", "t9"])
    assert {key: {i: decode_kept_sets(e) for i, e in samples.items()} for key, samples in taken.items()} == {
        "t7": {0: [[0, 2]], 1: [[1], [3]]},
        "t8": {0: [[]]},
    }
    assert worker.lo_take_kept_sets(["t7", "t8"]) == {}


def test_records_nobody_takes_are_forgotten(monkeypatch):
    worker = Worker()
    worker.lo_record_kept_sets()
    worker.add("lo-1-00000000", "given-up")
    now = [1000.0]
    monkeypatch.setattr(kept_sets.time, "monotonic", lambda: now[0])
    worker.step({"lo-1-00000000": [0.0, NEG_INF]})
    now[0] += kept_sets._FORGET_AFTER_S + 1
    assert worker.lo_take_kept_sets([]) == {}
    assert worker._lo_kept == {}


def test_a_model_runner_without_the_sampler_says_so():
    worker = Worker()
    worker.model_runner.sampler = SimpleNamespace()
    assert worker.lo_record_kept_sets() is False


def test_the_engine_attaches_the_records_and_refuses_records_out_of_step():
    samples = [[RawSample([3, 1], [-0.1, -0.2], "length"), RawSample([], [], "length")]]
    taken = {"t": {"0": encode_kept_sets([np.array([1, 3], dtype=np.int32), np.array([], dtype=np.int32)] * 2)}}
    VLLMEngineBase._attach_kept_sets(samples, ["t"], taken)  # indices as strings: the JSON of a server
    assert samples[0][0].kept_sets == [[1, 3], [], [1, 3], []]  # one past the tokens: sampled after an abort
    assert samples[0][1].kept_sets == []
    engine = SimpleNamespace(_who="VLLMEngine")
    assert VLLMEngineBase._recorded_support(engine, 0, samples[0][0]) == [[1, 3], []]
    samples[0][0].token_ids = [2, 1]
    with pytest.raises(RuntimeError, match="out of step"):
        VLLMEngineBase._recorded_support(engine, 0, samples[0][0])
    with pytest.raises(RuntimeError, match="recorded the kept sets of 0 tokens"):
        VLLMEngineBase._recorded_support(engine, 0, RawSample([5], [-0.3], "length"))
