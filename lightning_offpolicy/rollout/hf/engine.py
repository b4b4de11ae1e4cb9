"""The embedded engine: ``transformers`` ``generate`` in the trainer's own process.

Used by the quickstart, the tests and anyone without vLLM. By default it shares the trainer's
module (no copy, no weight transfer): generation runs with exactly the weights of the current
step. With ``dtype="bfloat16"`` it keeps its own bfloat16 copy instead, refreshed at every
``update_weights``: the precision gap of a real inference engine, on a laptop. Its logprobs are
those of the distribution it sampled from: ``generate`` returns the processed scores
(temperature, top-k and top-p applied, filtered tokens at ``-inf``), and the logprob of each
sampled token is read from their log-softmax. Under top-k / top-p each completion also carries the
tokens kept at each position (``Completion.sampling_support``: the finite processed scores), so
the trainer scores ``pi_prox`` / ``pi_theta`` over the same support. ``SamplingConfig(greedy=True)``
decodes by argmax (``do_sample=False``), for evaluation.

By default (``sampler="lean"``) the engine does not call ``generate`` but the lean loop of
:mod:`lightning_offpolicy.rollout.hf.sampling`: the same forward passes, warpers and sampling
calls, hence the same tokens and logprobs for the same seed, without ``generate``'s per-step
bookkeeping. Models the loop cannot drive (no KV cache, an encoder-decoder, a generation config
that adds logits processors) fall back to ``generate``, with the reason in a debug log;
``sampler="generate"`` always uses it.

:meth:`HFEngine.interrupt` (thread-safe) cuts the ``generate`` call in flight short before its
next forward pass: the rows that have not stopped come back
:data:`~lightning_offpolicy.rollout.engine.INTERRUPTED` with the tokens sampled so far (partial
rollouts, :mod:`lightning_offpolicy.rollout.partial`).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from typing import Any, Literal

import torch

from lightning_offpolicy.rollout.engine import (
    INTERRUPTED,
    Completion,
    SamplingConfig,
    SpecialTokens,
    checked_prompts,
    checked_token_ids,
    first_stop,
)
from lightning_offpolicy.rollout.hf.sampling import kept_support, lean_sample, lean_unsupported

log = logging.getLogger(__name__)

SAMPLERS = ("lean", "generate")


class HFEngine(SpecialTokens):
    """Sample with a ``transformers`` causal LM in the current process.

    Args:
        dtype: Precision of the engine's weights: ``None`` shares the trainer's module as it is;
            ``"bfloat16"`` / ``"float16"`` / ``"float32"`` keep a private copy in that dtype.
        max_batch_size: Most sequences per ``generate`` call (0: all at once).
        pad_token_id: Padding id for batched generation (prompts are left-padded); ``None``: set
            by the ``RolloutCallback`` from the module's tokenizer.
        eos_token_id: Stop token id; ``None``: from the module's tokenizer.
        stop_token_ids: More ids that end a completion besides ``eos_token_id``; ``None``: the eos
            ids the model's generation config lists (set by the ``RolloutCallback``); ``[]``: none.
        sampler: ``"lean"`` (default): the lean decoding loop of
            :mod:`~lightning_offpolicy.rollout.hf.sampling` (same tokens and logprobs as
            ``generate`` for the same seed, less overhead per step), falling back to ``generate``
            for a model it cannot drive; ``"generate"``: ``transformers``' ``generate``.
    """

    def __init__(
        self,
        dtype: Literal["bfloat16", "float16", "float32"] | None = None,
        max_batch_size: int = 0,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        sampler: Literal["lean", "generate"] = "lean",
    ) -> None:
        if dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"HFEngine.dtype={dtype!r} is not known; allowed: None, 'bfloat16', 'float16', 'float32'.")
        if max_batch_size < 0:
            raise ValueError(f"HFEngine.max_batch_size={max_batch_size} must be >= 0 (0: no limit).")
        if sampler not in SAMPLERS:
            raise ValueError(f"HFEngine.sampler={sampler!r} is not known; allowed: {', '.join(map(repr, SAMPLERS))}.")
        self.sampler = sampler
        self._lean_inference_mode = True  # False: the lean loop under no_grad only (benchmarks/generation.py)
        self.dtype = dtype
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = (
            None if stop_token_ids is None else checked_token_ids(stop_token_ids, "HFEngine.stop_token_ids")
        )
        self.max_batch_size = max_batch_size
        self.model: torch.nn.Module | None = None
        self.version = 0
        # Set by interrupt(), consumed by the generate call it cuts short (HFProcessEngine swaps in a
        # multiprocessing event its child process shares).
        self._interrupt: Any = threading.Event()

    def interrupt(self) -> None:
        """Make the ``generate`` call in flight (or the next one) return before its next forward pass."""
        self._interrupt.set()

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callbacks with their engine: an event does not pickle, and a pending
        # interrupt means nothing in another process.
        state = dict(self.__dict__)
        state["_interrupt"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._interrupt = threading.Event()

    @property
    def share_weights(self) -> bool:
        return self.dtype is None

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        if isinstance(source, torch.nn.Module):
            check_shareable(source, f"HFEngine(dtype={self.dtype!r})", copies=not self.share_weights)
            if self.share_weights:
                self.model = source
            elif self.model is None:
                self.model = copy.deepcopy(source).requires_grad_(False).to(getattr(torch, self.dtype))
            else:
                self.model.load_state_dict(source.state_dict())
        else:
            if self.model is None:
                raise ValueError("HFEngine.update_weights got a state dict before any model; pass the module first.")
            self.model.load_state_dict(dict(source))
        self.version = version

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("HFEngine has no weights yet: call update_weights(module, version) first.")
        if self.pad_token_id is None or self.eos_token_id is None:
            raise RuntimeError("HFEngine needs pad_token_id and eos_token_id (or set_special_tokens(...)).")
        prompt_ids = checked_prompts(prompt_ids, "HFEngine.generate")
        rows = [i for i in range(len(prompt_ids)) for _ in range(sampling.samples_per_prompt)]
        chunk = self.max_batch_size or len(rows)
        completions: list[Completion] = []
        model = self.model
        lean = self._use_lean(model)
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=_rng_devices(model)):
                if seed is not None:
                    torch.manual_seed(seed)
                for start in range(0, len(rows), chunk):
                    completions += self._generate_rows(model, prompt_ids, rows[start : start + chunk], sampling, lean)
        finally:
            model.train(was_training)
            self._interrupt.clear()  # consumed by this call
        return completions

    def _use_lean(self, model: torch.nn.Module) -> bool:
        if self.sampler != "lean":
            return False
        reason = lean_unsupported(model)
        if reason is not None:
            log.debug("HFEngine: sampling with generate instead of the lean loop: %s.", reason)
        return reason is None

    def _generate_rows(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        rows: list[int],
        sampling: SamplingConfig,
        lean: bool = False,
    ) -> list[Completion]:
        device = next(model.parameters()).device
        width = max(len(prompt_ids[i]) for i in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for r, i in enumerate(rows):
            input_ids[r, width - len(prompt_ids[i]) :] = torch.tensor(prompt_ids[i])
            attention_mask[r, width - len(prompt_ids[i]) :] = 1
        if lean:
            # inference_mode rather than no_grad: less dispatch per op (measured: benchmarks/generation.py).
            # Nothing created inside outlives the call but lists of python numbers. Not for a sharded
            # (FSDP2) module: its unshard writes to parameters, which inference tensors refuse.
            with torch.inference_mode(self._lean_inference_mode and not is_sharded(model)):
                generated, logprobs, support = lean_sample(
                    model,
                    input_ids.to(device),
                    attention_mask.to(device),
                    max_new_tokens=sampling.max_new_tokens,
                    pad_token_id=self.pad_token_id,
                    stop_ids=self.stop_ids,
                    greedy=sampling.greedy,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    should_stop=self._interrupt.is_set,
                    return_support=sampling.support_needed,
                )
        elif self._interrupt.is_set():  # generate always takes a step: interrupted before it began
            generated = torch.full((len(rows), 0), self.pad_token_id, dtype=torch.long)
            logprobs = torch.zeros((len(rows), 0))
            support = [[] for _ in rows] if sampling.support_needed else None
        else:
            generated, logprobs, support = self._hf_generate(model, input_ids, attention_mask, sampling, device)
        token_rows = generated.tolist()
        logprob_rows = logprobs.tolist()
        completions = []
        for r, i in enumerate(rows):
            tokens = token_rows[r]
            length, reason = first_stop(tokens, self.stop_ids)
            if reason == "length" and length < sampling.max_new_tokens:  # the loop ended early: interrupted
                reason = INTERRUPTED
            completions.append(
                Completion(
                    prompt_index=i,
                    token_ids=tokens[:length],
                    logprobs=logprob_rows[r][:length],
                    finish_reason=reason,
                    policy_version=self.version,
                    sampling_support=None if support is None else support[r][:length],
                )
            )
        return completions

    def _hf_generate(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingConfig,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[list[int]]] | None]:
        """``generate``'s tokens after the prompt and the logprobs of its processed scores, ``[rows, steps]``,
        and under top-k / top-p each row's kept ids per step (``hf_sampling.kept_support``)."""
        width = input_ids.shape[1]
        if sampling.greedy:
            decoding: dict[str, Any] = {"do_sample": False}  # argmax; the scores are the raw logits
        else:
            decoding = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,  # 0 disables it (None would fall back to the model's default of 50)
                "top_p": sampling.top_p,
            }
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            **decoding,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.stop_ids,  # every stop id: generate pads a row after the first one it samples
            output_scores=True,
            return_dict_in_generate=True,
            stopping_criteria=_interrupt_criteria(self._interrupt),
        )
        generated = out.sequences[:, width:]
        # Processed scores: the distribution actually sampled from, one [rows, V] tensor per step.
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        support = None
        if sampling.support_needed:
            per_step = [kept_support(step_scores) for step_scores in out.scores]
            support = [[step[r] for step in per_step] for r in range(generated.shape[0])]
        return generated.cpu(), logprobs.cpu(), support

    def close(self) -> None:
        self.model = None


