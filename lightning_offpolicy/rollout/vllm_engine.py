"""Deprecated alias of :mod:`lightning_offpolicy.rollout.vllm.inprocess` (deprecated in 0.1; removed in 0.2)."""

from lightning_offpolicy._deprecation import moved_module

moved_module(__name__, "lightning_offpolicy.rollout.vllm.inprocess")
