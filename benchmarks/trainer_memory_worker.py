"""The trainer-memory cases and the subprocess that measures one: a model, a module, one fit of one batch."""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# benchmarks/*.py run as scripts: their directory is on sys.path, and with it the shared harness.
from harness.memory import peak_bytes, reset_peak, rss_bytes


@dataclass(frozen=True)
class ModelSpec:
    """A Llama built from a config (random weights) and the rollout batch one step trains on."""

    name: str
    config: dict[str, int]  # overrides of lightning_offpolicy.demo.tiny.tiny_llama_config
    rows: int
    prompt_len: int
    response_len: int


MODELS = {
    # The quickstart's model and batch: 16 prompts x 8 samples, ~10-character prompts, 8 new tokens.
    "tiny": ModelSpec("tiny", {"vocab_size": 64}, rows=128, prompt_len=12, response_len=8),
    # ~168M parameters (33M of them in each of the embedding and the untied lm_head). 16 rows of
    # 32 + 96 tokens = 2048 tokens per step (1024 per optimizer step): about a minute per case on
    # one core; enough tokens that activations and logits are visible next to the weights' state.
    "llama-168m": ModelSpec(
        "llama-168m",
        {
            "vocab_size": 32000,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 64,
            "max_position_embeddings": 512,
        },
        rows=16,
        prompt_len=32,
        response_len=96,
    ),
}


@dataclass(frozen=True)
class Case:
    """One trainer configuration."""

    key: str
    name: str
    lora_rank: int
    reference: str  # "none", "frozen_copy" or "disable_adapter"
    logprobs: str  # "lean" or "naive"


CASES = [
    Case("full", "full", 0, "none", "lean"),
    Case("full_ref", "full + frozen_copy", 0, "frozen_copy", "lean"),
    Case("lora", "lora16", 16, "none", "lean"),
    Case("lora_ref", "lora16 + disable_adapter", 16, "disable_adapter", "lean"),
    Case("full_ref_naive", "full + frozen_copy, naive logprobs", 0, "frozen_copy", "naive"),
    Case("lora_ref_naive", "lora16 + disable_adapter, naive logprobs", 16, "disable_adapter", "naive"),
]
NUM_MINIBATCHES = 2
REF_KL_COEF = 0.001
#: glibc's mmap threshold in the workers (bytes). Pinning it (which also turns off glibc's dynamic
#: threshold, that rises up to 32 MiB) makes every block >= 64 KiB an mmap, unmapped when freed:
#: RSS then follows the live memory, and the cases can be compared to within a few MB.
PINNED_MMAP_THRESHOLD = 65536
#: Cases measured a second time under glibc's default allocator settings (what `top` shows).
DEFAULT_MALLOC_CASES = ("full_ref", "lora_ref")
LEARNING_RATE = 1e-6


def _malloc_trim() -> None:
    """Give freed heap memory back to the kernel, so the baseline is not inflated by a warm-up's leftovers."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _naive_token_logprobs(
    logits: Any, targets: Any, temperature: float = 1.0, chunk_size: int = 1024, return_entropy: bool = False
) -> Any:
    """The textbook path ``token_logprobs`` replaces (``chunk_size`` is ignored)."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.long()[..., None]).squeeze(-1)
    if not return_entropy:
        return lp
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _identity(x: Any) -> Any:
    return x


def _build_model(spec: ModelSpec, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from lightning_offpolicy.demo.tiny import tiny_llama_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**spec.config)).to(torch.float32).eval()


def _make_rollout(spec: ModelSpec, seed: int = 0) -> Any:
    import torch

    from lightning_offpolicy.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    vocab = spec.config["vocab_size"]
    prompts = torch.randint(3, vocab, (spec.rows, spec.prompt_len), generator=gen).tolist()
    responses = torch.randint(3, vocab, (spec.rows, spec.response_len), generator=gen).tolist()
    rollout_lp = (-torch.rand(spec.rows, spec.response_len, generator=gen) * 4.0).tolist()
    return RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=torch.rand(spec.rows, generator=gen),
        advantages=torch.randn(spec.rows, generator=gen),
        group_ids=[i // 8 for i in range(spec.rows)],
        policy_versions=[0] * spec.rows,
        rollout_logprobs=rollout_lp,
        pad_token_id=0,
    )


