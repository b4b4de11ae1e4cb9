"""Built-in verifiable rewards: math answers checked by ``math-verify``, and a regex format reward."""

from __future__ import annotations

import itertools
import logging
import re
from typing import Any

from lightning_offpolicy.argcheck import is_number
from lightning_offpolicy.data.rewards.deadline import Deadline

__all__ = ["MathAnswerReward", "RegexFormatReward", "math_answer"]

log = logging.getLogger(__name__)


class MathAnswerReward:
    """1.0 when the completion's final answer equals ``metadata[answer_key]`` mathematically, else 0.0.

    Both sides go through ``math_verify.parse`` (LaTeX such as ``\\boxed{...}`` or ``$...$``, and
    plain expressions; the last answer in the completion counts) and are compared with
    ``math_verify.verify``, so ``"\\frac{1}{2}"`` and ``"0.5"`` agree.

    >>> MathAnswerReward()(["half?"], ["The answer is $\\\\frac{1}{2}$"], [{"answer": "0.5"}])
    [1.0]

    Args:
        answer_key: The metadata key (data column) holding the reference answer.
        timeout_seconds: Time limit of each parse and of each comparison, as math-verify's own:
            an answer that takes longer scores 0.0 (math-verify logs "Timeout during parsing" /
            "Timeout during comparison") and the next one is scored. It works on any thread
            (the reward's worker thread, the asynchronous rollout thread): math-verify's
            ``SIGALRM`` timer only works on the main thread, so this reward calls it without one
            and raises math-verify's ``TimeoutException`` into the scoring thread itself at the
            deadline (:class:`~lightning_offpolicy.data.rewards.deadline.Deadline`), where the alarm's
            handler would raise it. ``None``: no limit.
    """

    def __init__(self, answer_key: str = "answer", timeout_seconds: float | None = 5) -> None:
        if not isinstance(answer_key, str) or not answer_key:
            raise ValueError(f"MathAnswerReward: `answer_key` must be a non-empty string, got {answer_key!r}.")
        if timeout_seconds is not None and not (is_number(timeout_seconds) and timeout_seconds > 0):
            raise ValueError(
                "MathAnswerReward: `timeout_seconds` must be > 0 (seconds) or None (no limit), got "
                f"{timeout_seconds!r}."
            )
        self.answer_key = answer_key
        self.timeout_seconds = timeout_seconds
        self.__name__ = "math_answer"

    def __call__(self, prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        _quiet_math_verify_timeout_notice()
        rewards = []
        for completion, meta in zip(completions, metadata, strict=True):
            if self.answer_key not in meta:
                raise KeyError(
                    f"MathAnswerReward: the row's metadata has no {self.answer_key!r} (keys: {sorted(meta)}); set "
                    "`answer_key` to the column with the reference answer."
                )
            gold = self._parse(str(meta[self.answer_key]))
            if not gold:
                raise ValueError(
                    f"MathAnswerReward: math-verify cannot parse the reference answer {meta[self.answer_key]!r}."
                )
            predicted = self._parse(completion)
            rewards.append(1.0 if predicted and self._verify(gold, predicted) else 0.0)
        return rewards

    def _parse(self, text: str) -> list[Any]:
        """``math_verify.parse`` within ``timeout_seconds`` (``[]`` past it, as math-verify's own timeout)."""
        from math_verify import parse
        from math_verify.errors import TimeoutException

        try:
            with Deadline(self.timeout_seconds, TimeoutException):
                return parse(text, parsing_timeout=None)
        except TimeoutException:  # arrived outside parse's own handler
            log.warning("math_answer: parsing took longer than timeout_seconds=%g s: %.80r", self.timeout_seconds, text)
            return []

    def _verify(self, gold: list[Any], predicted: list[Any]) -> bool:
        """``math_verify.verify``: any pair equal, each comparison within ``timeout_seconds`` (False past it)."""
        from math_verify import verify
        from math_verify.errors import TimeoutException

        for expected, answer in itertools.product(gold, predicted):
            try:
                with Deadline(self.timeout_seconds, TimeoutException):
                    equal = verify(expected, answer, timeout_seconds=None)
            except TimeoutException:  # arrived outside verify's own handler
                log.warning("math_answer: a comparison took longer than timeout_seconds=%g s", self.timeout_seconds)
                equal = False
            if equal:
                return True
        return False

    def __repr__(self) -> str:
        return f"MathAnswerReward(answer_key={self.answer_key!r}, timeout_seconds={self.timeout_seconds!r})"


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns "Timeout is disabled" when called without its signal timer; this reward has its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_NOTICE_FILTER = _DropTimeoutDisabledNotice()


def _quiet_math_verify_timeout_notice() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _NOTICE_FILTER not in logger.filters:
            logger.addFilter(_NOTICE_FILTER)


#: ``MathAnswerReward()``: import path ``lightning_offpolicy.data.rewards.math_answer``.
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
