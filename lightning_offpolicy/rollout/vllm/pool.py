"""Rollouts spread over several vLLM servers, balanced by the client: :class:`RemoteVLLMPool`.

Each server is a :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine` (its own
connect checks, weight sync and self-check). The pool sends each prompt to the server with the
fewest requests outstanding, except a prompt that continues one it sent before (the next turn of
an episode, a partial rollout resumed after a sync), which goes back to the same server, whose
prefix cache holds it. Weight syncs go to every server in parallel; the pool's version moves only
when all of them have it. A server that fails (dead, hung past its ``request_timeout_s``, a failed
sync) is named in an error and, with ``on_server_failure="retry"``, left out from then on, its
prompts sampled again on the others. Why the balancing is client-side rather than behind
``vllm-router``: docs/scaling.md, "Several servers".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import logging
import socket
import threading
import urllib.parse
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.rollout.engine import Completion, SamplingConfig, checked_prompts, per_prompt_seeds
from lightning_offpolicy.rollout.vllm.http import HTTPStatusError
from lightning_offpolicy.rollout.vllm.remote import RemoteVLLMEngine

__all__ = ["RemoteVLLMPool"]

log = logging.getLogger(__name__)

_FAILURE_MODES = ("retry", "stop")
#: Prompts remembered for sticky routing (the most recent ones; a continuation of an older one is
#: balanced like a new prompt).
_REMEMBERED_PROMPTS = 16384
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """``h[k]`` = a polynomial hash of ``tokens[:k]`` (``k = 0 .. len``), each in O(1) from the last."""
    hashes = [0]
    value = 0
    for token in tokens:
        value = (value * _HASH_BASE + int(token) + 1) % _HASH_MOD
        hashes.append(value)
    return hashes


def _server_failure(err: BaseException) -> bool:
    """Whether ``err`` is the server's failure (dead, hung, 5xx, a sync that did not arrive), not the request's."""
    if isinstance(err, HTTPStatusError):
        return err.status >= 500
    return isinstance(err, RuntimeError)


class _StickyHomes:
    """Which server each recently sent prompt went to, and the longest such prompt a new one starts with."""

    def __init__(self, capacity: int = _REMEMBERED_PROMPTS) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[tuple[int, int], tuple[tuple[int, ...], int]] = OrderedDict()
        self._lengths: Counter[int] = Counter()

    def home(self, prompt: Sequence[int], hashes: list[int]) -> int | None:
        """The server of the longest remembered prompt that ``prompt`` starts with (``None``: none)."""
        for length in sorted((n for n in self._lengths if n <= len(prompt)), reverse=True):
            entry = self._homes.get((length, hashes[length]))
            if entry is not None and entry[0] == tuple(prompt[:length]):
                return entry[1]
        return None

    def remember(self, prompt: Sequence[int], hashes: list[int], server: int) -> None:
        key = (len(prompt), hashes[-1])
        if key in self._homes:
            self._homes.move_to_end(key)
        else:
            self._lengths[len(prompt)] += 1
        self._homes[key] = (tuple(prompt), server)
        while len(self._homes) > self.capacity:
            (length, _), _ = self._homes.popitem(last=False)
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]

    def forget_server(self, server: int) -> None:
        for key in [k for k, (_, s) in self._homes.items() if s == server]:
            del self._homes[key]
            self._lengths[key[0]] -= 1
            if not self._lengths[key[0]]:
                del self._lengths[key[0]]


class RemoteVLLMPool:
    """Sample from several vLLM servers as one engine, balanced by the client.

    Args:
        servers: One :class:`RemoteVLLMEngine` per server (each with its own ``base_url``,
            ``weights_dir``, time limits), at least one. Their ``eos_token_id`` / ``stop_token_ids``
            are set together by :meth:`set_special_tokens`.
        on_server_failure: What a failing server (refused connection, dropped or timed-out request,
            failed weight sync) does to the run. ``"retry"``: the server is left out from then on
            (logged as an error naming it) and its prompts are sampled again on the others, with the
            same seeds; the run stops only when no server is left. ``"stop"``: a ``RuntimeError``
            naming the server at once (the fit stops; with ``PreemptionCheckpoint(save_on_exception=
            True)`` after saving a checkpoint).
        split_across_ranks: Under several trainer processes (``torch.distributed`` initialized, as
            under Lightning's DDP / FSDP2), each rank keeps its own share of ``servers`` at its first
            call, ``servers[rank::world_size]`` (a server serves one trainer rank: a sync changes
            its weights for every client), so one YAML list serves every rank. Needs at least as
            many servers as ranks. ``False``: every rank uses every server listed (give each rank
            its own list).

    Attributes:
        version: Policy version every live server holds (stamped on completions by each server).
        requests_per_server: Requests (one per prompt) each server was sent since the pool started.
    """

    _who = "RemoteVLLMPool"

    def __init__(
        self,
        servers: Sequence[RemoteVLLMEngine],
        on_server_failure: Literal["retry", "stop"] = "retry",
        split_across_ranks: bool = True,
    ) -> None:
        servers = list(servers)
        if not servers or not all(isinstance(s, RemoteVLLMEngine) for s in servers):
            raise ValueError(
                f"RemoteVLLMPool.servers must be a non-empty list of RemoteVLLMEngine, got "
                f"{[type(s).__name__ for s in servers]}."
            )
        urls = [s.base_url for s in servers]
        addresses = [_server_address(url) for url in urls]
        for i, (port, path, hosts) in enumerate(addresses):
            for j in range(i):
                if addresses[j][:2] == (port, path) and addresses[j][2] & hosts:  # e.g. localhost and 127.0.0.1
                    raise ValueError(
                        f"RemoteVLLMPool.servers: the same server twice ({urls[j]} and {urls[i]}): give each server "
                        "once (each sync would be pushed to it twice, and its share of the prompts doubled)."
                    )
        if on_server_failure not in _FAILURE_MODES:
            raise ValueError(
                f"RemoteVLLMPool.on_server_failure={on_server_failure!r} is not known; allowed: "
                f"{', '.join(map(repr, _FAILURE_MODES))}."
            )
        if not isinstance(split_across_ranks, bool):
            raise ValueError(f"RemoteVLLMPool.split_across_ranks={split_across_ranks!r} must be True or False.")
        self.servers = servers
        self.on_server_failure = on_server_failure
        self.split_across_ranks = split_across_ranks
        self._split = False
        self.version = 0
        self.requests_per_server = [0] * len(servers)
        self.failed: dict[int, str] = {}  # server index -> why it was left out
        self._outstanding = [0] * len(servers)
        self._homes = _StickyHomes()
        self._lock = threading.Lock()  # assignment, counts, failures
        self._sync_lock = threading.Lock()  # one weight sync at a time
        self._interrupt = threading.Event()
        self._calls_in_flight = 0
        self._batch_counts = [0] * len(servers)  # since the last rollout_stats()

    # ------------------------------------------------------------------ engine protocol

    @property
    def stop_ids(self) -> list[int]:
        return self.servers[0].stop_ids

    @property
    def max_model_len(self) -> int | None:
        lengths = [s.max_model_len for i, s in enumerate(self.servers) if i not in self.failed]
        known = [n for n in lengths if n is not None]
        return min(known) if known else None

    @property
    def last_sync_check_max_abs_diff(self) -> float | None:
        diffs = [s.last_sync_check_max_abs_diff for i, s in enumerate(self.servers) if i not in self.failed]
        known = [d for d in diffs if d is not None]
        return max(known) if known else None

    def set_special_tokens(
        self, pad_token_id: int | None, eos_token_id: int | None, stop_token_ids: list[int] | None = None
    ) -> None:
        """Give every server the padding, eos and stop ids not given at construction."""
        for server in self.servers:
            server.set_special_tokens(pad_token_id, eos_token_id, stop_token_ids)

    @property
    def concurrent_calls(self) -> int:
        """``generate`` calls from other threads served side by side: the live servers' together."""
        return sum(self.servers[i].concurrent_calls for i in self.live_servers())

    def live_servers(self) -> list[int]:
        """Indices of the servers still in use."""
        return [i for i in range(len(self.servers)) if i not in self.failed]

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        """``sampling.samples_per_prompt`` completions per prompt, grouped by prompt in order.

        With ``seed`` each prompt gets the seed a single engine would give it, whichever server
        samples it. :meth:`interrupt` cuts the call short on every server it uses.
        """
        self._take_rank_share()
        prompts = checked_prompts(prompt_ids, f"{self._who}.generate")
        if not prompts:
            return []
        seeds = per_prompt_seeds(seed, len(prompts), sampling.samples_per_prompt)
        with self._lock:
            self._calls_in_flight += 1
        try:
            results: dict[int, list[Completion]] = {}
            pending = list(range(len(prompts)))
            while pending:
                plan = {
                    server: [pending[p] for p in positions]
                    for server, positions in self._assign([prompts[i] for i in pending]).items()
                }
                errors = self._run_plan(prompts, plan, sampling, seeds, results)
                if errors:
                    self._after_failures(errors, "generate")
                pending = sorted(i for server in errors for i in plan[server])
            return [c for i in range(len(prompts)) for c in results[i]]
        finally:
            with self._lock:
                self._calls_in_flight -= 1
                if not self._calls_in_flight:
                    self._interrupt.clear()  # consumed by the calls it reached

    def interrupt(self) -> None:
        """Cut the ``generate`` call in flight short on every server (or the next call, when none is)."""
        self._interrupt.set()
        with self._lock:
            busy = [i for i, n in enumerate(self._outstanding) if n]
        for index in busy:
            self.servers[index].interrupt()

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        """Sync every live server to ``source`` in parallel (each checks its own sync); the pool's
        version becomes ``version`` once all of them have it.

        Raises:
            RuntimeError: A server failed its sync and ``on_server_failure="stop"``, or no server is left.
        """
        if not is_int(version):
            raise TypeError(f"{self._who}.update_weights: version must be an int, got {version!r}.")
        self._take_rank_share()
        with self._sync_lock:
            live = self.live_servers()
            failures: dict[int, BaseException] = {}
            with concurrent.futures.ThreadPoolExecutor(len(live), thread_name_prefix="pool-sync") as executor:
                futures = {executor.submit(self.servers[i].update_weights, source, version): i for i in live}
                for future in concurrent.futures.as_completed(futures):
                    if (err := future.exception()) is not None:
                        failures[futures[future]] = err
            if failures:
                usage = [err for err in failures.values() if not _server_failure(err)]
                if usage:  # the trainer's side (a bad source): every server would refuse it
                    raise usage[0]
                self._after_failures(failures, "update_weights")
            self.version = int(version)

    def close(self) -> None:
        """Close every server's client (its sync files removed; the servers themselves keep running)."""
        for server in self.servers:
            server.close()

    def rollout_stats(self) -> dict[str, float]:
        """Requests each server was sent since the last call, and the servers in use (logged per batch)."""
        with self._lock:
            counts, self._batch_counts = self._batch_counts, [0] * len(self.servers)
        stats = {f"server{i}_requests": float(n) for i, n in enumerate(counts)}
        stats["servers_live"] = float(len(self.live_servers()))
        return stats

    def __enter__(self) -> RemoteVLLMPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        states = ", ".join(f"{s.base_url}{' (failed)' if i in self.failed else ''}" for i, s in enumerate(self.servers))
        return f"RemoteVLLMPool([{states}], version={self.version})"

    # ------------------------------------------------------------------ balancing

    def _take_rank_share(self) -> None:
        """Once: under several trainer ranks, keep ``servers[rank::world_size]`` (``split_across_ranks``)."""
        with self._lock:
            if self._split:
                return
            self._split = True
            if not (self.split_across_ranks and dist.is_available() and dist.is_initialized()):
                return
            world, rank = dist.get_world_size(), dist.get_rank()
            if world == 1:
                return
            if len(self.servers) < world:
                raise ValueError(
                    f"{self._who}: {len(self.servers)} servers for {world} trainer ranks; each rank needs its own "
                    "(a sync changes a server's weights for every client). List at least one server per rank, or "
                    "set split_across_ranks=False and give each rank its own list."
                )
            mine = self.servers[rank::world]
            for server in self.servers:
                if server not in mine:
                    server.close()
            self.servers = mine
            self.requests_per_server = [0] * len(mine)
            self._outstanding = [0] * len(mine)
            self._batch_counts = [0] * len(mine)
            log.info("%s: rank %d of %d uses %s", self._who, rank, world, [s.base_url for s in mine])

    def _assign(self, prompts: list[list[int]]) -> dict[int, list[int]]:
        """Server -> positions in ``prompts``: continuations to their server, the rest to the least loaded."""
        with self._lock:
            live = self.live_servers()
            if not live:
                raise RuntimeError(self._none_left())
            load = {i: self._outstanding[i] for i in live}
            plan: dict[int, list[int]] = {i: [] for i in live}
            for position, prompt in enumerate(prompts):
                hashes = _prefix_hashes(prompt)
                server = self._homes.home(prompt, hashes)
                if server not in load:
                    server = min(live, key=lambda i: (load[i], i))
                plan[server].append(position)
                load[server] += 1
                self._homes.remember(prompt, hashes, server)
            return {i: positions for i, positions in plan.items() if positions}

    def _run_plan(
        self,
        prompts: list[list[int]],
        plan: dict[int, list[int]],
        sampling: SamplingConfig,
        seeds: list[int | None],
        results: dict[int, list[Completion]],
    ) -> dict[int, BaseException]:
        """Sample each server's prompts (indices into ``prompts``) in its own thread; the servers that failed."""
        n = sampling.samples_per_prompt
        errors: dict[int, BaseException] = {}

        def run(server: int, indices: list[int]) -> None:
            engine = self.servers[server]
            if self._interrupt.is_set():
                engine.interrupt()  # an interrupt that came before this share started
            completions = engine.generate_seeded([prompts[i] for i in indices], sampling, [seeds[i] for i in indices])
            for k, index in enumerate(indices):  # the server numbered its share's prompts from 0
                results[index] = [dataclasses.replace(c, prompt_index=index) for c in completions[k * n : (k + 1) * n]]

        with self._lock:
            for server, indices in plan.items():
                self._outstanding[server] += len(indices)
                self.requests_per_server[server] += len(indices)
                self._batch_counts[server] += len(indices)
        try:
            with concurrent.futures.ThreadPoolExecutor(len(plan), thread_name_prefix="pool-generate") as executor:
                futures = {executor.submit(run, server, indices): server for server, indices in plan.items()}
                for future in concurrent.futures.as_completed(futures):
                    if (err := future.exception()) is not None:
                        errors[futures[future]] = err
        finally:
            with self._lock:
                for server, indices in plan.items():
                    self._outstanding[server] -= len(indices)
        usage = [err for err in errors.values() if not _server_failure(err)]
        if usage:  # a bad request (too long a prompt, ...): the caller's, not a server's
            raise usage[0]
        return errors

    def _after_failures(self, errors: dict[int, BaseException], what: str) -> None:
        """Name the failed servers; leave them out (``"retry"``) or raise (``"stop"`` / none left)."""
        failed = list(errors)
        with self._lock:
            for server in failed:
                reason = f"{self.servers[server].base_url} failed during {what}: {errors[server]}"
                self.failed[server] = reason
                self._homes.forget_server(server)
                log.error("%s: server %s", self._who, reason)
            live = self.live_servers()
        names = "; ".join(self.failed[s] for s in failed)
        if self.on_server_failure == "stop":
            raise RuntimeError(
                f"{self._who}: {names}. on_server_failure='stop': the run stops (set on_server_failure='retry' to go "
                "on with the other servers)."
            ) from errors[failed[0]]
        if not live:
            raise RuntimeError(self._none_left()) from errors[failed[0]]
        log.warning(
            "%s: going on with %d of %d servers; %s",
            self._who,
            len(live),
            len(self.servers),
            "the failed server's prompts are sampled again on the others" if what == "generate" else "",
        )

    def _none_left(self) -> str:
        reasons = "; ".join(self.failed.values())
        return f"{self._who}: no server left ({reasons}). Restart the servers and resume the fit from its checkpoint."


def _server_address(url: str) -> tuple[int | None, str, frozenset[str]]:
    """``(port, path, addresses)`` of a server URL: the host resolved (any loopback name or address is one
    host), so that two spellings of one server compare equal."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    host = parts.hostname or ""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):  # an unknown name: compared as written
        resolved = {host}
    hosts = set()
    for address in resolved:
        try:
            hosts.add("loopback" if ipaddress.ip_address(address.split("%")[0]).is_loopback else address)
        except ValueError:
            hosts.add(address)
    return port, parts.path.rstrip("/"), frozenset(hosts)
