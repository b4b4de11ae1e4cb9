"""Memory-lean token log-probabilities (and entropy) of a causal LM, with or without its logits.

* :func:`token_logprobs`: from logits, chunk by chunk, with no full-vocabulary copy
  (:mod:`~lightning_offpolicy.logprobs.chunked`).
* :func:`fused_linear_token_logprobs`: from the last hidden states and a linear head, with no logits
  at all (:mod:`~lightning_offpolicy.logprobs.fused`); :func:`fused_head_parts` and
  :func:`fused_head_token_logprobs` find and apply a model's head (:mod:`~lightning_offpolicy.logprobs.head`).
* :func:`causal_lm_token_logprobs`: the response tokens' logprobs under a Hugging Face causal LM, by
  the fused head where the model allows it (:mod:`~lightning_offpolicy.logprobs.causal_lm`).
  With ``packed=True`` the rows run as one padding-free sequence; :func:`packing_refusal` says which
  models allow it (:mod:`~lightning_offpolicy.logprobs.packed`).

Both autograd Functions share one softmax gradient (:mod:`~lightning_offpolicy.logprobs.softmax`).
docs/logprobs.md explains the memory each path saves and why.
"""

from lightning_offpolicy.logprobs.causal_lm import causal_lm_token_logprobs
from lightning_offpolicy.logprobs.chunked import token_logprobs
from lightning_offpolicy.logprobs.fused import chunk_rows, fused_linear_token_logprobs
from lightning_offpolicy.logprobs.head import FUSED_HEAD_ARCHITECTURES, fused_head_parts, fused_head_token_logprobs
from lightning_offpolicy.logprobs.packed import PACKED_ARCHITECTURES, packing_refusal

__all__ = [
    "FUSED_HEAD_ARCHITECTURES",
    "PACKED_ARCHITECTURES",
    "causal_lm_token_logprobs",
    "chunk_rows",
    "fused_head_parts",
    "fused_head_token_logprobs",
    "fused_linear_token_logprobs",
    "packing_refusal",
    "token_logprobs",
]
