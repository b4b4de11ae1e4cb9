"""A lean sampling loop for :class:`~lightning_offpolicy.rollout.hf.engine.HFEngine`: ``generate`` without its overhead.

``transformers``' ``generate`` rebuilds its inputs every step (``prepare_inputs_for_generation``,
``_update_model_kwargs_for_generation``: a new attention mask and new position ids by
concatenation), runs its logits-processor and stopping-criteria lists and keeps every step's
scores. This loop does the same computation with less around it, under ``torch.inference_mode``
(the engine enters it), and without the rows that have stopped (``benchmarks/generation.py``
measures both against ``generate``: docs/performance.md).

- the prefill sees what ``generate`` gives it for left-padded prompts: the attention mask, the
  position ids ``cumsum(mask) - 1`` with the padded positions set to 0, a ``DynamicCache`` built
  from the model's config, ``use_cache=True`` and ``logits_to_keep=1`` (where the model takes it);
- each step feeds one token per row with the next position, the attention mask grown by one
  column (a slice of one preallocated buffer instead of a concatenation);
- the last position's logits are cast to float32 and processed by ``transformers``' own
  ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``, in the order
  ``generate`` applies them and under the same conditions (temperature != 1, top_k != 0,
  top_p < 1); sampling is ``torch.multinomial(softmax(scores), 1)``, greedy is ``argmax``;
- a row that has produced a stop id leaves the batch: the next forward passes, its KV cache rows
  and its mask run over the rows still going, so a batch costs what its rows decode rather than
  its longest row times the batch. ``generate`` decodes every row to the end (pad after a stop);
  the loop still draws its tokens from a ``multinomial`` over the whole batch (the stopped rows
  with a certain token), the same draws of the same shapes, so the same seed gives ``generate``'s
  tokens, also across chunks. The loop ends when every row is done or ``max_new_tokens`` is reached.

The logprob of each sampled token is the log-softmax of the processed scores, as the ``generate``
path computes it; under top-k / top-p the tokens the warpers kept at each step (the finite
processed scores, :func:`kept_support`) come back with it, for the trainer to renormalize over.

:func:`lean_unsupported` says why a model cannot take this path (no cache, an
encoder-decoder, a generation config that adds logits processors ``generate`` would run): the
engine then falls back to ``generate``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

# Generation-config fields whose non-default values make ``generate`` do something this loop does
# not (more logits processors, other stopping criteria, another cache or decoding strategy).
_GENERATION_FIELDS = (
    "guidance_scale",
    "sequence_bias",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "top_h",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "watermarking_config",
    "renormalize_logits",
    "num_beams",
    "num_beam_groups",
    "penalty_alpha",
    "cache_implementation",
    "prefill_chunk_size",
    "max_time",
    "stop_strings",
    "num_return_sequences",
    "diversity_penalty",
    "constraints",
    "force_words_ids",
    "assistant_model",
    "prompt_lookup_num_tokens",
)


def lean_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take the lean loop (``None``: it can)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        return f"{type(model).__name__} has no config / generation_config (not a transformers causal LM)"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "the model's forward has no readable signature"
    needed = ("past_key_values", "attention_mask", "position_ids", "use_cache")
    missing = [name for name in needed if name not in parameters]
    if missing:
        return f"{type(model).__name__}.forward takes no {', '.join(missing)} (no KV cache to decode with)"
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic():
        return f"{type(model).__name__} does not support a DynamicCache"
    generation_config = model.generation_config
    if getattr(generation_config, "use_cache", True) is False:
        return "generation_config.use_cache is False"
    from transformers import GenerationConfig

    defaults = GenerationConfig()
    for name in _GENERATION_FIELDS:
        value = getattr(generation_config, name, None)
        if value != getattr(defaults, name, None):
            return f"generation_config.{name}={value!r} (generate would apply it; the lean loop does not)"
    return None


def _warpers(temperature: float, top_k: int, top_p: float) -> list[Any]:
    """The warpers ``generate`` builds for ``do_sample=True``, in its order, under its conditions."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers: list[Any] = []
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


def kept_support(scores: torch.Tensor) -> list[list[int]]:
    """Per row of processed ``[rows, V]`` scores, the ids the warpers kept (finite score); ``[]`` when all were.

    An empty list stands for the whole vocabulary: nothing to renormalize over, and no ``V`` ids to
    carry for a position that top-p left uncut.
    """
    kept = torch.isfinite(scores)
    counts = kept.sum(dim=-1).tolist()
    ids = kept.nonzero()[:, 1].tolist()
    vocab = scores.shape[-1]
    out, start = [], 0
    for count in counts:
        out.append([] if count == vocab else ids[start : start + count])
        start += count
    return out


