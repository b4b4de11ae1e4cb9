"""What the in-process and the remote vLLM engines share: argument checks, the ``generate`` and
``update_weights`` templates, the answer checks, the weight-sync self-check, ``stats`` and ``close``.

A backend fills in the hooks: how a batch of prompts is sampled (:meth:`VLLMEngineBase._sample`,
returning :class:`RawSample` lists), how weights reach the engine (:meth:`VLLMEngineBase._push`)
and how the engine scores the probe sequence of the self-check.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from lightning_offpolicy.argcheck import is_int, is_number
from lightning_offpolicy.rollout.engine import (
    INTERRUPTED,
    Completion,
    SamplingConfig,
    SpecialTokens,
    checked_prompts,
    checked_token_ids,
    per_prompt_seeds,
)
from lightning_offpolicy.rollout.vllm.kept_sets import decode_kept_sets
from lightning_offpolicy.rollout.vllm.settings import RemoteWeightSyncSettings, WeightSyncSettings
from lightning_offpolicy.rollout.vllm.sync.check import SyncCheck, sync_tolerance, trainer_probe_logprobs
from lightning_offpolicy.rollout.vllm.sync.export import weight_source

__all__ = ["SUPPORT_LOGPROBS", "RawSample", "VLLMEngineBase", "fmt", "kept_from_top"]

log = logging.getLogger(__name__)


def fmt(value: float | None) -> str:
    """A measurement for a log line (``-`` when not measured)."""
    return "-" if value is None else f"{value:.3g}"


@dataclass
class RawSample:
    """One completion as a backend returned it, before the shared checks turn it into a ``Completion``.

    ``kept_sets``: under a sampling mask, per token the ids top-k / top-p kept (``[]``: the whole
    vocabulary), as the engine's worker recorded them (:mod:`~lightning_offpolicy.rollout.vllm.kept_sets`);
    it may run past the tokens (one sampled after an abort). ``top_logprobs``: where the worker does
    not record them, per token the processed logprobs of the top tokens the request asked for
    (``id -> logprob``, ``-inf`` for a token top-k / top-p cut), from which :func:`kept_from_top`
    reads the kept support.
    """

    token_ids: list[int]
    logprobs: list[float | None] | None
    finish_reason: Any
    stop_reason: Any = None
    top_logprobs: list[dict[int, float]] | None = None
    kept_sets: list[list[int]] | None = None


#: Default of ``support_logprobs``: vLLM's default ``max_logprobs``.
SUPPORT_LOGPROBS = 20


def support_request(sampling: SamplingConfig, support_logprobs: int) -> int:
    """How many top logprobs per token a request asks for: 0 without a sampling mask, ``top_k`` when
    that bounds the kept set within ``support_logprobs``, else ``support_logprobs``."""
    if not sampling.support_needed:
        return 0
    if 0 < sampling.top_k <= support_logprobs:
        return sampling.top_k
    return support_logprobs


def kept_from_top(top: dict[int, float], requested: int, top_k: int, vocab_size: int | None) -> list[int] | None:
    """The ids top-k / top-p kept at one position, from the processed logprobs of its ``requested`` top tokens.

    vLLM's processed logprobs are ``-inf`` for every token top-k / top-p cut, and its top tokens are
    ranked by them: when fewer than ``requested`` of them are finite, the finite ones are the whole
    kept set. When all are, it is whole only if ``top_k <= requested`` (or the top tokens are the
    whole vocabulary); else the nucleus may go on past them and ``None`` says so.

    Returns:
        The kept ids (``[]`` when they are the whole vocabulary), or ``None`` when the top
        ``requested`` tokens do not show the whole kept set.
    """
    kept = [token for token, logprob in top.items() if logprob > float("-inf")]
    whole = len(kept) < requested or 0 < top_k <= requested or (vocab_size is not None and requested >= vocab_size)
    if not whole:
        return None
    return [] if vocab_size is not None and len(kept) >= vocab_size else kept


class VLLMEngineBase(SpecialTokens):
    """The engine contract's common part for vLLM backends (see the module docstring).

    Subclasses call :meth:`_init_common` in their ``__init__`` and set ``self._lock``; they
    implement ``_sample``, ``_push``, ``_engine_probe_logprobs``, ``_probe`` and
    ``compute_dtype``, and may refine the ``_prepare_*`` hooks.
    """

    #: Who says what in messages: the class name.
    _who: str
    #: What answered, in messages ("vLLM", "the server").
    _backend = "vLLM"

    def _init_common(
        self,
        weight_sync: WeightSyncSettings | RemoteWeightSyncSettings,
        request_timeout_s: Any,
        pad_token_id: Any,
        eos_token_id: Any,
        stop_token_ids: Any,
        support_logprobs: Any = SUPPORT_LOGPROBS,
    ) -> None:
        """Validate and store the settings every vLLM backend has; start the shared state.

        ``weight_sync`` is the engine's sync settings (its ``check`` and ``tolerance``, checked when it was built).
        """
        who = self._who
        # Whether the engine's workers record the exact kept sets (None: not asked yet; asked at the first
        # call under a sampling mask).
        self.records_kept_sets: bool | None = None
        self._tag_prefix = f"lo-{uuid.uuid4().hex[:12]}"
        self._tag_counter = itertools.count()
        if not is_int(support_logprobs) or support_logprobs < 1:
            raise ValueError(
                f"{who}.support_logprobs={support_logprobs!r} must be an int >= 1 (top logprobs per token that "
                "show the support top-k / top-p kept)."
            )
        self.support_logprobs = int(support_logprobs)
        if not (is_number(request_timeout_s) and request_timeout_s > 0):
            raise ValueError(f"{who}.request_timeout_s={request_timeout_s!r} must be > 0 (seconds).")
        for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{who}.{name}={value!r} must be a token id (int >= 0) or None.")
        self.check_weight_sync = weight_sync.check
        self.weight_sync_tolerance = weight_sync.tolerance
        self.request_timeout_s = float(request_timeout_s)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = (
            None if stop_token_ids is None else checked_token_ids(stop_token_ids, f"{who}.stop_token_ids")
        )

        self.version = 0
        self.last_sync_time_s: float | None = None
        self.last_generate_tokens_per_s: float | None = None
        self._closed = False
        self._failure: str | None = None
        self._sync_check = SyncCheck(who)
        # Set by interrupt(); each call polls the one current when it began (:meth:`_interrupt_of_call`).
        self._interrupt = self._new_interrupt()
        self._interrupt_lock = threading.Lock()

    # ------------------------------------------------------------------ public API

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the engine computes in (``None``: not known yet)."""
        raise NotImplementedError

    @property
    def last_sync_check_max_abs_diff(self) -> float | None:
        """Largest |engine - trainer| probe logprob difference of the last self-check (``None``: not run)."""
        return self._sync_check.last_max_abs_diff

    def interrupt(self) -> None:
        """Cut the ``generate`` call in flight (or the next one) short: its unfinished completions come
        back :data:`~lightning_offpolicy.rollout.engine.INTERRUPTED` with the tokens sampled so far
        (partial rollouts). Thread-safe, returns at once."""
        with self._interrupt_lock:  # never lands on an interrupt a call has just replaced
            self._interrupt.set()

    @contextlib.contextmanager
    def _interrupt_of_call(self) -> Iterator[threading.Event]:
        """The interrupt a ``generate`` call polls: the one current when it began, so that one
        :meth:`interrupt` reaches every call in flight; the first call it cut replaces it as it ends
        (the calls after run normally)."""
        with self._interrupt_lock:
            interrupt = self._interrupt
        try:
            yield interrupt
        finally:
            with self._interrupt_lock:
                if interrupt.is_set() and self._interrupt is interrupt:
                    self._interrupt = self._new_interrupt()

    def _new_interrupt(self) -> Any:
        """A fresh, unset interrupt signal (``set()`` / ``is_set()``) for the calls to come."""
        return threading.Event()

    def stats(self) -> dict[str, float]:
        """The engine's measurements, for logging (only the ones measured so far)."""
        values = {
            **self._backend_stats(),
            "vllm/sync_s": self.last_sync_time_s,
            "vllm/sync_check_max_abs_diff": self.last_sync_check_max_abs_diff,
            "vllm/tokens_per_s": self.last_generate_tokens_per_s,
        }
        return {k: float(v) for k, v in values.items() if v is not None}

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        """``sampling.samples_per_prompt`` completions per prompt, grouped by prompt in order.

        With ``seed`` the samples are reproducible (each prompt gets its own seed drawn from it, the
        same scheme in every vLLM backend); without, they come from the engine's global random state.
        """
        return self.generate_seeded(
            prompt_ids, sampling, per_prompt_seeds(seed, len(prompt_ids), sampling.samples_per_prompt)
        )

    def generate_seeded(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seeds: list[int | None]
    ) -> list[Completion]:
        """:meth:`generate` with one sampler seed per prompt given (``None``: unseeded): what a pool of
        engines uses so that a prompt's samples do not depend on which engine drew them."""
        self._check_usable()
        if self.eos_token_id is None:
            raise RuntimeError(f"{self._who} needs eos_token_id (pass it or call set_special_tokens(...)).")
        prompts = checked_prompts(prompt_ids, f"{self._who}.generate")
        if not prompts:
            return []
        if len(seeds) != len(prompts):
            raise ValueError(f"{self._who}.generate_seeded: {len(seeds)} seeds for {len(prompts)} prompts.")
        self._prepare_generate(prompts, sampling)
        n = sampling.samples_per_prompt
        begin = time.perf_counter()
        answers, version = self._sample(prompts, sampling, seeds)
        elapsed = time.perf_counter() - begin
        completions = [
            completion
            for index, samples in enumerate(answers)
            for completion in self._completions(index, samples, n, version, sampling)
        ]
        generated = sum(len(c.token_ids) for c in completions)
        self.last_generate_tokens_per_s = generated / elapsed if elapsed > 0 else None
        return completions

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        """Load the trainer's weights into the engine in place and stamp what follows with ``version``.

        ``source`` is the trainer's causal LM (a ``transformers`` model, or a peft LoRA model around
        one) or its state dict (names as in the checkpoint). With ``weight_sync.check`` and a
        module, the probe self-check runs afterwards; it raises a ``RuntimeError`` (and the
        version is not bumped) when the weights did not arrive.
        """
        self._check_usable()
        source, is_module = weight_source(source, version, f"{self._who}.update_weights")
        self._prepare_sync(source, is_module)
        with self._lock:
            self._check_usable()
            check = self.check_weight_sync and is_module
            trainer_probe = self._start_trainer_probe(source) if check else None
            try:
                self._push(source, is_module, version)
            except BaseException:
                if trainer_probe is not None:
                    wait([trainer_probe])  # the module is the trainer's again before the error leaves
                raise
            trainer = trainer_probe.result() if trainer_probe is not None else None
            if check:
                self._verify_sync(source, trainer)
            else:  # no module to compare with: the check cannot run
                self._sync_check.reset()
            self.version = int(version)
        log.info(
            "%s: weights of version %d loaded (sync %s s, check max |diff| %s)",
            self._who,
            version,
            fmt(self.last_sync_time_s),
            fmt(self.last_sync_check_max_abs_diff),
        )

    def close(self) -> None:
        """Release the engine; a call in flight in another thread is woken with a ``RuntimeError``."""
        raise NotImplementedError

    def __enter__(self) -> VLLMEngineBase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks

    def _backend_stats(self) -> dict[str, float | None]:
        """The backend's own measurements for :meth:`stats`."""
        return {}

    def _prepare_generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> None:
        """Checks (and a lazy start or connect) before sampling; ``prompts`` is not empty."""

    def _sample(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int | None]
    ) -> tuple[list[list[RawSample]], int]:
        """The raw samples of each prompt, and the policy version of the weights that produced them."""
        raise NotImplementedError

    def _start_kept_set_records(self) -> bool:
        """Have the engine's workers record the kept sets (idempotent); whether they do."""
        return False

    def _prepare_sync(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool) -> None:
        """Checks (and a lazy connect) before a weight sync takes the lock."""

    def _push(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool, version: int) -> None:
        """Move the weights into the engine (under the lock); set ``last_sync_time_s``."""
        raise NotImplementedError

    def _probe(self, module: torch.nn.Module | None = None) -> list[int]:
        """The token ids of the self-check's probe sequence."""
        raise NotImplementedError

    def _engine_probe_logprobs(self, probe: list[int]) -> torch.Tensor:
        """The engine's temperature-1 logprob of each probe token given the ones before it (float64)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared checks

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._who} was closed: create a new engine to use it again.")
        if self._failure is not None:
            raise RuntimeError(f"{self._who} is unusable: {self._failure} Create a new engine.")

    def _check_length(self, longest: int, max_new_tokens: int, what_to_change: str) -> None:
        if self.max_model_len is not None and longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"{self._who}.generate: the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceeds max_model_len={self.max_model_len}; {what_to_change}."
            )

    def _completions(
        self, index: int, samples: list[RawSample], n: int, version: int, sampling: SamplingConfig
    ) -> list[Completion]:
        """Check the samples of prompt ``index`` (count, finish reason, logprobs, stop id, support) and wrap them."""
        who = self._who
        if len(samples) != n:
            raise RuntimeError(
                f"{who}: {self._backend} returned {len(samples)} completions for prompt {index}, expected {n}."
            )
        out = []
        for sample in samples:
            tokens, logprobs, reason = sample.token_ids, sample.logprobs, sample.finish_reason
            # INTERRUPTED is set by this kit's own backends (after an abort), never by vLLM itself.
            if reason not in ("stop", "length", INTERRUPTED):
                raise RuntimeError(
                    f"{who}: a completion of prompt {index} finished with {reason!r} "
                    f"(stop_reason={sample.stop_reason!r}); expected 'stop' or 'length'."
                )
            if logprobs is None or len(logprobs) != len(tokens) or any(lp is None for lp in logprobs):
                raise RuntimeError(f"{who}: {self._backend} returned no logprob for some generated tokens.")
            if reason == "stop" and tokens and tokens[-1] not in self.stop_ids:
                raise RuntimeError(
                    f"{who}: a completion of prompt {index} stopped on token {tokens[-1]} "
                    f"(stop_reason={sample.stop_reason!r}), not on a stop id {self.stop_ids}: the "
                    "engine adds stop tokens of its own; a server needs --generation-config vllm."
                )
            out.append(
                Completion(
                    prompt_index=index,
                    token_ids=[int(t) for t in tokens],
                    logprobs=[float(lp) for lp in logprobs],
                    finish_reason=reason,
                    policy_version=version,
                    sampling_support=self._support(index, sample, sampling),
                )
            )
        return out

    def _support(self, index: int, sample: RawSample, sampling: SamplingConfig) -> list[list[int] | None] | None:
        """The kept support of each token of ``sample`` under a sampling mask (``None`` without one).

        What the engine's workers recorded, where they record; else read from the top logprobs, and
        a token whose top logprobs do not show the whole kept set (a nucleus wider than
        ``support_logprobs``) gets ``None``: the rollout takes it out of the loss and counts it in
        ``rollout/support_unknown_frac``.
        """
        if not sampling.support_needed:
            return None
        if self.records_kept_sets:
            return self._recorded_support(index, sample)
        requested = support_request(sampling, self.support_logprobs)
        top = sample.top_logprobs
        if top is None or len(top) != len(sample.token_ids):
            raise RuntimeError(f"{self._who}: {self._backend} returned no top logprobs for some generated tokens.")
        support = []
        for position, (token, entries) in enumerate(zip(sample.token_ids, top, strict=True)):
            kept = kept_from_top(entries, requested, sampling.top_k, self._engine_vocab_size())
            if kept is not None and kept and int(token) not in kept:
                raise RuntimeError(
                    f"{self._who}: token {position} of a completion of prompt {index} ({token}) is not among the "
                    f"tokens {self._backend} reports as kept by top-k / top-p: its logprobs are not processed ones "
                    "(logprobs_mode must be 'processed_logprobs')."
                )
            support.append(kept)
        return support

    def _recorded_support(self, index: int, sample: RawSample) -> list[list[int] | None]:
        """The kept sets the worker recorded for ``sample``'s tokens (each holding its token)."""
        kept_sets = sample.kept_sets
        if kept_sets is None or len(kept_sets) < len(sample.token_ids):
            raise RuntimeError(
                f"{self._who}: the engine's worker recorded the kept sets of "
                f"{0 if kept_sets is None else len(kept_sets)} tokens of a completion of prompt {index}, which has "
                f"{len(sample.token_ids)}."
            )
        support: list[list[int] | None] = []
        for position, (token, kept) in enumerate(zip(sample.token_ids, kept_sets, strict=False)):
            if kept and int(token) not in kept:
                raise RuntimeError(
                    f"{self._who}: token {position} of a completion of prompt {index} ({token}) is not in the kept "
                    "set the engine's worker recorded for it: the records and the tokens are out of step."
                )
            support.append(kept)
        return support

    def _sampling_tags(self, sampling: SamplingConfig, count: int) -> list[str] | None:
        """Under a sampling mask with the workers recording, one fresh tag per request (``None`` otherwise)."""
        if not sampling.support_needed:
            return None
        if self.records_kept_sets is None:
            self.records_kept_sets = self._start_kept_set_records()
        if not self.records_kept_sets:
            return None
        return [f"{self._tag_prefix}-{next(self._tag_counter)}" for _ in range(count)]

    @staticmethod
    def _attach_kept_sets(
        samples: list[list[RawSample]], tags: list[str], taken: Mapping[str, Mapping[Any, list[str]]]
    ) -> None:
        """Give each sample the kept sets its worker recorded (``taken``: what ``lo_take_kept_sets`` answered;
        sample indices come back as strings over JSON)."""
        for prompt_samples, tag in zip(samples, tags, strict=True):
            recorded = {int(index): encoded for index, encoded in taken.get(tag, {}).items()}
            for index, sample in enumerate(prompt_samples):
                # Nothing recorded: right for a sample cut before its first token, an error otherwise.
                sample.kept_sets = decode_kept_sets(recorded[index]) if index in recorded else []

    def _top_logprobs(self, sampling: SamplingConfig) -> int:
        """How many top logprobs per token a request asks for (0 where the worker records the kept sets)."""
        return 0 if self.records_kept_sets else support_request(sampling, self.support_logprobs)

    def _engine_vocab_size(self) -> int | None:
        """The engine's vocabulary size, when known (a support of every token is then the whole vocabulary)."""
        return None

    def _probe_known(self) -> bool:
        """Whether :meth:`_probe` can answer before the push (the engine is up)."""
        return False

    def _start_trainer_probe(self, module: torch.nn.Module) -> Future[torch.Tensor] | None:
        """Score the probe with the trainer's module in a thread, while the push runs; ``None``: after it.

        The trainer's forward and the engine's load use different cores (or devices). Not for a
        sharded module: its forward gathers parameters with collectives, which must not interleave
        with the export's.
        """
        if not self._probe_known() or any(hasattr(p, "full_tensor") for p in module.parameters()):
            return None
        probe = self._probe(module)
        future: Future[torch.Tensor] = Future()

        def run() -> None:
            try:
                future.set_result(trainer_probe_logprobs(module, probe))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)

        threading.Thread(target=run, name=f"{self._who}-trainer-probe", daemon=True).start()
        return future

    def _verify_sync(self, module: torch.nn.Module, trainer: torch.Tensor | None = None) -> None:
        probe = self._probe(module)
        engine = self._engine_probe_logprobs(probe)
        if trainer is None:
            trainer = trainer_probe_logprobs(module, probe)
        self._sync_check(engine, trainer, sync_tolerance(self.compute_dtype, module, self.weight_sync_tolerance))
