"""Which policy a checkpoint was saved from, and a clear refusal to resume it into another one.

Lightning's resume loads the checkpoint's ``state_dict`` into whatever module the run built. A run
whose config names one model (``model.model``) and whose ``--ckpt_path`` was saved by a run of
another therefore either trains the checkpoint's weights without a word (same parameter names and
shapes: another checkpoint of the same architecture, or another tokenizer) or stops with a wall of
``size mismatch`` / ``Missing key(s)`` lines that names neither model.

:class:`~lightning_offpolicy.lightning.module.OffPolicyRLModule` records :func:`policy_identity` in every
checkpoint it saves (``checkpoint["policy_identity"]``): the model it was configured with, the
architecture (model class and ``model_type``), the shape-determining config fields, the LoRA
adapters, the count and a digest of the parameter names and shapes, and a fingerprint of the
tokenizer (class, size, special ids, a hash of the vocabulary). Before Lightning loads the weights,
:func:`check_checkpoint_matches` compares it with the current policy's and raises
:class:`CheckpointMismatchError` naming both models, what differs, and what to do. A checkpoint
saved before identities were recorded is checked by its ``state_dict``'s parameter names and shapes
instead (its ``hyper_parameters`` still name the model it was saved from).

Identical identities under another model name (``tiny:reverse`` and ``tiny:copy``, a moved
directory) load, with a warning that the checkpoint's weights are the ones trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from lightning_offpolicy.data.tokenizers import CharTokenizer, HFTokenizer
from lightning_offpolicy.preflight import tokenizer_size

__all__ = [
    "IDENTITY_KEY",
    "CheckpointMismatchError",
    "check_checkpoint_matches",
    "describe_model",
    "identity_differences",
    "policy_identity",
    "setting_differences",
    "state_dict_differences",
    "tokenizer_fingerprint",
]

#: The checkpoint key :class:`~lightning_offpolicy.lightning.module.OffPolicyRLModule` stores the identity under.
IDENTITY_KEY = "policy_identity"
#: Bumped when the identity's fields change meaning (a checkpoint of another format is compared field by field).
IDENTITY_FORMAT = 1
#: Config fields that decide the parameters' shapes (those a config has are recorded).
SHAPE_FIELDS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
)
#: Differences listed in a message before "and N more".
_SHOWN = 6


class CheckpointMismatchError(ValueError):
    """The checkpoint to resume was saved from another policy (architecture, shapes, LoRA or tokenizer).

    Attributes:
        differences: One line per difference, ``"<what>: <checkpoint's> vs <this run's>"``.
    """

    def __init__(self, message: str, differences: list[str]) -> None:
        super().__init__(message)
        self.differences = differences


# ------------------------------------------------------------------------------ the identity
def _unwrapped_class(module: torch.nn.Module) -> str:
    """The model's own class name: FSDP2's ``fully_shard`` swaps in a generated ``FSDP<Name>`` subclass."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls.__name__
    return type(module).__name__


def _config_fields(config: Any) -> dict[str, Any]:
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    fields: dict[str, Any] = {}
    for name in SHAPE_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, (bool, int)):
            fields[name] = value
    return fields


def _lora(policy: torch.nn.Module) -> dict[str, Any] | None:
    """Rank and target module names (their last component) of a peft policy's adapters; ``None`` without."""
    configs = getattr(policy, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    config = next(iter(configs.values()))
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, str):
        names = [targets]
    else:
        names = sorted({str(t).rsplit(".", 1)[-1] for t in (targets or ())})
    return {"rank": int(getattr(config, "r", 0)), "targets": names}