def lean_sample(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    pad_token_id: int,
    stop_ids: list[int],
    greedy: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    should_stop: Callable[[], bool] | None = None,
    return_support: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[list[list[int]]] | None]:
    """Decode ``max_new_tokens`` (or until every row has stopped) from left-padded prompts.

    Returns ``(tokens, logprobs, support)``: ``tokens`` and ``logprobs`` are ``[rows, steps]`` on the
    CPU with ``steps <= max_new_tokens``, the tokens ``generate`` would return after the prompt (pad
    after a row's first stop id) and the log-softmax of the processed scores at each of them
    (float32); ``support`` is, under top-k / top-p, each row's :func:`kept_support` at each step
    (``None`` without them, greedy, or ``return_support=False``). Runs under the caller's grad mode
    and RNG state. ``should_stop`` is asked before every forward pass; when it says ``True`` the
    loop ends there (a partial rollout's interrupt), so a row that has no stop id and fewer than
    ``max_new_tokens`` tokens was cut short.
    """
    from transformers import DynamicCache

    device = input_ids.device
    rows, width = input_ids.shape
    warpers = [] if greedy else _warpers(temperature, top_k, top_p)
    truncating = not greedy and ((top_k or 0) > 0 or (top_p is not None and top_p < 1.0))
    support: list[list[list[int]]] | None = [[] for _ in range(rows)] if truncating and return_support else None
    takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    extra: dict[str, Any] = {"logits_to_keep": 1} if takes_logits_to_keep else {}

    # One buffer for the growing mask: step t sees its first width + t + 1 columns.
    mask = torch.ones((rows, width + max_new_tokens), dtype=attention_mask.dtype, device=device)
    mask[:, :width] = attention_mask
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    next_position = position_ids[:, -1:] + 1
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))

    tokens = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    # The rows still decoding, as indices into the batch: a row that stopped leaves the forward passes.
    active = torch.arange(rows, device=device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)

    def last_logits(ids: torch.Tensor, ids_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        outputs = model(
            input_ids=ids,
            attention_mask=ids_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
            **extra,
        )
        # A float32 copy, as generate takes it (no reference kept to the prefill's logits).
        return outputs.logits[:, -1].to(copy=True, dtype=torch.float32)

    steps = 0
    if should_stop is not None and should_stop():
        return tokens[:, :0].cpu(), logprobs[:, :0].cpu(), support
    scores = last_logits(input_ids, attention_mask, position_ids)
    for step in range(max_new_tokens):
        for warper in warpers:
            scores = warper(None, scores)
        next_tokens = torch.argmax(scores, dim=-1) if greedy else _draw(torch.softmax(scores, dim=-1), active, rows)
        tokens[active, step] = next_tokens
        logprobs[active, step] = torch.log_softmax(scores, dim=-1).gather(-1, next_tokens[:, None]).squeeze(-1)
        if support is not None:
            for row, kept in zip(active.tolist(), kept_support(scores), strict=True):
                support[row].append(kept)
        steps = step + 1
        if stop_ids:
            going = ~torch.isin(next_tokens, stops)
            if not bool(going.all()):
                if not bool(going.any()):
                    break
                # Drop the stopped rows from everything the next forward pass reads.
                keep = going.nonzero().squeeze(1)
                active, next_tokens = active[keep], next_tokens[keep]
                mask, next_position = mask[keep], next_position[keep]
                cache.reorder_cache(keep)
        if steps == max_new_tokens or (should_stop is not None and should_stop()):
            break
        scores = last_logits(next_tokens[:, None], mask[:, : width + steps], next_position)
        next_position = next_position + 1
    return tokens[:, :steps].cpu(), logprobs[:, :steps].cpu(), support


def _draw(probs: torch.Tensor, active: torch.Tensor, rows: int) -> torch.Tensor:
    """One token per active row from its ``probs``, with the random draws of a batch of all ``rows`` rows.

    ``torch.multinomial``'s draws depend on the shape it samples from, not on the values: sampling
    the whole batch (the rows that stopped get a certain token) keeps the random stream of
    ``generate``, which decodes every row to the end, so a seed gives its tokens whatever rows stop.
    """
    if active.numel() < rows:
        whole = probs.new_zeros((rows, probs.shape[-1]))
        whole[:, 0] = 1.0
        whole[active] = probs
        probs = whole
    drawn = torch.multinomial(probs, num_samples=1).squeeze(1)
    return drawn if active.numel() == rows else drawn[active]
