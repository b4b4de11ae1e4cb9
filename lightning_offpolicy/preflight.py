"""Checks that run before the first training step.

Each one turns a setting that would train nothing, or crash minutes into the run, into a
``ValueError`` / ``FileNotFoundError`` at set-up that names the setting, its value and what to do:

* :func:`check_group_size`: ``samples_per_prompt=1`` with a group estimator (every advantage is 0);
* :func:`check_vocab`: a tokenizer whose ids run past the model's embedding (``IndexError`` inside
  ``generate``);
* :func:`check_context` / :func:`check_prompt_fits`: prompt + ``max_new_tokens`` longer than the
  model's context or the engine's ``max_model_len``;
* :func:`check_model_path`: a local model directory that does not exist (the Hub's "Repo id must
  be in the form ..." message otherwise);
* :func:`check_hub_model`: a hub name that is neither a local directory nor cached, while the hub
  is offline or out of reach (a misspelt name used to spend a minute on retries first).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_offpolicy.argcheck import is_int

#: Estimators whose baseline is the prompt's own group: with one sample per prompt every advantage is 0.
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")


def check_group_size(samples_per_prompt: int, advantage_estimator: str) -> None:
    """``ValueError`` when a group estimator gets groups of one sample (it would train nothing)."""
    if advantage_estimator in GROUP_ESTIMATORS and samples_per_prompt < 2:
        raise ValueError(
            f"rollout.sampling.samples_per_prompt={samples_per_prompt} with rollout.advantage_estimator="
            f"{advantage_estimator!r}: a group baseline over one sample makes every advantage 0, so nothing "
            "would be trained (train/grad_norm 0 at every step). Set samples_per_prompt >= 2, or "
            "advantage_estimator='reinforce' (no group baseline)."
        )


def embedding_rows(model: Any) -> int | None:
    """Rows of the model's input embedding (``None`` when the model does not expose one)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    return int(rows) if isinstance(rows, int) else None


def tokenizer_size(tokenizer: Any) -> int | None:
    """Ids the tokenizer can produce: ``len(tokenizer)`` (added tokens included), else ``vocab_size``."""
    try:
        return int(len(tokenizer))
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
        return int(size) if isinstance(size, int) else None


def check_vocab(model: Any, tokenizer: Any) -> None:
    """``ValueError`` when the tokenizer has more ids than the model's embedding has rows."""
    rows, size = embedding_rows(model), tokenizer_size(tokenizer)
    if rows is not None and size is not None and size > rows:
        raise ValueError(
            f"The tokenizer has {size} token ids but the model's input embedding only {rows} rows: ids >= {rows} "
            "would crash inside generate (IndexError). Use the tokenizer saved with this model, or resize the "
            "model's embeddings (model.resize_token_embeddings(len(tokenizer))) before training."
        )


def model_context(model: Any) -> int | None:
    """The model's context length, ``config.max_position_embeddings`` (``None`` when not known)."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def context_limit(model: Any, engine: Any) -> tuple[int, str] | None:
    """The tightest bound on prompt + completion tokens and where it comes from, or ``None``.

    The model's ``max_position_embeddings`` and the engine's ``max_model_len`` (vLLM engines; a
    remote engine knows it once connected) both bound it.
    """
    limits = []
    positions = model_context(model)
    if positions is not None:
        limits.append((positions, f"the model's context (max_position_embeddings={positions})"))
    engine_len = getattr(engine, "max_model_len", None)
    if is_int(engine_len) and engine_len > 0:
        limits.append((engine_len, f"the engine's max_model_len={engine_len}"))
    return min(limits) if limits else None


def check_context(
    max_new_tokens: int, limit: tuple[int, str] | None, setting: str = "rollout.sampling.max_new_tokens"
) -> None:
    """``ValueError`` when ``max_new_tokens`` (the value of ``setting``) alone leaves no room for a prompt."""
    if limit is not None and max_new_tokens >= limit[0]:
        raise ValueError(
            f"{setting}={max_new_tokens} leaves no room for a prompt within {limit[1]}: prompt + "
            f"completion must fit in {limit[0]} tokens. Lower {setting}."
        )


def check_prompt_fits(
    longest_prompt: int,
    max_new_tokens: int,
    limit: tuple[int, str] | None,
    setting: str = "rollout.sampling.max_new_tokens",
) -> None:
    """``ValueError`` when the longest prompt + ``max_new_tokens`` (the value of ``setting``) runs past the context."""
    if limit is not None and longest_prompt + max_new_tokens > limit[0]:
        raise ValueError(
            f"The longest prompt of this batch ({longest_prompt} tokens) + {setting}="
            f"{max_new_tokens} = {longest_prompt + max_new_tokens} tokens exceeds {limit[1]}. Lower "
            f"{setting}, use shorter prompts, or a model / engine with a longer context."
        )


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a local path: absolute, ``./``, ``../``, ``~``, or its parent exists.

    A hub id like ``org/model`` is not, unless a local directory ``org`` exists.
    """
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name in (".", ".."):
        return True
    parent = os.path.dirname(name.rstrip("/\\"))
    return bool(parent) and Path(parent).expanduser().is_dir()


