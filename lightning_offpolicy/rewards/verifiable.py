"""Built-in verifiable rewards: math answers checked by ``math-verify``, and a regex format reward."""

from __future__ import annotations

import re
import threading
from typing import Any

__all__ = ["MathAnswerReward", "RegexFormatReward", "math_answer"]


class MathAnswerReward:
    """1.0 when the completion's final answer equals ``metadata[answer_key]`` mathematically, else 0.0.

    Both sides go through ``math_verify.parse`` (LaTeX such as ``\\boxed{...}`` or ``$...$``, and
    plain expressions; the last answer in the completion counts) and are compared with
    ``math_verify.verify``, so ``"\\frac{1}{2}"`` and ``"0.5"`` agree.

    >>> MathAnswerReward()(["half?"], ["The answer is $\\\\frac{1}{2}$"], [{"answer": "0.5"}])
    [1.0]

    Args:
        answer_key: The metadata key (data column) holding the reference answer.
        timeout_seconds: math-verify's time limit per parse / comparison. It relies on
            ``SIGALRM``, which only the main thread may use: in the asynchronous rollout thread
            no limit applies.
    """

    def __init__(self, answer_key: str = "answer", timeout_seconds: int = 5) -> None:
        if not isinstance(answer_key, str) or not answer_key:
            raise ValueError(f"MathAnswerReward: `answer_key` must be a non-empty string, got {answer_key!r}.")
        self.answer_key = answer_key
        self.timeout_seconds = timeout_seconds
        self.__name__ = "math_answer"

    def __call__(self, prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        from math_verify import parse, verify

        timeout = self.timeout_seconds if threading.current_thread() is threading.main_thread() else None
        rewards = []
        for completion, meta in zip(completions, metadata, strict=True):
            if self.answer_key not in meta:
                raise KeyError(
                    f"MathAnswerReward: the row's metadata has no {self.answer_key!r} (keys: {sorted(meta)}); set "
                    "`answer_key` to the column with the reference answer."
                )
            gold = parse(str(meta[self.answer_key]), parsing_timeout=timeout)
            if not gold:
                raise ValueError(
                    f"MathAnswerReward: math-verify cannot parse the reference answer {meta[self.answer_key]!r}."
                )
            predicted = parse(completion, parsing_timeout=timeout)
            rewards.append(1.0 if predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0)
        return rewards

    def __repr__(self) -> str:
        return f"MathAnswerReward(answer_key={self.answer_key!r})"


#: ``MathAnswerReward()``: import path ``lightning_offpolicy.rewards.math_answer``.
math_answer = MathAnswerReward()


class RegexFormatReward:
    """1.0 when the completion matches ``pattern``, else 0.0 (e.g. a required answer format).

    >>> RegexFormatReward(r"<answer>.*</answer>")([None, None], ["x <answer>4</answer>", "4"], [{}, {}])
    [1.0, 0.0]

    Args:
        pattern: A Python regular expression.
        full_match: The whole completion (stripped of surrounding whitespace) must match, rather
            than some part of it.
        dotall: ``.`` also matches newlines.
    """

    def __init__(self, pattern: str, full_match: bool = False, dotall: bool = True) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL if dotall else 0)
        except (re.error, TypeError) as error:
            raise ValueError(
                f"RegexFormatReward: `pattern`={pattern!r} is not a valid regular expression: {error}"
            ) from error
        self.pattern = pattern
        self.full_match = full_match
        self.__name__ = "format"

    def __call__(self, prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        match = self.regex.fullmatch if self.full_match else self.regex.search
        return [1.0 if match(c.strip() if self.full_match else c) else 0.0 for c in completions]

    def __repr__(self) -> str:
        return f"RegexFormatReward({self.pattern!r}, full_match={self.full_match})"
