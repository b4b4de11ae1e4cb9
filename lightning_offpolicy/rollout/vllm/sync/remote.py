"""The weight sync of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`: safetensors written
into a private directory the server can read, reloaded in place over HTTP, the prefix cache dropped,
and the probe the self-check scores (docs/remote_vllm.md)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_offpolicy.rollout.vllm.errors import DEV_MODE_HINT
from lightning_offpolicy.rollout.vllm.http import HTTPStatusError
from lightning_offpolicy.rollout.vllm.sync.check import PROBE_LENGTH, check_received, probe_ids
from lightning_offpolicy.rollout.vllm.sync.export import make_private_dirs, write_safetensors
from lightning_offpolicy.rollout.vllm.sync.peft_export import full_state_dict
from lightning_offpolicy.rollout.vllm.worker_extension import RECEIVER_CLS, RECEIVER_VERSION

__all__ = ["RemoteWeightSync"]


class RemoteWeightSync:
    """The weight-sync steps of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`.

    A mixin: it reads the engine's ``weights_dir``, ``server_weights_dir``,
    ``share_weights_with_group``, ``_http`` and time limits, and sets the ``last_*_time_s`` figures
    and ``last_sync_bytes``.
    """

    def _sync(self, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Full-weight sync (a peft LoRA policy as merged weights, ``W + scaling B A`` computed out of place)."""
        begin = time.perf_counter()
        if self._transfer is not None:  # vLLM's weight-transfer engine, GPU to GPU
            # A tied output layer shares the embedding's parameter on the GPU (no packed copy to renew):
            # not sent, as save_pretrained leaves it out (vLLM's Gemma-2 refuses it).
            tensors = full_state_dict(source, "RemoteVLLMEngine.update_weights", for_files=False, tied="drop")
            self.last_sync_bytes = self._transfer.send(tensors)
            del tensors
            self._reset_prefix_cache()
        else:
            tensors = full_state_dict(source, "RemoteVLLMEngine.update_weights", tied=self._tied_export())
            self.last_sync_bytes = self._push_tensors(tensors)
        self.last_sync_time_s = time.perf_counter() - begin

    def _push_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        """Write ``tensors`` into the sync directory, have the server reload them in place, drop its prefix
        cache; sets ``last_write_time_s`` / ``last_reload_time_s``, returns the bytes written."""
        begin = time.perf_counter()
        sync_dir = self._ensure_sync_dir()
        path = write_safetensors(tensors, sync_dir, mode=self._file_mode())
        sent = len(tensors)
        del tensors
        written = time.perf_counter()
        missing = self._reload_weights(self._server_path(sync_dir))
        reloaded = time.perf_counter()
        check_received(missing, sent, "RemoteVLLMEngine")
        self._reset_prefix_cache()
        self.last_write_time_s = written - begin
        self.last_reload_time_s = reloaded - written
        return path.stat().st_size

    def _file_mode(self) -> int:
        """The mode of the files the sync writes (readable by the group with ``share_weights_with_group``)."""
        return 0o640 if self.share_weights_with_group else 0o600

    def _dir_mode(self) -> int:
        """The mode of the directories the sync creates."""
        return 0o750 if self.share_weights_with_group else 0o700

    def _ensure_sync_dir(self) -> Path:
        if self._sync_dir is None:
            assert self.weights_dir is not None
            root = Path(self.weights_dir)
            dir_mode = self._dir_mode()
            try:
                make_private_dirs(root, dir_mode)  # the parents too: 0777 under umask 000 otherwise
                # Private to this engine (mkdtemp: 0700, whatever the umask): the server loads every
                # *.safetensors file of the directory it is given, so no other user may write there.
                path = Path(tempfile.mkdtemp(prefix=f"lightning_offpolicy_sync_{socket.gethostname()}_", dir=root))
                os.chmod(path, dir_mode)
            except OSError as err:
                raise RuntimeError(
                    "RemoteVLLMEngine: cannot create the sync directory in "
                    f"weight_sync.weights_dir={self.weights_dir!r} ({err}): it must be writable by the trainer."
                ) from err
            _warn_if_others_can_replace(root)
            self._sync_dir = path
        return self._sync_dir

    def _server_path(self, local: Path) -> str:
        """``local`` (inside ``weights_dir``) as the server sees it."""
        if self.server_weights_dir is None:
            return str(local)
        assert self.weights_dir is not None
        return str(Path(self.server_weights_dir) / local.relative_to(Path(self.weights_dir)))

    def _collective_rpc(self, method: str, what: str, args: list | None = None, kwargs: dict | None = None) -> list:
        """Run ``method`` in every worker of the server (``/collective_rpc``); their answers (vLLM passes lists
        and dicts on as they are, anything else as a string). Raises ``HTTPStatusError`` as the server answers."""
        body: dict[str, Any] = {"method": method, "timeout": self.request_timeout_s}
        if args is not None:
            body["args"] = args
        if kwargs is not None:
            body["kwargs"] = kwargs
        answer = self._http.request("POST", "/collective_rpc", body, timeout=self.request_timeout_s, what=what)
        return _results(answer)

    def _has_receiver(self) -> bool:
        """Whether the server runs the kit's weight-sync receiver (``--worker-extension-cls``, as
        :func:`~lightning_offpolicy.rollout.vllm.server.launch_local_server` starts it); asked once."""
        known = getattr(self, "_receiver_known", None)
        if known is None:
            try:
                answers = self._collective_rpc("lo_receiver_version", "the weight-sync receiver check")
                known = str(RECEIVER_VERSION) in map(str, answers)
            except HTTPStatusError:  # no such method: a server started without the kit's receiver
                known = False
            self._receiver_known = known
        return known

    def _tied_export(self) -> Literal["copy", "drop"]:
        """A tied output layer's weight: left out for the kit's receiver (which processes the tied layer
        again, and which every family's model takes), sent under its own name otherwise (vLLM's own
        reload processes it then; a model without an output layer of its own, Gemma-2's, refuses it)."""
        return "drop" if self._has_receiver() else "copy"

    def _reload_weights(self, server_path: str) -> list | None:
        """Ask the server to reload its weights in place from the safetensors files in ``server_path``; with
        the kit's receiver, what each worker's model did not receive (``None``: not known)."""
        receiver = self._has_receiver()
        try:
            if receiver:
                results = self._collective_rpc("lo_reload_from_files", "reload_weights", args=[server_path])
            else:
                self._collective_rpc("reload_weights", "reload_weights", kwargs={"weights_path": server_path})
        except HTTPStatusError as err:
            if err.status == 404:
                raise RuntimeError(f"RemoteVLLMEngine: the server has no /collective_rpc: {DEV_MODE_HINT}.") from err
            # vLLM 0.32 swaps the weights for placeholders before loading: after a failed reload the
            # server's model is half-loaded and its next generation kills the engine. Do not use it again.
            self._failure = (
                f"the server at {self.base_url} failed to reload the weights written to {server_path!r} and must be "
                "restarted (a failed reload leaves vLLM's weights half-loaded). Is weight_sync.weights_dir on storage "
                "the server can read at that path (set weight_sync.server_weights_dir if it mounts it elsewhere)? A "
                "model whose vLLM class has no output layer of its own (Gemma-2) refuses a tied lm_head.weight: start "
                f"the server with --worker-extension-cls {RECEIVER_CLS} (launch_local_server does)."
            )
            raise RuntimeError(f"{err} {self._failure}") from err
        return results if receiver else None

    def _reset_prefix_cache(self) -> None:
        """Drop the server's prefix cache: cached KV of the old weights must not serve new requests."""
        for attempt in range(20):
            answer = self._http.request(
                "POST", "/reset_prefix_cache", timeout=self.request_timeout_s, what="reset_prefix_cache"
            )
            # vLLM 0.32 answers {"success": bool}; older versions answer with an empty 200.
            if not isinstance(answer, dict) or answer.get("success", True):
                return
            time.sleep(0.05 * (attempt + 1))  # blocks still held by running requests (another client?)
        raise RuntimeError(
            f"RemoteVLLMEngine: the server at {self.base_url} refused to reset its prefix cache after the weight sync "
            "(requests of another client still running?): cached KV of the old weights could serve new requests. "
            "Use one server per trainer."
        )

    def _probe(self, module: torch.nn.Module | None = None) -> list[int]:
        config = getattr(module, "config", None)
        vocab = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", None)
        if not isinstance(vocab, int):
            vocab = int(module.get_input_embeddings().num_embeddings)
        return probe_ids(vocab, self.max_model_len or PROBE_LENGTH + 1)

    def _engine_probe_logprobs(self, probe: list[int]) -> torch.Tensor:
        answer = self._http.request(
            "POST",
            "/v1/completions",
            {
                "model": self.request_model,  # the adapter, with weight_sync.lora="adapter"
                "prompt": probe,
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
                "return_tokens_as_token_ids": True,
                "seed": 0,
            },
            timeout=self.request_timeout_s,
            what="weight-sync check",
        )
        entries = (((answer or {}).get("choices") or [{}])[0].get("prompt_logprobs") or [])[1:]  # position 0: none
        if len(entries) != len(probe) - 1:
            raise RuntimeError("RemoteVLLMEngine: the server returned no prompt logprobs for the weight-sync check.")
        # JSON object keys are strings: {"17": {"logprob": ..., "rank": ...}}.
        return torch.tensor(
            [float(entry[str(tok)]["logprob"]) for entry, tok in zip(entries, probe[1:], strict=True)],
            dtype=torch.float64,
        )


def _warn_if_others_can_replace(root: Path) -> None:
    """Warn when other users may rename entries of ``weights_dir``: a swapped sync directory is loaded."""
    with contextlib.suppress(OSError):
        st = root.stat()
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            warnings.warn(
                f"RemoteVLLMEngine: weight_sync.weights_dir={str(root)!r} is writable by other users (mode "
                f"{st.st_mode & 0o7777:o}) without the sticky bit: one of them could replace the sync directory "
                "between the write and the server's reload. Use a directory only the trainer (and the "
                "server's user) can write, or chmod +t it.",
                RuntimeWarning,
                stacklevel=4,
            )


def _results(answer: Any) -> list:
    """The per-worker results of a ``/collective_rpc`` answer (``{"results": [...]}`` in vLLM 0.32)."""
    return list(answer.get("results") or []) if isinstance(answer, dict) else []