def check_model_path(name: str, setting: str) -> None:
    """``FileNotFoundError`` when ``name`` looks like a local path (:func:`looks_local`) and is not a directory."""
    if looks_local(name) and not Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        what = "is a file, not a model directory" if path.exists() else "was not found"
        raise FileNotFoundError(
            f"{setting}={name!r}: the local model directory {str(path.absolute())!r} {what}. Give the directory "
            "that holds config.json and the weights (save_pretrained output), a hub id such as 'org/name', or "
            "'tiny:<task>'."
        )


#: Seconds the hub gets to answer one probe before a model name that is not cached is called unreachable.
HUB_PROBE_TIMEOUT_S = 5.0


def check_hub_model(
    name: str,
    setting: str = "OffPolicyRLModule.model",
    timeout_s: float = HUB_PROBE_TIMEOUT_S,
    files: tuple[str, ...] = ("config.json",),
) -> None:
    """``OSError`` at once when ``name`` would have to be downloaded and cannot be.

    Nothing to check for ``tiny:`` specs, local directories and names with one of ``files`` already
    in the Hugging Face cache. Otherwise, with ``HF_HUB_OFFLINE`` set, or when one request to the
    hub's endpoint gets no answer within ``timeout_s``, the name cannot be fetched: ``transformers``
    would retry for about a minute and then blame the connection, where the usual cause is a
    misspelt name.
    """
    if name.startswith("tiny:") or Path(name).expanduser().is_dir():
        return
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = [try_to_load_from_cache(name, file) for file in files]
    except Exception:  # not a valid repo id: transformers' own message says so, without retries
        return
    if any(isinstance(path, str) for path in cached):
        return
    where = (
        f"{setting}={name!r} is not a local directory (working directory: {os.getcwd()}) and not in the Hugging Face "
        f"cache ({constants.HF_HUB_CACHE})"
    )
    todo = (
        "Check the spelling (a hub id is 'org/name', e.g. 'Qwen/Qwen2.5-0.5B-Instruct'), give the directory of a "
        "save_pretrained checkpoint, or download the model into the cache where there is network "
        f"(`hf download {name}`)."
    )
    if constants.HF_HUB_OFFLINE:
        raise OSError(f"{where}, and HF_HUB_OFFLINE is set, so it cannot be downloaded. {todo}")
    error = _hub_unreachable(constants.ENDPOINT, timeout_s)
    if error is not None:
        raise OSError(
            f"{where}, and the hub at {constants.ENDPOINT} cannot be reached ({error}; one request, {timeout_s:g} s "
            f"timeout), so it cannot be downloaded. {todo} Without network, set HF_HUB_OFFLINE=1."
        )


def _hub_unreachable(endpoint: str, timeout_s: float) -> str | None:
    """Why one HEAD request to ``endpoint`` got no answer (any HTTP status is an answer), or ``None``."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=timeout_s)
    except Exception as err:  # connect / DNS / TLS / timeout: the hub's client has its own exception types
        return f"{type(err).__name__}: {err}"
    return None
