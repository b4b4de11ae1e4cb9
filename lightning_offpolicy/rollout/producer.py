"""Background rollout generation with bounded staleness (admission control).

A :class:`RolloutProducer` owns one thread that turns prompt batches into scored rollouts while
the trainer trains. Staleness is bounded by *admission*, not by discarding: batch ``j`` (counted
from the start of the run) is started only when the engine's weights are recent enough that it
will be trained at most ``max_staleness`` policy versions later:

    trainer_version + (j - next_to_train) * steps_per_batch - engine_version <= max_staleness

where ``next_to_train`` is the index of the batch the trainer takes next, ``trainer_version`` the
policy version it will train that batch at, and ``steps_per_batch`` the optimizer steps one batch
costs (``ppo_epochs * num_minibatches``). This is the capacity rule of AReaL and SkyRL ("at most
``(k + version + 1) * batch`` samples may have been started") written in versions: generation never
produces what could only be trained too late, so nothing generated is thrown away and no bias
towards short (fast) responses creeps in. Should a batch still arrive too stale (the trainer took
more optimizer steps per batch than announced), it is not trained: its prompts are generated again
with fresh weights and the samples are counted in ``dropped_samples``.

The engine is shared with the trainer thread, which pushes new weights between two generation
requests (:meth:`RolloutProducer.engine_access`). By default a push waits for the request in
flight. With ``interrupt`` (partial rollouts, :mod:`lightning_offpolicy.rollout.partial`) it does
not: the push interrupts the request, takes the engine as soon as the call returns with its
partial completions, and ``produce`` continues them under the new weights, each engine call in a
:meth:`RolloutProducer.generation_turn`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lightning_offpolicy.batch import PromptBatch, RolloutBatch

__all__ = ["ProducedRollout", "ProducerStopped", "RolloutProducer"]

#: Seconds between two checks of the producer's health while the trainer waits for a batch.
_POLL_S = 0.05


class ProducerStopped(Exception):
    """Raised in the producer thread by :meth:`RolloutProducer.generation_turn` after a stop request."""


@dataclass
class ProducedRollout:
    """One generated, scored batch.

    Attributes:
        index: Position of the batch in the run (its seed and its admission slot derive from it).
        prompts: The prompts it was generated from.
        rollout: The scored rollout, per-token policy versions included.
        generate_s: Seconds the engine call took.
        tokens: Generated (response) tokens.
    """

    index: int
    prompts: PromptBatch
    rollout: RolloutBatch
    generate_s: float
    tokens: int


class RolloutProducer:
    """A generation thread that runs ahead of the trainer by at most ``max_staleness`` versions.

    Args:
        produce: ``(prompts, index) -> (rollout, generate_s)``: generates and scores one batch with the
            engine as it is (called in the producer thread; inside :meth:`engine_access` without
            ``interrupt``, else it takes a :meth:`generation_turn` for each engine call itself).
        prompt_batches: Endless iterator of the prompt batches to generate, in order.
        max_staleness: Largest number of policy versions between generation and training.
        steps_per_batch: Optimizer steps (policy versions) the trainer takes per batch.
        first_index: Index of the first batch generated (it numbers the seeds: batches trained before
            a resume).
        trainer_version: Policy version the first batch will be trained at.
        engine_version: Version of the weights in the engine now.
        interrupt: Cuts the engine's request in flight short (``engine.interrupt``); ``None``: a push
            waits for the request in flight.
    """

    def __init__(
        self,
        produce: Callable[[PromptBatch, int], tuple[RolloutBatch, float]],
        prompt_batches: Iterator[PromptBatch],
        max_staleness: int,
        steps_per_batch: int,
        first_index: int,
        trainer_version: int,
        engine_version: int,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"RolloutProducer.max_staleness={max_staleness} must be >= 0.")
        if steps_per_batch < 1:
            raise ValueError(f"RolloutProducer.steps_per_batch={steps_per_batch} must be >= 1.")
        self._produce = produce
        self._prompt_batches = prompt_batches
        self.max_staleness = max_staleness
        self.steps_per_batch = steps_per_batch
        self._cond = threading.Condition()
        self._engine_lock = threading.Lock()
        self._interrupt = interrupt
        self._pushes_waiting = 0  # trainer-side engine_access calls waiting for or holding the engine
        self._turns_in_flight = 0  # the producer's generation calls in flight (or about to start)
        self._ready: collections.deque[ProducedRollout] = collections.deque()
        self._retry: collections.deque[PromptBatch] = collections.deque()
        self._next_index = first_index
        # The policy version at which the trainer will train the next batch it takes.
        self._next_train_version = trainer_version
        self._engine_version = engine_version
        self._stop = False
        self._error: BaseException | None = None
        self.dropped_samples = 0
        self._thread = threading.Thread(target=self._run, name="RolloutProducer", daemon=True)

    # ------------------------------------------------------------------------------ trainer side
    def start(self) -> None:
        self._thread.start()

    @property
    def engine_version(self) -> int:
        return self._engine_version

    @property
    def queue_depth(self) -> int:
        """Finished batches waiting for the trainer."""
        with self._cond:
            return len(self._ready)

    @property
    def interrupts(self) -> bool:
        """Whether :meth:`engine_access` interrupts the request in flight instead of waiting for it."""
        return self._interrupt is not None

    @contextlib.contextmanager
    def engine_access(self) -> Iterator[None]:
        """Exclusive use of the engine for the trainer thread (a push, an evaluation).

        Waits for the generation requests in flight, or, with ``interrupt``, cuts them short; the
        producer takes no new :meth:`generation_turn` until every waiting access is done.
        """
        if self._interrupt is None:
            with self._engine_lock:
                yield
            return
        with self._cond:
            self._pushes_waiting += 1
            # Only a call in flight (or one past its turn's wait) is interrupted: an interrupt of an
            # idle engine would cut the producer's next call short for nothing.
            in_flight = self._turns_in_flight > 0
        try:
            if in_flight:
                self._interrupt()
            with self._cond:  # the interrupted calls end soon; none starts while an access waits
                while self._turns_in_flight:
                    self._cond.wait()
            with self._engine_lock:  # one access at a time (a push, an evaluation)
                yield
        finally:
            with self._cond:
                self._pushes_waiting -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def generation_turn(self) -> Iterator[None]:
        """The engine for one generation call of the producer, after any push that is waiting.

        Several turns may be held at once (the independent episodes of a batch on an engine that serves
        concurrent calls); an :meth:`engine_access` waits for all of them.

        Raises:
            ProducerStopped: :meth:`request_stop` was called: the batch being generated is abandoned
                (nothing of it was handed to the trainer).
        """
        with self._cond:
            while self._pushes_waiting and not self._stop:
                self._cond.wait()
            if self._stop:
                raise ProducerStopped
            self._turns_in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._turns_in_flight -= 1
                self._cond.notify_all()

    def set_engine_version(self, version: int) -> None:
        """Record that the engine now holds the weights of ``version`` (call inside :meth:`engine_access`)."""
        with self._cond:
            self._engine_version = version
            self._cond.notify_all()

    def take(self, trainer_version: int) -> tuple[ProducedRollout, float]:
        """The next batch to train at ``trainer_version``, and the seconds spent waiting for it.

        Raises ``RuntimeError`` (with the cause chained) when the producer thread failed.
        """
        began = time.perf_counter()
        with self._cond:
            self._next_train_version = trainer_version
            while True:
                self._raise_if_failed()
                if self._ready:
                    produced = self._ready.popleft()
                    if trainer_version - _oldest_version(produced.rollout, trainer_version) <= self.max_staleness:
                        self._next_train_version = trainer_version + self.steps_per_batch
                        self._cond.notify_all()
                        return produced, time.perf_counter() - began
                    # Too stale to train (the trainer took more optimizer steps per batch than
                    # announced): generate these prompts again with fresh weights, don't lose them.
                    self.dropped_samples += produced.rollout.input_ids.shape[0]
                    self._retry.append(produced.prompts)
                    self._cond.notify_all()
                    continue
                if not self._thread.is_alive():
                    raise RuntimeError("RolloutCallback: the background rollout producer is not running.")
                self._cond.wait(_POLL_S)

    def observe_steps_per_batch(self, steps: int) -> None:
        """Adopt a larger number of optimizer steps per batch than announced (keeps admission exact)."""
        with self._cond:
            if steps > self.steps_per_batch:
                self.steps_per_batch = steps
                self._cond.notify_all()

    def request_stop(self) -> None:
        """Start no new generation request; with ``interrupt``, cut the one in flight short too.

        Without ``interrupt`` the request in flight finishes (or fails if the engine is closed).
        """
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            in_flight = self._turns_in_flight > 0
        if self._interrupt is not None and in_flight:
            self._interrupt()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait for it (close the engine first to cut a long request short)."""
        self.request_stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------ producer side
    def _admissible(self) -> bool:
        # The batch started now is trained after every queued one: at this version.
        planned = self._next_train_version + len(self._ready) * self.steps_per_batch
        return planned - self._engine_version <= self.max_staleness

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and not self._admissible():
                        self._cond.wait()
                    if self._stop:
                        return
                    index = self._next_index
                    self._next_index += 1
                    prompts = self._retry.popleft() if self._retry else None
                if prompts is None:
                    prompts = next(self._prompt_batches)
                with contextlib.nullcontext() if self.interrupts else self._engine_lock:
                    if self._stop:
                        return
                    rollout, generate_s = self._produce(prompts, index)
                produced = ProducedRollout(
                    index=index,
                    prompts=prompts,
                    rollout=rollout,
                    generate_s=generate_s,
                    tokens=rollout.num_response_tokens,
                )
                with self._cond:
                    self._ready.append(produced)
                    self._cond.notify_all()
        except ProducerStopped:
            return
        except BaseException as err:  # noqa: BLE001 - handed to the trainer thread by take()
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"RolloutCallback: background rollout generation failed: {type(self._error).__name__}: {self._error}"
            ) from self._error


def _oldest_version(rollout: RolloutBatch, default: int) -> int:
    tokens = rollout.response_mask.bool()
    return int(rollout.policy_version[tokens].min()) if tokens.any() else default
