"""Call a reward function on a batch and check what it returns, naming the function and the row at fault.

Each call runs under a time limit (``timeout_s``, the callback's ``reward_timeout_s``): in a
worker thread that the caller waits for with a deadline. A call still running when the deadline
passes is abandoned: the caller raises :class:`RewardError` naming the function and the row it
was scoring, and an exception is raised into the worker thread to stop it at its next Python
bytecode (:mod:`lightning_offpolicy.data.rewards.deadline`). A call slower than ``report_every_s`` is
reported in the log while it runs.

Why a thread and not a process: the reward keeps its objects as they are (a loaded reward model,
a cache, the metadata, a GPU), nothing has to be picklable, and there is no start-up cost per call;
the worker gets the calling thread's torch state (grad / inference mode, current CUDA device).
The price: a thread cannot be killed. A reward stuck in one long C call that holds the GIL (a
catastrophic regular expression) blocks the waiting thread too, and one waiting in C without the
GIL (a socket without a timeout) stays behind as a daemon thread, which does not keep the process
from exiting. Such a reward should bound its own work (a socket timeout), or hand it to a process
of its own (``concurrent.futures.ProcessPoolExecutor``) inside the reward. With ``timeout_s=None``
the reward runs on the calling thread (the trainer's main thread in synchronous mode), for
rewards that must, with the slow-call reports but no limit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_offpolicy.argcheck import is_number
from lightning_offpolicy.data.rewards.deadline import raise_in_thread
from lightning_offpolicy.data.rewards.named import reward_name

__all__ = [
    "DEFAULT_REWARD_TIMEOUT_S",
    "MAX_ABS_REWARD",
    "PartedReward",
    "RewardError",
    "ScoredRewards",
    "describe_row",
    "score_completions",
    "score_one",
]

log = logging.getLogger(__name__)

_SNIPPET = 80

#: Default time limit of one reward call on a batch (``RolloutCallback.reward_timeout_s``).
DEFAULT_REWARD_TIMEOUT_S = 60.0

#: Most seconds a reward call runs before the first "still running" report (then at doubling intervals).
REPORT_AFTER_S = 10.0

#: Largest reward magnitude accepted. Rewards and advantages are float32 in the trainer (7
#: significant digits): at 1e6 the smallest difference it still tells apart is 0.06, so the
#: differences that make the advantages vanish in rounding beyond it, and further up their squares
#: (``train/reward_std``, past ~1.8e19) and the gradients (advantage x d logprob) overflow to inf
#: and NaN. Within it, every float32 statistic stays finite with orders of magnitude to spare.
MAX_ABS_REWARD = 1e6


class RewardError(RuntimeError):
    """A reward function raised, timed out, or returned the wrong number of rewards or a bad one."""


class _Abandoned(BaseException):
    """Raised into the thread of a reward call that ran past its deadline, to stop it."""


class _TimedOut(Exception):
    def __init__(self, row: int | None, seconds: float) -> None:
        super().__init__(row, seconds)
        self.row = row
        self.seconds = seconds


@dataclass
class ScoredRewards:
    """``total``: ``[N]`` float64 reward per completion; ``components``: ``name -> [N]`` (weighted rewards only)."""

    total: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)


#: ``(timeout_s, report_every_s)`` of each reward call, as :func:`score_completions` settled them.
Limits = tuple[float | None, float]


@runtime_checkable
class PartedReward(Protocol):
    """A reward made of named parts (:class:`~lightning_offpolicy.data.rewards.WeightedReward`).

    :func:`score_completions` hands it the batch and the call limits; it scores each part with
    :func:`score_one` and returns the total and the parts (each logged as ``reward/<name>``).
    """

    def score_parts(
        self, prompts: list[Any], completions: list[str], metadata: list[dict[str, Any]], limits: Limits
    ) -> ScoredRewards: ...


def score_completions(
    reward_fn: Callable[..., Any],
    prompts: list[Any],
    completions: list[str],
    metadata: list[dict[str, Any]],
    *,
    timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
    report_every_s: float | None = None,
) -> ScoredRewards:
    """Score ``completions`` with ``reward_fn`` (a :class:`PartedReward` part by part) and check the result.

    Args:
        timeout_s: Longest one call of a reward function may take (each part of a weighted reward
            is one call); ``None``: no limit, and the call runs on this thread.
        report_every_s: A call still running after this many seconds is reported in the log (then
            after twice, four times as long...). ``None``: ``REPORT_AFTER_S`` (10 s), or half of
            ``timeout_s`` when that is shorter.

    Raises:
        RewardError: the function raised (the first row that fails on its own is named), did not
            return within ``timeout_s`` (with the row it was scoring when that can be told),
            returned something other than one number per completion (its type and first value are
            named), or a value that is not finite or larger than ``MAX_ABS_REWARD`` in magnitude
            (the row is named: index, prompt and the start of the completion).
    """
    if timeout_s is not None and not (is_number(timeout_s) and timeout_s > 0):
        raise ValueError(f"score_completions: timeout_s={timeout_s!r} must be > 0 (seconds) or None (no limit).")
    if report_every_s is not None and not (is_number(report_every_s) and report_every_s > 0):
        raise ValueError(f"score_completions: report_every_s={report_every_s!r} must be > 0 (seconds) or None.")
    if report_every_s is None:
        report_every_s = REPORT_AFTER_S if timeout_s is None else min(REPORT_AFTER_S, timeout_s / 2)
    limits = (timeout_s, report_every_s)
    if isinstance(reward_fn, PartedReward):
        return reward_fn.score_parts(prompts, completions, metadata, limits)
    return ScoredRewards(total=score_one(reward_fn, prompts, completions, metadata, limits))


def describe_row(index: int, prompts: list[Any], completions: list[str]) -> str:
    """``row 3 (prompt '...', completion '...')``: row ``index`` of a batch in a message, both texts cut short."""
    completion = str(completions[index])
    snippet = completion[:_SNIPPET] + ("..." if len(completion) > _SNIPPET else "")
    return f"row {index} (prompt {str(prompts[index])[:_SNIPPET]!r}, completion {snippet!r})"


def _first_value(values: Any) -> str:
    """``first value 0.5`` of a sized, indexable result, for messages (empty: ``no values``)."""
    try:
        first = values[0]
    except (IndexError, KeyError):
        return "no values"
    except Exception:
        return "first value unknown"
    return f"first value {_short(first)} ({type(first).__name__})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SNIPPET else text[:_SNIPPET] + "..."


def score_one(
    fn: Callable[..., Any],
    prompts: list[Any],
    completions: list[str],
    metadata: list[dict],
    limits: Limits,
) -> torch.Tensor:
    """``fn(prompts, completions, metadata)`` under ``limits``, checked: ``[N]`` float64 rewards.

    Raises:
        RewardError: as :func:`score_completions` describes, for this one function.
    """
    name = reward_name(fn)
    count = len(completions)
    expected = f"expected a list of {count} floats (one per completion, in order)"
    timeout_s, _ = limits
    try:
        values = _call(fn, name, prompts, completions, metadata, limits)
    except _TimedOut as timed_out:
        where = (
            f"it was scoring {describe_row(timed_out.row, prompts, completions)}"
            if timed_out.row is not None
            else "the row it was scoring could not be told (score the rows one at a time to find it)"
        )
        raise RewardError(
            f"reward function {name} did not return within reward_timeout_s={timeout_s:g} s on a batch of {count} "
            f"completions, and was abandoned; {where}. Fix the reward for that input (or bound its own work), or "
            "raise reward_timeout_s (null: no limit) if it is only slow."
        ) from None
    except Exception as error:
        row = _first_failing_row(fn, name, prompts, completions, metadata, limits)
        where = (
            f" at {describe_row(row, prompts, completions)}"
            if row is not None
            else f" on a batch of {count} completions"
        )
        raise RewardError(
            f"reward function {name} raised {type(error).__name__}: {error}{where}.{_thread_hint(error, timeout_s)}"
        ) from error
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise RewardError(f"reward function {name} returned a {type(values).__name__} ({_short(values)}); {expected}.")
    try:
        values = list(values)
    except Exception as error:
        raise RewardError(
            f"reward function {name} returned a {type(values).__name__} that cannot be read as a list "
            f"({type(error).__name__}: {error}); {expected}."
        ) from error
    if len(values) != count:
        raise RewardError(
            f"reward function {name} returned {len(values)} rewards for {count} completions "
            f"({_first_value(values)}); {expected}."
        )
    numbers = []
    for index, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {name} returned {_short(value)} (a {type(value).__name__}, not a number) at "
                f"{describe_row(index, prompts, completions)}; {expected}."
            ) from None
        if not math.isfinite(number):
            raise RewardError(
                f"reward function {name} returned {number} at {describe_row(index, prompts, completions)}; rewards "
                "must be finite numbers."
            )
        if abs(number) > MAX_ABS_REWARD:
            raise RewardError(
                f"reward function {name} returned {number:g} at {describe_row(index, prompts, completions)}; rewards "
                f"must lie within +-{MAX_ABS_REWARD:g}: the trainer keeps rewards and advantages in float32, where "
                "larger ones lose the differences between completions and overflow to inf / nan in the statistics "
                "and the gradients. Scale the reward down."
            )
        numbers.append(number)
    return torch.tensor(numbers, dtype=torch.float64)


def _thread_hint(error: BaseException, timeout_s: float | None) -> str:
    text = str(error)
    if timeout_s is None or not ("main thread" in text or "threaded environment" in text):
        return ""
    return (
        " The reward runs in a worker thread under reward_timeout_s, where signal-based timeouts (math-verify's "
        "parse / verify with their default timeouts) do not work: pass parsing_timeout=None / timeout_seconds=None "
        "in your reward (the call is bounded by reward_timeout_s; lightning_offpolicy.data.rewards.math_answer keeps "
        "a per-answer limit on any thread), or set reward_timeout_s to null to run it on the calling thread (the "
        "trainer's main thread in synchronous mode)."
    )


def _call(
    fn: Callable[..., Any],
    name: str,
    prompts: list[Any],
    completions: list[str],
    metadata: list[dict],
    limits: Limits,
) -> Any:
    """``fn(prompts, completions, metadata)`` under the deadline, reporting a slow call; ``_TimedOut`` past it."""
    timeout_s, report_every_s = limits
    started = time.monotonic()
    if timeout_s is None:  # on this thread; a watcher reports a slow call
        finished = threading.Event()
        caller = threading.get_ident()
        watcher = threading.Thread(
            target=_watch,
            args=(finished, caller, name, prompts, completions, started, report_every_s),
            name=f"reward watcher ({name})",
            daemon=True,
        )
        watcher.start()
        try:
            return fn(prompts, completions, metadata)
        finally:
            finished.set()

    outcome: dict[str, Any] = {}
    context = _callers_torch_context()

    def run() -> None:
        try:
            with context():
                outcome["value"] = fn(prompts, completions, metadata)
        except BaseException as error:  # noqa: BLE001 -- handed to the waiting thread
            outcome["error"] = error

    worker = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    worker.start()
    deadline = started + timeout_s
    report_at = started + report_every_s
    try:
        while True:
            worker.join(max(min(deadline, report_at) - time.monotonic(), 0.0))
            if not worker.is_alive():
                break
            now = time.monotonic()
            if now >= deadline:
                row = _row_in_progress(worker.ident, completions)
                raise_in_thread(worker.ident, _Abandoned)
                raise _TimedOut(row, now - started)
            if now >= report_at:
                _report(name, worker.ident, prompts, completions, now - started, timeout_s)
                report_at = started + 2 * (report_at - started)
    except _TimedOut:
        raise
    except BaseException:
        if worker.is_alive():  # a KeyboardInterrupt / signal while waiting: stop the call too
            raise_in_thread(worker.ident, _Abandoned)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _callers_torch_context() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The calling thread's thread-local torch state, to set in the worker: grad / inference mode and
    the current CUDA device (set per process rank by Lightning; a new thread would start on cuda:0)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        if device is not None:
            torch.cuda.set_device(device)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield

    return apply


def _watch(
    finished: threading.Event,
    caller: int,
    name: str,
    prompts: list[Any],
    completions: list[str],
    started: float,
    report_every_s: float,
) -> None:
    report_at = started + report_every_s
    while not finished.wait(max(report_at - time.monotonic(), 0.0)):
        _report(name, caller, prompts, completions, time.monotonic() - started, None)
        report_at = started + 2 * (report_at - started)


def _report(
    name: str,
    thread_id: int | None,
    prompts: list[Any],
    completions: list[str],
    elapsed: float,
    timeout_s: float | None,
) -> None:
    row = _row_in_progress(thread_id, completions)
    where = f"; now at {describe_row(row, prompts, completions)}" if row is not None else ""
    limit = (
        f"reward_timeout_s={timeout_s:g} s abandons it at {timeout_s:g} s"
        if timeout_s is not None
        else "no reward_timeout_s is set, so it is not abandoned"
    )
    log.warning(
        "reward function %s is still running after %.3g s on a batch of %d completions%s (%s).",
        name,
        elapsed,
        len(completions),
        where,
        limit,
    )


def _row_in_progress(thread_id: int | None, completions: list[str]) -> int | None:
    """The completion the call on ``thread_id`` is scoring now, read from the locals of its frames.

    A batch reward does not say where it is; but one that goes through the completions one by one
    holds the one at hand in a local variable (``for completion in completions``), the very string
    object it was given. The innermost frame holding one of them names the row (the first row
    with that object, should the same string object appear twice). ``None`` when none does.
    """
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    by_id: dict[int, int] = {}
    for index, completion in enumerate(completions):
        by_id.setdefault(id(completion), index)
    while frame is not None:
        if frame.f_globals.get("__name__") == __name__:  # out of the reward, into this module's frames
            return None
        try:
            values = list(frame.f_locals.values())
        except Exception:  # noqa: BLE001 -- a frame that cannot show its locals tells nothing
            values = []
        for value in values:
            if isinstance(value, str) and id(value) in by_id:
                return by_id[id(value)]
        frame = frame.f_back
    return None


def _first_failing_row(
    fn: Callable[..., Any],
    name: str,
    prompts: list,
    completions: list,
    metadata: list,
    limits: Limits,
) -> int | None:
    # A batch function does not say which row broke it: score the rows one at a time to find out.
    for index in range(len(completions)):
        try:
            _call(fn, name, [prompts[index]], [completions[index]], [metadata[index]], limits)
        except _TimedOut:
            return None  # stuck on this row alone: stop looking (the original error is reported)
        except Exception:
            return index
    return None