def _digest(items: Any) -> str:
    text = json.dumps(items, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Class, size, special ids and a hash of the vocabulary of a tokenizer (``None`` fields: not known).

    Args:
        tokenizer: A :class:`CharTokenizer`, an :class:`HFTokenizer` (loaded), a ``transformers``
            tokenizer, or any object with the kit's tokenizer API.
    """
    raw = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else tokenizer
    vocab: str | None = None
    if isinstance(tokenizer, CharTokenizer):
        vocab = _digest(["char", tokenizer.alphabet])
    elif callable(getattr(raw, "get_vocab", None)):
        vocab = _digest(sorted((str(k), int(v)) for k, v in raw.get_vocab().items()))
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")}
    return {
        "class": type(tokenizer).__name__,
        "size": tokenizer_size(tokenizer),
        **{name: value if isinstance(value, int) else None for name, value in ids.items()},
        "vocab_sha256": vocab,
    }


def policy_identity(
    policy: torch.nn.Module,
    tokenizer: Any,
    model_name: str,
    tokenizer_print: dict[str, Any] | None = None,
    from_instance: bool = False,
) -> dict[str, Any]:
    """What a checkpoint records about the policy it holds (plain types only: a ``weights_only`` load reads it).

    Args:
        policy: The policy as trained (after LoRA and sharding: names and global shapes are the same).
        tokenizer: Its tokenizer (``None``: not known; not recorded, nor compared).
        model_name: The model as configured (``OffPolicyRLModule(model=...)``: a path, hub name or ``tiny:`` spec).
        tokenizer_print: :func:`tokenizer_fingerprint` of ``tokenizer``, when already computed.
        from_instance: The policy was passed as a module instance (``model_name`` is then its class name).
    """
    base = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
    config = getattr(base, "config", None)
    shapes = [[name, list(param.shape)] for name, param in policy.named_parameters()]
    if tokenizer_print is None and tokenizer is not None:
        tokenizer_print = tokenizer_fingerprint(tokenizer)
    return {
        "format": IDENTITY_FORMAT,
        "model": str(model_name),
        "from_instance": bool(from_instance),
        "architecture": _unwrapped_class(base),
        "model_type": getattr(config, "model_type", None),
        "config": _config_fields(config) if config is not None else {},
        "lora": _lora(policy),
        "parameters": {
            "tensors": len(shapes),
            "values": int(sum(torch.Size(shape).numel() for _, shape in shapes)),
            "sha256": _digest(shapes),
        },
        "tokenizer": tokenizer_print,
    }


# ------------------------------------------------------------------------------ comparing
def _describe_tokenizer(fingerprint: Mapping[str, Any]) -> str:
    return f"{fingerprint.get('class')} of {fingerprint.get('size')} ids"


def _describe_lora(lora: Mapping[str, Any] | None) -> str:
    if not lora:
        return "none (lora_rank=0)"
    return f"rank {lora.get('rank')} on {', '.join(lora.get('targets') or []) or '?'}"


def identity_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"<what>: <checkpoint's> vs <this run's>"`` for every recorded field that differs (fields either side
    lacks are not compared)."""
    out: list[str] = []

    def compare(what: str, a: Any, b: Any) -> None:
        if a is not None and b is not None and a != b:
            out.append(f"{what}: {a} vs {b}")

    compare("architecture", saved.get("architecture"), current.get("architecture"))
    compare("model_type", saved.get("model_type"), current.get("model_type"))
    saved_config, current_config = saved.get("config") or {}, current.get("config") or {}
    for name in SHAPE_FIELDS:
        compare(name, saved_config.get(name), current_config.get(name))
    if "lora" in saved and "lora" in current and saved["lora"] != current["lora"]:
        out.append(f"LoRA adapters: {_describe_lora(saved['lora'])} vs {_describe_lora(current['lora'])}")
    saved_params, current_params = saved.get("parameters") or {}, current.get("parameters") or {}
    saved_digest, current_digest = saved_params.get("sha256"), current_params.get("sha256")
    if saved_digest and current_digest and saved_digest != current_digest:
        out.append(
            f"parameter names and shapes: {saved_params.get('tensors')} tensors of {saved_params.get('values'):,} "
            f"values vs {current_params.get('tensors')} tensors of {current_params.get('values'):,} values"
        )
    saved_tok, current_tok = saved.get("tokenizer") or {}, current.get("tokenizer") or {}
    if saved_tok and current_tok:
        tokenizer = []
        if saved_tok.get("class") != current_tok.get("class") or saved_tok.get("size") != current_tok.get("size"):
            tokenizer.append(f"{_describe_tokenizer(saved_tok)} vs {_describe_tokenizer(current_tok)}")
        for name in ("pad", "bos", "eos"):
            a, b = saved_tok.get(name), current_tok.get(name)
            if a != b:
                tokenizer.append(f"{name} id {a} vs {b}")
        a, b = saved_tok.get("vocab_sha256"), current_tok.get("vocab_sha256")
        if not tokenizer and a and b and a != b:
            tokenizer.append(f"another vocabulary of the same size ({saved_tok.get('size')} ids)")
        if tokenizer:
            out.append("tokenizer: " + ", ".join(tokenizer))
    return out


def state_dict_differences(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "policy.") -> list[str]:
    """The policy's parameter names and shapes in a checkpoint's ``state_dict`` against the current module's.

    Args:
        saved: The checkpoint's ``state_dict`` (tensors, or anything with ``.shape``).
        current: The current module's ``state_dict``.
        prefix: Only keys under it are compared (the policy's; a reference copy or metrics are not).
    """

    def shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in state.items() if k.startswith(prefix) and hasattr(v, "shape")}

    a, b = shapes(saved), shapes(current)
    out: list[str] = []
    resized = [k for k in a if k in b and a[k] != b[k]]
    if resized:
        shown = ", ".join(f"{k} {list(a[k])} vs {list(b[k])}" for k in resized[:3])
        more = f" and {len(resized) - 3} more" if len(resized) > 3 else ""
        out.append(f"parameters of other shapes ({len(resized)}): {shown}{more}")
    for keys, where in (
        ([k for k in a if k not in b], "only in the checkpoint"),
        ([k for k in b if k not in a], "only in this model"),
    ):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            out.append(f"parameters {where} ({len(keys)}): {', '.join(keys[:3])}{more}")
    return out


