"""Log-probabilities of the response tokens under a Hugging Face causal LM, by the fused head or the logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_offpolicy.argcheck import is_int
from lightning_offpolicy.logprobs.checks import check_temperature_and_chunk
from lightning_offpolicy.logprobs.chunked import token_logprobs
from lightning_offpolicy.logprobs.head import fused_head_parts, fused_head_token_logprobs
from lightning_offpolicy.logprobs.packed import pack_rows, packed_response_logprobs, packing_refusal, packs_rows
from lightning_offpolicy.logprobs.support import check_support, over_support

__all__ = ["causal_lm_token_logprobs"]


def causal_lm_token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_start: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    fused_head: bool | None = None,
    sampling_support: Tensor | None = None,
    packed: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of the response tokens under a Hugging Face causal LM.

    The sequences are laid out as ``[left-padded prompt | right-padded response]``, ``L`` columns
    in all, the response starting at column ``response_start`` for every row. Position ids are
    ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``, so a row's first real token has position 0
    whatever its padding, as in an unpadded run.

    Two paths give the same values and gradients: the fused head (the default where the model
    qualifies; no ``[B, T, V]`` logits tensor is made) and the model's logits
    (docs/logprobs.md, "Two paths for a causal LM", says which models qualify and how each reads
    the sequence).

    Args:
        model: a transformers causal LM (``model(input_ids=..., attention_mask=...,
            position_ids=..., logits_to_keep=..., use_cache=False).logits``).
        input_ids: ``[B, L]`` token ids.
        attention_mask: ``[B, L]``, 1 for real tokens, 0 for padding.
        response_start: column where the responses start, ``1 <= response_start < L``.
        temperature, chunk_size, return_entropy: as in :func:`token_logprobs`.
        fused_head: ``None`` (default) uses the fused head when the model qualifies and the
            logits path otherwise; ``False`` always takes the logits path; ``True`` requires the
            fused head (also for a class outside ``FUSED_HEAD_ARCHITECTURES`` whose structure
            fits) and raises ``ValueError`` saying why when the model does not allow it.
        sampling_support: ``[B, L - response_start, K]`` ids the engine's top-k / top-p kept at
            each response position, padded with -1 (``RolloutBatch.sampling_support``). The
            logprobs are then those of the distribution renormalized over that support,
            ``z_t / T - logsumexp_{v in S}(z_v / T)``, and the entropy that of the renormalized
            distribution: what the engine sampled from. A position whose ids are all -1 keeps the
            whole vocabulary. Costs ``K + 1`` gathered columns per position, never a ``[.., V]``
            mask (docs/off_policy_correction.md, "Sampling masks").
        packed: Run the model on the real tokens alone, the rows concatenated into one sequence with
            position ids restarting per row and attention kept within each row
            (:mod:`~lightning_offpolicy.logprobs.packed`): the same values and gradients as the
            padded forward, at the cost of the real tokens. Needs a model that
            :func:`~lightning_offpolicy.logprobs.packed.packing_refusal` accepts, and at least one
            prompt token in every row.

    Returns:
        ``[B, L - response_start]`` float32 log-probabilities of the response tokens (and the
        entropy, with its gradient, with ``return_entropy``). Columns of right padding hold the
        log-probability of the pad token (0 with ``packed``); mask them with
        ``attention_mask[:, response_start:]``.

    Raises:
        TypeError / ValueError: for a bad argument (the message names it); ``ValueError`` also when
            ``fused_head=True`` and the head cannot be fused, or ``packed=True`` and the model cannot
            be packed (the message says why).
        RuntimeError: the model returned hidden states or logits of an unexpected shape.
    """
    temperature = check_temperature_and_chunk(temperature, chunk_size)
    if fused_head is not None and not isinstance(fused_head, bool):
        raise TypeError(f"fused_head must be None, True or False, got {fused_head!r}.")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [B, L] torch.Tensor.")
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must be a tensor of the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask)}."
        )
    seq_len = input_ids.shape[1]
    if not is_int(response_start):
        raise TypeError(f"response_start must be an int, got {type(response_start).__name__}.")
    if not 1 <= response_start < seq_len:
        raise ValueError(
            f"response_start must satisfy 1 <= response_start < L = {seq_len} (at least one prompt "
            f"column and one response column), got {response_start}."
        )
    response_start = int(response_start)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    response_ids = input_ids[:, response_start:]
    targets, full_entropy = response_ids, return_entropy
    if sampling_support is not None:
        check_support(sampling_support, tuple(response_ids.shape))
        targets = torch.cat([response_ids.unsqueeze(-1), sampling_support.clamp(min=0)], dim=-1)
        # The full distribution's entropy is needed only where a response position kept everything.
        uncut = ~(sampling_support >= 0).any(-1) & attention_mask[:, response_start:].bool()
        full_entropy = return_entropy and bool(uncut.any())

    if not isinstance(packed, bool):
        raise TypeError(f"packed must be True or False, got {packed!r}.")
    parts: Any = "fused_head=False"
    if fused_head is not False:
        parts = fused_head_parts(model, force=fused_head is True)
        if fused_head is True and isinstance(parts, str):
            raise ValueError(f"fused_head=True, but the head of this model cannot be fused: {parts}.")
    if packed:
        refusal = packing_refusal(model)
        if refusal is not None:
            raise ValueError(f"packed=True, but this model cannot run packed sequences: {refusal}.")
        # Rows no wider than the padded batch where the attention allows several (the fused head reads
        # any layout): attention then costs the square of a row, not of the whole micro-batch.
        several = not isinstance(parts, str) and packs_rows(model)
        layout = pack_rows(input_ids, attention_mask, response_start, width=seq_len if several else None)
        # Without a single response token the packed forward would reach no parameter; the padded
        # one (cheap then) keeps every parameter in the graph, as a backward expects.
        if layout.source.numel():
            flat_support = None if sampling_support is None else layout.gather(sampling_support)
            flat = packed_response_logprobs(
                model,
                None if isinstance(parts, str) else parts,
                layout,
                layout.gather(targets),
                temperature,
                chunk_size,
                full_entropy,
            )
            flat = over_support(flat, flat_support, return_entropy, full_entropy)
            shape = tuple(response_ids.shape)
            if return_entropy:
                return layout.scatter(flat[0], shape), layout.scatter(flat[1], shape)
            return layout.scatter(flat, shape)
    if not isinstance(parts, str):
        decoder, head = parts
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"the decoder returned hidden states of shape {tuple(hidden.shape)}; expected [B, L, H] "
                f"with [B, L] = {tuple(input_ids.shape)}."
            )
        # Positions response_start - 1 .. L - 2 predict the response tokens; the slice is copied
        # once by the reshape inside ([B, T, H]: small next to the logits it replaces).
        result = fused_head_token_logprobs(
            head,
            hidden[:, response_start - 1 : -1],
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=full_entropy,
        )
        return over_support(result, sampling_support, return_entropy, full_entropy)

    keep = seq_len - response_start + 1
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=keep,
        use_cache=False,
    )
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits.dim() != 3 or logits.shape[0] != input_ids.shape[0] or logits.shape[1] < keep:
        raise RuntimeError(
            f"model returned logits of shape {tuple(logits.shape)}; expected [B, >= {keep}, V] (logits_to_keep={keep})."
        )
    if logits.shape[1] > keep:  # a model that ignores logits_to_keep: correct, but not lean (copy)
        logits = logits[:, -keep:]
    padded = targets.new_zeros((targets.shape[0], keep, *targets.shape[2:]))
    padded[:, :-1] = targets
    res = token_logprobs(logits, padded, temperature, chunk_size, full_entropy)
    if full_entropy:
        lp, ent = res
        result: Tensor | tuple[Tensor, Tensor] = (lp[:, :-1].contiguous(), ent[:, :-1].contiguous())
    else:
        result = res[:, :-1].contiguous()
    return over_support(result, sampling_support, return_entropy, full_entropy)
