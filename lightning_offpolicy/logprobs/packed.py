"""Packed, padding-free forwards: the sequences of a padded batch laid end to end.

A padded ``[B, L]`` batch costs ``B x L`` token positions in every layer; packed, it costs the real
tokens alone. :func:`pack_rows` lays the real tokens of every sequence end to end, in one row (batch
dimension 1) or in rows no wider than the padded batch, with ``position_ids`` restarting at 0 for
each sequence. transformers reads that layout from the position ids
(``masking_utils.find_packed_sequence_indices`` for ``eager`` / ``sdpa`` / ``flex_attention``, in
every row; ``_is_packed_sequence`` and varlen kernels for ``flash_attention_*``, in a batch of one
row) when no 2-D attention mask is given, and keeps attention within each sequence, as
``DataCollatorWithFlattening`` relies on. :func:`packed_response_logprobs` runs that forward for
:func:`~lightning_offpolicy.logprobs.causal_lm.causal_lm_token_logprobs`, which puts the response
logprobs back in the padded ``[B, T]`` layout the correction and the loss read. :func:`packing_refusal`
says whether a model can be trusted with it, :func:`packs_rows` whether in several rows
(docs/training.md, "Packed micro-batches").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_offpolicy.logprobs.chunked import token_logprobs
from lightning_offpolicy.logprobs.head import fused_head_token_logprobs

__all__ = [
    "PACKED_ARCHITECTURES",
    "PACKED_ATTENTION",
    "ROW_WISE_ATTENTION",
    "PackedRows",
    "pack_rows",
    "packed_response_logprobs",
    "packing_refusal",
    "packs_rows",
]

#: transformers causal-LM classes whose decoder builds its attention mask with ``create_causal_mask``
#: (or the sliding-window variant) from the ``position_ids`` it is given and passes them on to the
#: attention function (checked in transformers 5.x). Other classes are never packed: their decoder
#: could attend across the packed sequences.
PACKED_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Olmo2ForCausalLM",
    }
)

#: ``config._attn_implementation`` values that keep attention within each packed sequence: the
#: mask-building ones read the sequence boundaries from the position ids, the flash kernels run
#: varlen on them. Hub kernels and paged attention are not among them.
PACKED_ATTENTION: frozenset[str] = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)

#: Of those, the implementations that build the mask of every row of a batch from its own position ids
#: (``find_packed_sequence_indices``), so sequences may be packed into several rows. The flash ones find
#: packed sequences only in a batch of one row (``_is_packed_sequence``): one row for them.
ROW_WISE_ATTENTION: frozenset[str] = frozenset({"eager", "sdpa", "flex_attention"})


def packing_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot run packed forwards, or ``None`` when it can.

    Args:
        model: A transformers causal LM, or a peft model with adapters injected into one (LoRA).

    Returns:
        ``None``: the class is in :data:`PACKED_ARCHITECTURES` and its attention implementation in
        :data:`PACKED_ATTENTION`. Otherwise a sentence saying why not.
    """
    base = model
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and hasattr(model, "get_base_model"):
        if getattr(peft_config, "is_prompt_learning", False):
            return "it is a peft prompt-learning model (its forward adds virtual tokens)"
        base = model.get_base_model()
    name = _model_class(base).__name__
    if name not in PACKED_ARCHITECTURES:
        return (
            f"{name} is not in lightning_offpolicy.logprobs.packed.PACKED_ARCHITECTURES (transformers causal LMs whose "
            "attention is known to stay within each sequence of a packed row)"
        )
    implementation = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        return (
            f"its attention implementation {implementation!r} is not one that keeps packed sequences apart "
            f"({', '.join(sorted(PACKED_ATTENTION))})"
        )
    return None