def describe_model(identity: Mapping[str, Any]) -> str:
    """``model 'path' (Class)``, or ``a Class instance passed from Python``."""
    name, architecture = identity.get("model"), identity.get("architecture")
    if identity.get("from_instance"):
        return f"a {architecture or name} instance passed from Python"
    if name is None:
        return "a model it does not name"
    return f"model {name!r} ({architecture})" if architecture else f"model {name!r}"


def _what_to_do(differences: list[str], saved: Mapping[str, Any]) -> str:
    """How to resume the checkpoint, or start this model without it, for these differences."""
    kinds = {d.split(":", 1)[0] for d in differences}
    lora = "LoRA adapters" in kinds
    if lora and all(kind == "LoRA adapters" or kind.startswith("parameter") for kind in kinds):
        return (
            "To resume it, configure the adapters as the run that saved it did (model.lora_rank, "
            "model.lora_target_modules); to train with this run's adapters (or none), start without --ckpt_path."
        )
    name = saved.get("model")
    if saved.get("from_instance"):
        resume = f"To resume it, pass the model it was saved from ({describe_model(saved)})"
    elif name is not None:
        resume = f"To resume it, set model.model to the model it was saved from ({name!r})"
    else:
        resume = "To resume it, set model.model to the model it was saved from (the checkpoint does not name it)"
    if kinds == {"tokenizer"}:
        resume += " and leave model.tokenizer unset, or set it to the tokenizer that run used"
    return (
        f"{resume}; to train this model, start without --ckpt_path (Python: ckpt_path=None). `--ckpt_path last` "
        "picks the newest checkpoint under the logger's save_dir and name, whichever model wrote it: give each "
        "model's runs their own trainer.logger name."
    )


