"""The adapter sync of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine` (``lora="adapter"``).

A peft LoRA policy's base weights go to the server once (the file reload of
:class:`~lightning_offpolicy.rollout.vllm.sync.remote.RemoteWeightSync`), then each sync saves only
the adapter into a private directory and loads it with vLLM's runtime adapter routes
(``POST /v1/load_lora_adapter``) under a name never used before: vLLM serves a known name from its
cache without reading the new files (and keys its prefix cache by name and path). Requests then
name the adapter as their ``model``; the previous adapter is unloaded and its files removed.
The server needs ``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
(docs/remote_vllm.md, "LoRA adapters").
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from lightning_offpolicy.rollout.vllm.http import HTTPStatusError
from lightning_offpolicy.rollout.vllm.sync.export import is_peft_model, make_private_dirs
from lightning_offpolicy.rollout.vllm.sync.lora import vllm_lora_rank
from lightning_offpolicy.rollout.vllm.sync.peft_export import (
    adapter_rank,
    base_state_dict,
    check_vllm_adapter,
    save_adapter,
)

__all__ = ["LORA_ROUTES_HINT", "RemoteAdapterSync", "enable_lora_hint"]

_WHO = "RemoteVLLMEngine(weight_sync.lora='adapter')"
_CALLER = "RemoteVLLMEngine.update_weights"
#: Prefix of the per-sync adapter directories inside the engine's sync directory.
_ADAPTER_DIR = "adapter-"
#: What enables vLLM's runtime adapter routes.
LORA_ROUTES_HINT = (
    "start the server with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (it enables "
    "/v1/load_lora_adapter and /v1/unload_lora_adapter, which the adapter sync uses)"
)


def enable_lora_hint(rank: int | None) -> str:
    """What to add to the server's command line for adapters of rank ``rank`` (``None``: not known)."""
    flag = f"--max-lora-rank {vllm_lora_rank(rank, _WHO)}" if rank is not None else "--max-lora-rank R (R >= the rank)"
    return f"start the server with --enable-lora {flag} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"