def packs_rows(model: nn.Module) -> bool:
    """Whether ``model`` (one :func:`packing_refusal` accepts) keeps packed sequences apart in several rows too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "config", None), "_attn_implementation", None) in ROW_WISE_ATTENTION


def _model_class(model: nn.Module) -> type:
    """The model's class; under FSDP2 the class ``fully_shard`` derived its own from (``FSDPLlamaForCausalLM``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return type(model)
    if not isinstance(model, FSDPModule):
        return type(model)
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of a padded batch packed into rows, and where its response tokens come from and go back.

    Attributes:
        input_ids: ``[R, W]`` the real tokens (``attention_mask == 1``), each sequence whole and contiguous
            in one row, sequences end to end; a row's cells after its last sequence hold 0.
        position_ids: ``[R, W]`` each token's position within its own sequence (0 at its first real
            token); cells after a row's last sequence hold their column index (they see no real token's
            output: a real token attends only to earlier cells).
        source: ``[M]`` for each real response token, the flat index (into ``R * W``) of the token that
            predicts it (the real token before it in its sequence).
        rows: ``[M]`` the padded row of each real response token.
        columns: ``[M]`` its response column (``0 .. T - 1``).
    """

    input_ids: Tensor
    position_ids: Tensor
    source: Tensor
    rows: Tensor
    columns: Tensor

    def scatter(self, values: Tensor, shape: tuple[int, int]) -> Tensor:
        """``[M]`` per-response-token ``values`` in the padded ``[B, T]`` layout (0 at padding), gradient kept."""
        return values.new_zeros(shape).index_put((self.rows, self.columns), values)

    def gather(self, padded: Tensor) -> Tensor:
        """The ``[M, ...]`` real response positions of a ``[B, T, ...]`` per-token tensor."""
        return padded[self.rows, self.columns]


def pack_rows(input_ids: Tensor, attention_mask: Tensor, response_start: int, width: int | None = None) -> PackedRows:
    """Pack the real tokens of ``[B, L]`` rows end to end, with per-sequence position ids.

    The position of a real token is its index among its row's real tokens, as the padded forward
    gives it (``attention_mask.cumsum(-1) - 1``), so each sequence's hidden states are those of the
    padded forward. A response token is predicted by the real token before it in its sequence.

    Args:
        input_ids: ``[B, L]`` token ids, ``[left-padded prompt | right-padded response]``.
        attention_mask: ``[B, L]``, 1 on real tokens.
        response_start: The column where the responses start.
        width: ``None``: every sequence in one row (``R = 1``, ``W`` = the real tokens). Else rows at
            most ``max(width, longest sequence)`` wide, filled first-fit by decreasing length: attention
            over a row then costs ``W^2`` instead of the square of the whole micro-batch, for a little
            padding at the rows' ends.

    Returns:
        The packed rows and their index maps.

    Raises:
        ValueError: A row's first real token is a response token (nothing before it to predict it).
    """
    real = attention_mask.bool()
    positions = attention_mask.long().cumsum(-1) - 1
    lengths = real.sum(-1).tolist()
    row_of, offset, used = _first_fit(lengths, width)
    cells = max(used)
    start = torch.tensor([r * cells + o for r, o in zip(row_of, offset, strict=True)], device=real.device)
    # Flat packed index of every real cell: its sequence's start plus its position in the sequence.
    index = start[:, None] + positions
    rows, columns = real[:, response_start:].nonzero(as_tuple=True)
    if bool((positions[rows, columns + response_start] == 0).any()):
        raise ValueError(
            "a row's first real token is a response token, with no prompt token before it to predict it; packed "
            "forwards need at least one prompt token per row (or train with packing='off')."
        )
    flat = index[real]
    packed_ids = input_ids.new_zeros(len(used) * cells).index_put((flat,), input_ids[real])
    packed_positions = torch.arange(cells, device=real.device).repeat(len(used)).index_put((flat,), positions[real])
    return PackedRows(
        input_ids=packed_ids.view(len(used), cells),
        position_ids=packed_positions.view(len(used), cells),
        source=index[rows, columns + response_start] - 1,
        rows=rows,
        columns=columns,
    )


def _first_fit(lengths: list[int], width: int | None) -> tuple[list[int], list[int], list[int]]:
    """``(row, offset)`` of each sequence and each row's used cells: one row, or first-fit decreasing."""
    if width is None:
        return [0] * len(lengths), _prefix(lengths), [max(1, sum(lengths))]
    capacity = max([width, *lengths])
    row_of, offset, used = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, filled in enumerate(used) if filled + lengths[i] <= capacity), len(used))
        if row == len(used):
            used.append(0)
        row_of[i], offset[i] = row, used[row]
        used[row] += lengths[i]
    return row_of, offset, used or [1]


def _prefix(lengths: list[int]) -> list[int]:
    """Exclusive prefix sums."""
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def packed_response_logprobs(
    model: nn.Module,
    parts: tuple[nn.Module, nn.Module] | None,
    packed: PackedRows,
    targets: Tensor,
    temperature: float,
    chunk_size: int,
    return_entropy: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The logprobs of ``targets`` at the real response tokens of ``packed``, by one packed forward.

    Args:
        model: The causal LM (its own forward runs when ``parts`` is ``None``).
        parts: ``(decoder, head)`` of :func:`~lightning_offpolicy.logprobs.head.fused_head_parts`: the
            fused head runs on the predicting tokens' hidden states (no logits); ``None``: the model's
            logits of those tokens only (``logits_to_keep`` given as their indices; one packed row).
        packed: :func:`pack_rows`'s layout.
        targets: ``[M]`` or ``[M, K]`` ids whose logprobs to return per real response token.
        temperature: Divides the logits.
        chunk_size: Rows per chunk of the logprob computation.
        return_entropy: Also return the ``[M]`` entropy.

    Returns:
        ``[M]`` or ``[M, K]`` logprobs (and the ``[M]`` entropy), with gradient.

    Raises:
        ValueError: The logits path with several packed rows (``logits_to_keep`` indexes the columns of every row).
        RuntimeError: The model returned hidden states or logits of an unexpected shape.
    """
    # No 2-D attention mask: transformers then reads the sequence boundaries from the position ids.
    inputs: dict[str, Any] = dict(
        input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids, use_cache=False
    )
    shape = tuple(packed.input_ids.shape)
    count = packed.source.numel()
    targets = targets.unsqueeze(0)
    if parts is not None:
        decoder, head = parts
        out = decoder(**inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != shape:
            raise RuntimeError(
                f"the decoder returned hidden states of shape {tuple(hidden.shape)}; expected {list(shape)} + [H]."
            )
        predicting = hidden.reshape(1, -1, hidden.shape[-1])[:, packed.source]
        result = fused_head_token_logprobs(head, predicting, targets, temperature, chunk_size, return_entropy)
    else:
        if shape[0] != 1:
            raise ValueError(f"the logits path packs into one row; got {shape[0]} rows.")
        out = model(**inputs, logits_to_keep=packed.source)
        logits = out.logits if hasattr(out, "logits") else out[0]
        if logits.dim() == 3 and tuple(logits.shape[:2]) == shape and shape[1] != count:
            logits = logits[:, packed.source]  # a model that ignores logits_to_keep: correct, not lean
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (1, count):
            raise RuntimeError(
                f"model returned logits of shape {tuple(logits.shape)}; expected [1, {count}, V] "
                "(logits_to_keep given as the predicting positions)."
            )
        result = token_logprobs(logits, targets, temperature, chunk_size, return_entropy)
    if return_entropy:
        return result[0].squeeze(0), result[1].squeeze(0)
    return result.squeeze(0)
