"""The embedded engine: ``transformers`` ``generate`` in the trainer's own process.

Used by the quickstart, the tests and anyone without vLLM. By default it shares the trainer's
module (no copy, no weight transfer): generation runs with exactly the weights of the current
step. With ``dtype="bfloat16"`` it keeps its own bfloat16 copy instead, refreshed at every
``update_weights``: the precision gap of a real inference engine, on a laptop. Its logprobs are
those of the distribution it sampled from: ``generate`` returns the processed scores
(temperature, top-k and top-p applied, filtered tokens at ``-inf``), and the logprob of each
sampled token is read from their log-softmax. ``SamplingConfig(greedy=True)`` decodes by argmax
(``do_sample=False``), for evaluation.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

import torch

from lightning_offpolicy.rollout.engine import (
    Completion,
    SamplingConfig,
    SpecialTokens,
    checked_prompts,
    checked_token_ids,
    first_stop,
)


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
    """

    def __init__(
        self,
        dtype: Literal["bfloat16", "float16", "float32"] | None = None,
        max_batch_size: int = 0,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        if dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"HFEngine.dtype={dtype!r} is not known; allowed: None, 'bfloat16', 'float16', 'float32'.")
        if max_batch_size < 0:
            raise ValueError(f"HFEngine.max_batch_size={max_batch_size} must be >= 0 (0: no limit).")
        self.dtype = dtype
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = (
            None if stop_token_ids is None else checked_token_ids(stop_token_ids, "HFEngine.stop_token_ids")
        )
        self.max_batch_size = max_batch_size
        self.model: torch.nn.Module | None = None
        self.version = 0

    @property
    def share_weights(self) -> bool:
        return self.dtype is None

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> None:
        if isinstance(source, torch.nn.Module):
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
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=_rng_devices(model)):
                if seed is not None:
                    torch.manual_seed(seed)
                for start in range(0, len(rows), chunk):
                    completions += self._generate_rows(model, prompt_ids, rows[start : start + chunk], sampling)
        finally:
            model.train(was_training)
        return completions

    def _generate_rows(
        self, model: torch.nn.Module, prompt_ids: list[list[int]], rows: list[int], sampling: SamplingConfig
    ) -> list[Completion]:
        device = next(model.parameters()).device
        width = max(len(prompt_ids[i]) for i in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for r, i in enumerate(rows):
            input_ids[r, width - len(prompt_ids[i]) :] = torch.tensor(prompt_ids[i])
            attention_mask[r, width - len(prompt_ids[i]) :] = 1
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
        )
        generated = out.sequences[:, width:]
        # Processed scores: the distribution actually sampled from, one [rows, V] tensor per step.
        scores = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        completions = []
        for r, i in enumerate(rows):
            tokens = generated[r].tolist()
            length, reason = first_stop(tokens, self.stop_ids)
            completions.append(
                Completion(
                    prompt_index=i,
                    token_ids=tokens[:length],
                    logprobs=logprobs[r, :length].tolist(),
                    finish_reason=reason,
                    policy_version=self.version,
                )
            )
        return completions

    def close(self) -> None:
        self.model = None


def _rng_devices(model: torch.nn.Module) -> list[Any]:
    device = next(model.parameters()).device
    return [device] if device.type == "cuda" else []
