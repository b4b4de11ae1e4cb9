"""A server's weights pushed GPU to GPU with vLLM's own weight-transfer engines (``nccl``, ``ipc``).

:class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine` moves weights through files by
default (``weight_sync.transport="file"``: safetensors in a shared directory, reloaded by the server).
With ``"nccl"`` or ``"ipc"`` it drives vLLM's weight-transfer API instead: the trainer side is
vLLM's own trainer engine (``WeightTransferTrainerFactory.trainer_init``) talking to the server's
HTTP control plane (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, through vLLM's ``HTTPVLLMWeightSyncClient``), and
the bytes go over NCCL (a broadcast from the trainer's GPU to the server's workers) or CUDA IPC
(the server's workers read the trainer's GPU buffers; same machine). Both need CUDA on both sides
and a server started with ``--weight-transfer-config '{"backend": "nccl"}'`` (or ``"ipc"``;
``launch_local_server(weight_transfer_backend=...)``). What was run where: docs/scaling.md,
"Weight sync".

Importing this module does not import vLLM; the trainer needs vLLM installed for these two
transports only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_offpolicy.rollout.vllm.settings import RemoteWeightSyncSettings

__all__ = ["GPU_TRANSPORTS", "VLLMWeightTransfer", "check_transport_settings", "gpu_transport_refusal"]

#: The ``weight_sync.transport`` values that use vLLM's weight-transfer engines.
GPU_TRANSPORTS = ("nccl", "ipc")


def gpu_transport_refusal(transport: str) -> str | None:
    """Why ``transport`` cannot run on this machine (``None``: it can, as far as the trainer's side goes)."""
    if transport not in GPU_TRANSPORTS:
        return None
    if not torch.cuda.is_available():
        return (
            f"weight_sync.transport={transport!r} moves the weights from the trainer's GPU with vLLM's {transport} "
            "weight-transfer engine, and this machine has no CUDA device: use weight_sync.transport='file'"
        )
    try:
        import vllm.distributed.weight_transfer  # noqa: F401
    except ImportError as err:
        return (
            f"weight_sync.transport={transport!r} drives vLLM's weight-transfer engines from the trainer, which needs "
            f"vLLM installed in the trainer's environment ({err}): install it, or use weight_sync.transport='file'"
        )
    return None


def check_transport_settings(settings: RemoteWeightSyncSettings, host: str) -> None:
    """Refuse a :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine` transport this setup cannot run.

    Args:
        settings: The engine's ``weight_sync`` (its own ranges are checked when it is built).
        host: The server's host.

    Raises:
        ValueError: A GPU transport this machine cannot drive, one combined with ``lora="adapter"``,
            or NCCL to a remote ``host`` without ``master_address``; the message names the setting.
    """
    from lightning_offpolicy.rollout.vllm.http import is_loopback

    transport = settings.transport
    if transport == "file":
        return
    if (why := gpu_transport_refusal(transport)) is not None:
        raise ValueError(f"RemoteVLLMEngine: {why}.")
    if settings.lora == "adapter":
        raise ValueError(
            f"RemoteVLLMEngine(weight_sync.transport={transport!r}) moves full weights: the adapter of "
            "weight_sync.lora='adapter' goes through files (weight_sync.transport='file')."
        )
    if transport == "nccl" and settings.master_address is None and not is_loopback(host):
        raise ValueError(
            "RemoteVLLMEngine(weight_sync.transport='nccl') needs weight_sync.master_address: an address of this "
            f"trainer's machine that the server at {host} can reach for the NCCL rendezvous."
        )


def _tensors_source() -> Any:
    """vLLM's ``WeightSource`` over the tensors of the current sync (``.tensors``, replaced before each send)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorsSource(WeightSource):
        def __init__(self) -> None:
            self.tensors: Mapping[str, torch.Tensor] = {}

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from self.tensors.items()

    return TensorsSource()


class VLLMWeightTransfer:
    """vLLM's trainer-side weight-transfer engine for one server, set up at the first send.

    Args:
        base_url: The server's address (its HTTP control plane).
        backend: ``"nccl"`` or ``"ipc"``.
        master_address: NCCL only: an address of the trainer's machine the server's workers can
            reach (the rendezvous host).
        master_port: NCCL only: the rendezvous port there; ``None``: a free one, found at the first send.
        timeout_s: Longest one control-plane request may take.
        world_size: NCCL only: asks the server how many workers it runs (``/get_world_size``).
    """

    def __init__(
        self,
        base_url: str,
        backend: str,
        master_address: str,
        master_port: int | None,
        timeout_s: float,
        world_size: Callable[[], int],
    ) -> None:
        if backend not in GPU_TRANSPORTS:
            raise ValueError(f"VLLMWeightTransfer.backend={backend!r}: allowed {GPU_TRANSPORTS}.")
        self.base_url = base_url
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self._world_size = world_size
        self._engine: Any = None
        self._source: Any = None

    def _init(self) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        client = HTTPVLLMWeightSyncClient(self.base_url, timeout=self.timeout_s)
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            # The NCCL group: this trainer (rank 0, the sender) and every worker of the server.
            workers = self._world_size()
            from lightning_offpolicy.rollout.vllm.server import free_port

            info: Any = NCCLTrainerInitInfo(
                master_address=self.master_address,
                master_port=self.master_port or free_port(),
                world_size=1 + workers,
                rank=0,
            )
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        self._source = _tensors_source()
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._source)

    def send(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Push ``tensors`` (on the trainer's GPU, checkpoint names) to every worker; the bytes sent."""
        if self._engine is None:
            self._init()
        self._source.tensors = tensors
        try:
            self._engine.send_weights()
        finally:
            self._source.tensors = {}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        """Tear the transfer's communicators down (the server keeps running)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