def _interrupt_criteria(event: Any) -> Any:
    """A stopping criterion that ends ``generate`` for every row once ``event`` is set."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupted(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), event.is_set(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Interrupted()])


def _rng_devices(model: torch.nn.Module) -> list[Any]:
    device = next(model.parameters()).device
    return [device] if device.type == "cuda" else []


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor (FSDP2-sharded) parameters."""
    return any(hasattr(p, "full_tensor") for p in module.parameters())


def check_shareable(source: torch.nn.Module, engine: str, copies: bool) -> None:
    """Refuse a sharded (FSDP2) policy where an HF engine cannot sample from it.

    Raises:
        ValueError: ``copies`` (the engine keeps its own copy): a sharded module cannot be deep-copied.
            Sampling from a module sharded over several ranks: every forward is a collective, and
            ranks whose completions end at different steps would wait on each other for ever.
    """
    if not is_sharded(source):
        return
    if copies:
        raise ValueError(
            f"{engine} keeps its own copy of the policy, and a policy sharded by FSDP2 (ModelParallelStrategy) "
            "cannot be copied. Use VLLMEngine (it receives the gathered weights), or HFEngine(dtype=None), which "
            "samples from the sharded module itself on a single device."
        )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        raise ValueError(
            f"{engine} cannot sample from a policy sharded over {world} ranks: every forward gathers the shards "
            "from all ranks, and ranks whose completions end at different steps would wait on each other for "
            "ever. Use VLLMEngine (one engine per rank, fed the gathered weights)."
        )
