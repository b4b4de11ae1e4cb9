"""The rollout engine contract: what the trainer needs from any generator (HF, vLLM, a server)."""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lightning_offpolicy.argcheck import is_int


@dataclass
class SamplingConfig:
    """How completions are sampled.

    The trainer must score tokens with the same ``temperature`` (``OffPolicyRLModule(temperature=)``),
    or the mismatch metrics measure the temperature instead of the engine.

    Args:
        max_new_tokens: Maximum tokens generated per completion.
        temperature: Softmax temperature, > 0 (the module must score with the same).
        top_k: Keep the ``top_k`` most likely tokens (0: off).
        top_p: Nucleus sampling mass (1.0: off).
        samples_per_prompt: Completions per prompt (the group of GRPO / RLOO).
        greedy: Argmax decoding, one completion per prompt, for evaluation only (its logprobs are
            not a sampling distribution's: never train on them).
        sampling_mask: Under top-k / top-p, renormalize the trainer's logprobs over the tokens the
            sampler kept (docs/off_policy_correction.md, "Sampling masks"); ``False`` is for
            comparisons only.

    Raises:
        ValueError: A setting is out of range; the message names it and what is allowed.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    samples_per_prompt: int = 4
    greedy: bool = False
    sampling_mask: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens} must be at least 1.")
        if not isinstance(self.greedy, bool):
            raise ValueError(f"SamplingConfig.greedy={self.greedy!r} must be a bool.")
        if not isinstance(self.sampling_mask, bool):
            raise ValueError(f"SamplingConfig.sampling_mask={self.sampling_mask!r} must be a bool.")
        if self.greedy and self.samples_per_prompt != 1:
            raise ValueError(
                f"SamplingConfig(greedy=True, samples_per_prompt={self.samples_per_prompt}): greedy decoding gives "
                "one completion per prompt; set samples_per_prompt=1."
            )
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"SamplingConfig.temperature={self.temperature} must be > 0: RL needs the logprobs of a "
                "sampling distribution (for greedy evaluation use SamplingConfig(greedy=True, samples_per_prompt=1))."
            )
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 disables it).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1].")
        if self.samples_per_prompt < 1:
            raise ValueError(f"SamplingConfig.samples_per_prompt={self.samples_per_prompt} must be at least 1.")

    def sampler_settings(self) -> dict[str, float | int]:
        """``temperature`` / ``top_k`` / ``top_p`` as vLLM takes them: temperature 0 (argmax) when ``greedy``."""
        if self.greedy:
            return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cuts the sampling distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def support_needed(self) -> bool:
        """Whether completions must carry the support their sampler kept (``truncates`` and ``sampling_mask``)."""
        return self.truncates and self.sampling_mask


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        prompt_index: index of its prompt in the ``generate`` call.
        token_ids: generated token ids (the stop token included when one was produced).
        logprobs: per-token logprobs under the distribution actually sampled (``pi_rollout``).
        finish_reason: ``"stop"`` (end-of-sequence token), ``"length"``, or :data:`INTERRUPTED`
            (the call was cut short by :meth:`RolloutEngine.interrupt`: ``token_ids`` are the tokens
            sampled so far, possibly none, to be continued).
        policy_version: version of the weights that generated the tokens: one int, or one per token
            when the completion was continued after a weight push (a partial rollout).
        sampling_support: under top-k / top-p, the ids of the tokens the sampler kept at each
            generated position (the sampled one among them; ``[]``: the whole vocabulary was kept),
            one list per token: the support ``logprobs`` are normalized over, which the trainer
            renormalizes its own logprobs over (docs/off_policy_correction.md, "Sampling masks").
            An entry is ``None`` where the engine could not tell (the token then leaves the loss).
            ``None`` when nothing was cut (no top-k / top-p) or the engine cannot say.
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    policy_version: int | list[int]
    sampling_support: list[list[int] | None] | None = None

    def token_versions(self) -> list[int]:
        """The version of each token (the one int repeated, or the per-token list as it is)."""
        if isinstance(self.policy_version, list):
            return list(self.policy_version)
        return [int(self.policy_version)] * len(self.token_ids)


#: ``Completion.finish_reason`` of a completion cut short by ``interrupt()`` (a partial rollout).
INTERRUPTED = "interrupted"


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples completions with per-token logprobs and accepts new weights."""

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int | None = None
    ) -> list[Completion]:
        """``sampling.samples_per_prompt`` completions per prompt, grouped by prompt in order."""
        ...

    def update_weights(self, source: Any, version: int) -> None:
        """Load the trainer's weights (a module or a state dict) and tag what follows with ``version``."""
        ...

    def close(self) -> None:
        """Release processes and memory."""
        ...


@runtime_checkable
class InterruptibleEngine(RolloutEngine, Protocol):
    """An engine whose ``generate`` can be cut short from another thread (partial rollouts).

    :meth:`interrupt` makes the ``generate`` call in flight (or, when none is, the next one) return
    soon, with each completion that has not finished as an :data:`INTERRUPTED` ``Completion``
    holding the tokens and logprobs sampled so far. A call consumes the interrupt: the one after
    it runs normally. The caller continues an interrupted completion by generating from
    ``prompt + token_ids`` (:func:`lightning_offpolicy.rollout.partial.generate_resumable`),
    typically after pushing new weights (AReaL's, slime's and SkyRL's partial rollouts).
    """

    def interrupt(self) -> None:
        """Cut the ``generate`` call in flight short (thread-safe; returns at once)."""
        ...