def check_checkpoint_matches(
    checkpoint: Mapping[str, Any],
    current: Mapping[str, Any],
    current_state: Mapping[str, Any] | None = None,
    path: Any = None,
) -> str | None:
    """Raise :class:`CheckpointMismatchError` when ``checkpoint`` was saved from another policy than ``current``.

    Args:
        checkpoint: The loaded checkpoint (Lightning's dict; under a sharded strategy its metadata, without
            ``state_dict``).
        current: :func:`policy_identity` of the policy the run built.
        current_state: The current module's ``state_dict``, for a checkpoint saved before identities were
            recorded (compared by the policy's parameter names and shapes).
        path: The checkpoint's path, for the message.

    Returns:
        The model the checkpoint was saved from (as the message names it), when its name is not ``current``'s
        and nothing else differs (the caller warns); else ``None``.

    Raises:
        CheckpointMismatchError: Architecture, shape fields, LoRA adapters, parameters or tokenizer differ.
    """
    saved = checkpoint.get(IDENTITY_KEY)
    if isinstance(saved, Mapping):
        differences = identity_differences(saved, current)
        compared = "checkpoint vs this run"
    else:
        state = checkpoint.get("state_dict")
        if current_state is None or not isinstance(state, Mapping):
            return None
        differences = state_dict_differences(state, current_state)
        hyper = checkpoint.get("hyper_parameters")
        hyper = hyper if isinstance(hyper, Mapping) else {}
        saved = {"model": hyper.get("model")}
        saved_rank, current_rank = hyper.get("lora_rank"), (current.get("lora") or {}).get("rank", 0)
        if isinstance(saved_rank, int) and saved_rank != current_rank:
            differences.insert(0, f"LoRA adapters: lora_rank={saved_rank} vs {current_rank}")
        compared = "the checkpoint records no identity, so its parameters were compared: checkpoint vs this run"
    name, saved_name = current.get("model"), saved.get("model")
    if not differences:
        return describe_model(saved) if saved_name is not None and saved_name != name else None
    where = f"The checkpoint {str(path)!r}" if path else "The checkpoint"
    shown = "; ".join(differences[:_SHOWN])
    if len(differences) > _SHOWN:
        shown += f"; and {len(differences) - _SHOWN} more"
    this = describe_model(current)
    if saved_name == name and bool(saved.get("from_instance")) == bool(current.get("from_instance")):
        whose = f"{where} and this run both name {this}, but the checkpoint holds another policy"
    else:
        whose = f"{where} was saved from a run of {describe_model(saved)}, and this run trains {this}"
    message = f"{whose}: its weights would replace this model's. They differ ({compared}) in {shown}. " + _what_to_do(
        differences, saved
    )
    raise CheckpointMismatchError(message, differences)


def setting_differences(saved: Any, current: Mapping[str, Any]) -> list[str]:
    """The module settings (``hyper_parameters``) in which this run differs from the run that saved a checkpoint.

    Resuming trains with this run's settings, as configured (``--ckpt_path`` FILE and ``last`` alike): a
    setting changed on purpose (a new correction, another ``max_tokens_per_microbatch``) is applied, and each
    difference is named so that an unintended one is seen. Nested settings (``correction``, ``loss``) are
    compared field by field; ``model`` is left to :func:`check_checkpoint_matches`.

    Args:
        saved: The checkpoint's ``hyper_parameters`` (anything else: no differences).
        current: This module's ``hparams``.

    Returns:
        ``"name: <checkpoint's> -> <this run's>"`` per differing setting, in ``current``'s order.
    """
    if not isinstance(saved, Mapping):
        return []

    def flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in values.items():
            # Lightning's own entries (the CLI's instantiator); the model is the identity check's to compare.
            if str(key).startswith("_") or (not prefix and key == "model"):
                continue
            if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config passed from Python
                value = dataclasses.asdict(value)
            if isinstance(value, Mapping):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    before, now = flat(saved), flat(current)
    return [
        f"{name}: {repr(before[name]) if name in before else '(not recorded)'} -> {value!r}"
        for name, value in now.items()
        if name not in before or before[name] != value
    ]