def _make_module(model: Any, case: Case) -> Any:
    from functools import partial

    import torch

    from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig
    from lightning_offpolicy.data.tokenizers import CharTokenizer
    from lightning_offpolicy.lightning.module import OffPolicyRLModule

    with_ref = case.reference != "none"
    return OffPolicyRLModule(
        model=model,
        tokenizer=CharTokenizer(),  # required with a model instance; unused when fed RolloutBatch directly
        optimizer=partial(torch.optim.AdamW, lr=LEARNING_RATE),
        correction=OffPolicyCorrectionConfig(tis_level="token", tis_clip_high=2.0),
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, ref_kl_coef=REF_KL_COEF if with_ref else 0.0),
        num_minibatches=NUM_MINIBATCHES,
        max_tokens_per_microbatch=2048,
        reference=case.reference if with_ref else "auto",
        lora_rank=case.lora_rank,
    )


def _fit_one_batch(module: Any, rollout: Any, on_batch_end: Callable[[], None] | None = None) -> None:
    import lightning as L
    from harness.fit import bare_trainer
    from torch.utils.data import DataLoader

    callbacks = []
    if on_batch_end is not None:

        class _After(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                on_batch_end()

        callbacks.append(_After())
    trainer = bare_trainer(module.optimizer_steps_per_batch, callbacks)
    trainer.fit(module, DataLoader([rollout], batch_size=None, collate_fn=_identity))
    if trainer.global_step != module.optimizer_steps_per_batch:
        raise RuntimeError(f"{trainer.global_step} optimizer steps, expected {module.optimizer_steps_per_batch}")


def _numel(model: Any, trainable: bool | None = None) -> int:
    if model is None:
        return 0
    return sum(p.numel() for p in model.parameters() if trainable is None or p.requires_grad == trainable)


def worker(model_name: str, case_key: str, threads: int) -> dict[str, Any]:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    spec = MODELS[model_name]
    case = next(c for c in CASES if c.key == case_key)
    if case.logprobs == "naive":
        import lightning_offpolicy.logprobs.causal_lm as causal_lm_module

        causal_lm_module.token_logprobs = _naive_token_logprobs

    # 1. Warm-up: the same case, one whole step, on the tiny model.
    warm = MODELS["tiny"]
    _fit_one_batch(_make_module(_build_model(warm, seed=1), case), _make_rollout(warm, seed=1))
    gc.collect()
    _malloc_trim()

    # 2. The measured model and its batch, then the baseline.
    model = _build_model(spec)
    rollout = _make_rollout(spec)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    _malloc_trim()
    baseline = rss_bytes()

    # 3. Module (peft wrapping, reference copy) and one fitted batch, under a reset peak counter.
    reset_ok = reset_peak()
    module = _make_module(model, case)
    setup = rss_bytes() - baseline
    held: list[int] = []
    started = time.perf_counter()
    _fit_one_batch(module, rollout, on_batch_end=lambda: held.append(rss_bytes() - baseline))
    seconds = time.perf_counter() - started
    peak = peak_bytes(reset_ok) - baseline

    trainable = _numel(module.policy, trainable=True)
    reference = _numel(module.reference_model)
    minibatch_rows = spec.rows // NUM_MINIBATCHES
    return {
        "model": spec.name,
        "case": case.key,
        "label": case.name,
        "lora_rank": case.lora_rank,
        "reference": case.reference,
        "logprobs": case.logprobs,
        "params": _numel(module.policy),
        "base_params": sum(p.numel() for n, p in module.policy.named_parameters() if "lora_" not in n),
        "trainable_params": trainable,
        "reference_params": reference,
        "param_bytes": param_bytes,
        "state_bytes_analytic": trainable * 4 * 3 + reference * 4,
        # One optimizer step's logits: [rows / num_minibatches, response + 1, V] float32.
        "logits_bytes": minibatch_rows * (spec.response_len + 1) * spec.config["vocab_size"] * 4,
        "rows": spec.rows,
        "prompt_len": spec.prompt_len,
        "response_len": spec.response_len,
        "tokens": spec.rows * (spec.prompt_len + spec.response_len),
        "baseline_rss": baseline,
        "setup_extra": setup,
        "held_extra": held[-1] if held else 0,
        "peak_extra": peak,
        "peak_reset": reset_ok,
        "step_s": seconds,
        "threads": torch.get_num_threads(),
        "malloc": "pinned" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default",
    }
