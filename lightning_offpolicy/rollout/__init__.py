"""Rollout side, free of Lightning: the engine contract, the engines (``hf/``, ``vllm/``), and the
rollouter that turns prompts into scored, advantage-weighted :class:`~lightning_offpolicy.batch.RolloutBatch`es.

The Lightning callback that drives them is :class:`lightning_offpolicy.lightning.RolloutCallback`.
"""

from lightning_offpolicy.rollout.asynchrony import AsyncSettings
from lightning_offpolicy.rollout.dapo import DAPOSettings
from lightning_offpolicy.rollout.engine import Completion, InterruptibleEngine, RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.hf import HFEngine, HFProcessEngine
from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine, RemoteVLLMPool
from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine

__all__ = [
    "AsyncSettings",
    "DAPOSettings",
    "Completion",
    "HFEngine",
    "HFProcessEngine",
    "InterruptibleEngine",
    "RemoteVLLMEngine",
    "RemoteVLLMPool",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
]