class RemoteAdapterSync:
    """The adapter-sync steps of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`.

    A mixin: it uses the engine's ``push_lora_base``, the server's LoRA settings read at connect
    time (``server_lora_config``, ``server_runtime_lora``), the sync directory and file reload of
    :class:`~lightning_offpolicy.rollout.vllm.sync.remote.RemoteWeightSync`, and sets
    ``adapter_name`` (what requests name as their ``model``) and the ``last_*`` figures.
    """

    def _init_adapter_state(self) -> None:
        self.adapter_name: str | None = None
        self._adapter_dir: Path | None = None
        self._adapter_serial = 0
        # Part of every adapter name: two engines (or a restarted trainer) on one server never
        # pick the same name, which the server would refuse ("already been loaded").
        self._adapter_tag = secrets.token_hex(3)
        self._base_synced = not self.push_lora_base

    def _check_adapter_source(self, source: Any, is_module: bool) -> None:
        """Trainer-side checks of ``weight_sync.lora="adapter"`` (no request sent)."""
        if not (is_module and is_peft_model(source)):
            raise TypeError(
                f"{_WHO} syncs the adapter of a peft LoRA model, got {type(source).__name__}: pass the peft model, "
                "or use weight_sync.lora='merged' (the default) for a model without adapters or a state dict."
            )
        check_vllm_adapter(source, _CALLER)

    def _check_adapter_server(self, model: torch.nn.Module) -> None:
        """The server's LoRA settings (read from ``/server_info`` at connect time) against the adapter."""
        rank = adapter_rank(model)
        config = self.server_lora_config
        if config is None:
            raise RuntimeError(
                f"{_WHO}: the server at {self.base_url} runs without LoRA support (no --enable-lora): "
                f"{enable_lora_hint(rank)}; or use weight_sync.lora='merged'."
            )
        limit = config.get("max_lora_rank") if isinstance(config, dict) else None
        if isinstance(limit, int) and rank > limit:
            raise ValueError(
                f"{_WHO}: the adapter's rank {rank} exceeds the server's --max-lora-rank {limit}: restart the server "
                f"with --max-lora-rank {vllm_lora_rank(rank, _WHO)}, lower the rank, or use weight_sync.lora='merged'."
            )
        if self.server_runtime_lora is False:
            raise RuntimeError(
                f"{_WHO}: the server at {self.base_url} cannot load adapters at run time: {LORA_ROUTES_HINT}."
            )

    def _sync_adapter(self, model: torch.nn.Module, version: int) -> None:
        """The base weights once (unless the server serves them already), then only the adapter."""
        begin = time.perf_counter()
        written = 0
        write_s = reload_s = 0.0
        if not self._base_synced:
            written += self._push_tensors(base_state_dict(model, _CALLER, tied=self._tied_export()))
            write_s, reload_s = self.last_write_time_s, self.last_reload_time_s
            # Read by the server during the reload: no longer needed (it may be as large as the model).
            with contextlib.suppress(OSError):
                (self._ensure_sync_dir() / "model.safetensors").unlink()
            self._base_synced = True
        saved = time.perf_counter()
        self._adapter_serial += 1
        name = f"policy-v{version}-{self._adapter_tag}-{self._adapter_serial}"
        top = self._ensure_sync_dir() / f"{_ADAPTER_DIR}{self._adapter_serial:06d}-v{version}"
        try:
            path = self._save_adapter(model, top)
            written += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            loaded = time.perf_counter()
            self._load_adapter(name, path)
            done = time.perf_counter()
        finally:  # the previous adapter's files, or this one's when its load failed
            self._remove_adapter_dirs(keep=self._adapter_dir)
        self.last_write_time_s = write_s + (loaded - saved)
        self.last_reload_time_s = reload_s + (done - loaded)
        self.last_sync_bytes = written
        self.last_sync_time_s = time.perf_counter() - begin

    def _save_adapter(self, model: torch.nn.Module, top: Path) -> Path:
        """The adapter's files in ``top``, with the sync directory's modes (the server loads what it finds there)."""
        make_private_dirs(top, self._dir_mode())
        path = save_adapter(model, top)
        for item in [top, *top.rglob("*")]:
            os.chmod(item, self._dir_mode() if item.is_dir() else self._file_mode())
        return path

    def _load_adapter(self, name: str, path: Path) -> None:
        """Load the adapter in ``path`` under ``name``, switch requests to it, unload the previous one."""
        server_path = self._server_path(path)
        try:
            self._http.request(
                "POST",
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": server_path},
                timeout=self.request_timeout_s,
                what="load_lora_adapter",
                text=True,  # vLLM answers "Success: LoRA adapter ... added successfully."
            )
        except HTTPStatusError as err:
            if err.status == 404 and "Not Found." in str(err):  # the route itself is missing
                raise RuntimeError(f"{_WHO}: the server has no /v1/load_lora_adapter: {LORA_ROUTES_HINT}.") from err
            if err.status == 404:  # vLLM's LoRAAdapterNotFoundError: it cannot read the path
                raise RuntimeError(
                    f"{err} Is weights_dir on storage the server can read at {server_path!r} (set "
                    "server_weights_dir if it mounts it elsewhere)?"
                ) from err
            raise
        old, self.adapter_name, self._adapter_dir = self.adapter_name, name, path
        if old is not None:
            self._unload_adapter(old)

    def _unload_adapter(self, name: str, timeout: float | None = None) -> None:
        """Forget adapter ``name`` on the server (one already gone is fine); ``timeout``: ``request_timeout_s``."""
        try:
            self._http.request(
                "POST",
                "/v1/unload_lora_adapter",
                {"lora_name": name},
                timeout=self.request_timeout_s if timeout is None else timeout,
                what="unload_lora_adapter",
                text=True,
            )
        except HTTPStatusError as err:
            if err.status != 404:
                raise

    def _remove_adapter_dirs(self, keep: Path | None) -> None:
        """Remove the adapter directories of the sync directory except the one holding ``keep``."""
        if self._sync_dir is None:
            return
        for child in self._sync_dir.iterdir():
            if child.name.startswith(_ADAPTER_DIR) and not (keep is not None and keep.is_relative_to(child)):
                shutil.rmtree(child, ignore_errors=True)

    def _close_adapter(self) -> None:
        """At close: unload the adapter in use (best effort, a short wait; its files go with the sync directory)."""
        name, self.adapter_name = self.adapter_name, None
        if name is not None:
            with contextlib.suppress(RuntimeError):
                self._unload_adapter(name, timeout=min(self.connect_timeout_s, self.request_timeout_s))
