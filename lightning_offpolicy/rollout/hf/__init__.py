"""The embedded Hugging Face engines: in the trainer's process (:class:`HFEngine`) or in a worker
process of its own (:class:`HFProcessEngine`)."""

from lightning_offpolicy.rollout.hf.engine import HFEngine
from lightning_offpolicy.rollout.hf.process import HFProcessEngine

__all__ = ["HFEngine", "HFProcessEngine"]