class SpecialTokens:
    """The padding / stop ids of an engine, filled in from the module's tokenizer and model when not given.

    A completion ends at the first of its :attr:`stop_ids`: ``eos_token_id`` and every id of
    ``stop_token_ids`` (the ``RolloutCallback`` fills these in with the eos ids the model's
    generation config lists: ``generation_config.eos_token_id``, an int or a list).
    """

    pad_token_id: int | None = None
    eos_token_id: int | None = None
    stop_token_ids: list[int] | None = None

    def set_special_tokens(
        self, pad_token_id: int | None, eos_token_id: int | None, stop_token_ids: list[int] | None = None
    ) -> None:
        """Fill in the padding / stop ids that were not given at construction."""
        if self.pad_token_id is None:
            self.pad_token_id = pad_token_id
        if self.eos_token_id is None:
            self.eos_token_id = eos_token_id
        if self.stop_token_ids is None and stop_token_ids is not None:
            self.stop_token_ids = checked_token_ids(stop_token_ids, f"{type(self).__name__}.stop_token_ids")

    @property
    def stop_ids(self) -> list[int]:
        """Every id that ends a completion: ``eos_token_id`` first, then ``stop_token_ids``, no repeats."""
        ids = [] if self.eos_token_id is None else [int(self.eos_token_id)]
        for token in self.stop_token_ids or ():
            if int(token) not in ids:
                ids.append(int(token))
        return ids


def checked_token_ids(ids: Any, who: str) -> list[int]:
    """``ids`` (an int or a list / tuple of ints, each >= 0) as a list; ``ValueError`` naming ``who`` otherwise."""
    items = [ids] if isinstance(ids, int) else ids
    valid = isinstance(items, (list, tuple)) and all(is_int(t) and t >= 0 for t in items)
    if not valid:
        raise ValueError(f"{who}={ids!r} must be token ids (an int or a list of ints, each >= 0).")
    return [int(t) for t in items]


def generation_eos_ids(model: Any) -> list[int]:
    """The eos ids ``model.generation_config`` lists (``eos_token_id``: an int or a list); ``[]`` if none.

    A chat model often ends a turn with a token other than its tokenizer's eos (Llama 3's
    ``<|eot_id|>``, Qwen's ``<|im_end|>``): its generation config lists both, and vLLM and
    ``transformers`` stop on all of them.
    """
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    if hasattr(eos, "tolist"):
        eos = eos.tolist()
    return checked_token_ids(eos, "generation_config.eos_token_id")


def fill_special_tokens(engine: Any, model: Any, tokenizer: Any) -> None:
    """Give ``engine`` (when it has ``set_special_tokens``) the tokenizer's padding id and every stop id.

    The engine stops where the model's generation config says (a chat model's end-of-turn id
    included), as transformers and vLLM do, besides the tokenizer's eos.
    """
    if not hasattr(engine, "set_special_tokens"):
        return
    eos_ids = generation_eos_ids(model)
    eos = tokenizer.eos_token_id
    engine.set_special_tokens(
        tokenizer.pad_token_id, eos if eos is not None else (eos_ids[0] if eos_ids else None), stop_token_ids=eos_ids
    )


def first_stop(tokens: list[int], stop_ids: list[int]) -> tuple[int, str]:
    """``(length, finish_reason)`` of a sampled row: up to and including the first stop id (``"stop"``),
    else the whole row (``"length"``)."""
    stops = set(stop_ids)
    for position, token in enumerate(tokens):
        if token in stops:
            return position + 1, "stop"
    return len(tokens), "length"


def checked_prompts(prompt_ids: list[list[int]], who: str) -> list[list[int]]:
    """The prompts as lists of python ints; ``ValueError`` (naming ``who``) for an empty one or a negative id."""
    prompts = [[int(t) for t in p] for p in prompt_ids]
    if any(len(p) == 0 for p in prompts):
        raise ValueError(f"{who}: every prompt needs at least one token.")
    if any(t < 0 for p in prompts for t in p):
        raise ValueError(f"{who}: token ids must be >= 0.")
    return prompts


def prompt_seed(seed: int, prompt: str | list[dict[str, Any]]) -> int:
    """The sampler seed of ``prompt``'s evaluation samples: a function of ``seed`` and the prompt only
    (a text, or a chat ``messages`` list).

    >>> prompt_seed(0, "rev abc=") == prompt_seed(0, "rev abc=") != prompt_seed(1, "rev abc=")
    True
    """
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return (int(seed) * 1_000_003 + zlib.crc32(text.encode("utf-8"))) % (2**31 - 1)


def per_prompt_seeds(seed: int | None, num_prompts: int, samples_per_prompt: int) -> list[int | None]:
    """One sampler seed per prompt drawn from ``seed`` (``None``: unseeded), the vLLM engines' shared scheme.

    vLLM gives the ``i``-th of the ``n`` samples of a request the seed ``seed + i``: the draws leave
    room for ``n`` below 2**31.
    """
    if seed is None:
        return [None] * num_prompts
    rng = random.Random(seed)
    return [rng.randrange(2**31 - samples_per_prompt) for _ in range(num_prompts)]
