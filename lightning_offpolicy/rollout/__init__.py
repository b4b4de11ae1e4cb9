"""Rollout side: the engine contract, the embedded HF engine, and the callback that drives them."""

from lightning_offpolicy.rollout.callback import RolloutCallback
from lightning_offpolicy.rollout.engine import Completion, InterruptibleEngine, RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.hf import HFEngine
from lightning_offpolicy.rollout.hf_process import HFProcessEngine
from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine
from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine

__all__ = [
    "Completion",
    "HFEngine",
    "HFProcessEngine",
    "InterruptibleEngine",
    "RemoteVLLMEngine",
    "RolloutCallback",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
]
