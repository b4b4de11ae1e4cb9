"""vLLM engines: in-process (:class:`VLLMEngine`), a server over HTTP (:class:`RemoteVLLMEngine`), several
servers balanced by the client (:class:`RemoteVLLMPool`); their settings in groups (:mod:`.settings`).

Importing this package imports no vLLM: the in-process engine loads it when it starts, and the
remote engine never does (a trainer host that talks to a server needs no vLLM).
"""

from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine, supported_cpu_head_dims, vllm_available
from lightning_offpolicy.rollout.vllm.pool import RemoteVLLMPool
from lightning_offpolicy.rollout.vllm.remote import RemoteVLLMEngine
from lightning_offpolicy.rollout.vllm.server import LocalVLLMServer, launch_local_server
from lightning_offpolicy.rollout.vllm.settings import (
    ConnectionSettings,
    RemoteWeightSyncSettings,
    StartSettings,
    WeightSyncSettings,
)

__all__ = [
    "ConnectionSettings",
    "LocalVLLMServer",
    "RemoteVLLMEngine",
    "RemoteVLLMPool",
    "RemoteWeightSyncSettings",
    "StartSettings",
    "VLLMEngine",
    "WeightSyncSettings",
    "launch_local_server",
    "supported_cpu_head_dims",
    "vllm_available",
]
