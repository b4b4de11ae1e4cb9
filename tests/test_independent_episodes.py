"""Episodes played independently (``EpisodeRunner.run(concurrent_episodes=N)``): on an engine that serves
concurrent calls, each episode's next turn is sampled as soon as its environment answered.

A real engine and runner; the engine is ``HFEngine`` declaring concurrent calls (its calls serialized
by a lock: the runner's side is what is tested here; the vLLM server's side is the engine contract's
episode test, run with the engine's own ``concurrent_calls``). Sleeping steps need no CPU, so the
orderings below hold on a loaded machine.
"""

from __future__ import annotations

import threading
import time

import pytest

from lightning_offpolicy.data.environments import StepResult
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.rollout import HFEngine, SamplingConfig
from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings, _episode_seed
from lightning_offpolicy.rollout.partial import RolloutStopped
from tests.module_helpers import tiny_model

PROMPTS = ["slow", "ab", "cd", "ef"]  # x 2 samples: 8 episodes, the first two with a slow environment
SLOW_S = 0.3


class ConcurrentHF(HFEngine):
    """An HFEngine that says it serves concurrent calls, and records when each call came and what it sampled."""

    concurrent_calls = 8

    def __init__(self) -> None:
        super().__init__(dtype="float32", pad_token_id=0, eos_token_id=2, stop_token_ids=list(range(64)))
        self.update_weights(tiny_model(), version=0)
        self._serial = threading.Lock()
        self.calls: list[tuple[float, list[list[int]], int | None]] = []

    def generate(self, prompt_ids, sampling, seed=None):
        with self._serial:
            self.calls.append((time.monotonic(), [list(p) for p in prompt_ids], seed))
            return super().generate(prompt_ids, sampling, seed=seed)


class Talks:
    """Answers "go" until the model has replied three times; each step of a "slow" prompt's episode sleeps."""

    step_ends: list[tuple[str, float]] = []

    def reset(self, prompt, metadata) -> None:
        self.prompt, self.replies = prompt, 0
        self.delay = metadata.get("delays", {}).get(prompt, 0.0)

    def step(self, reply: str) -> StepResult:
        time.sleep(self.delay)
        self.replies += 1
        Talks.step_ends.append((self.prompt, time.monotonic()))
        return StepResult(messages=[{"role": "user", "content": "go"}], done=self.replies >= 3, reward=0.5)


def play(engine: ConcurrentHF, concurrent: int, delays: dict[str, float] | None = None, **settings):
    runner = EpisodeRunner(
        EpisodeSettings(environment=Talks, max_turns=4, **settings), CharTokenizer(), engine.stop_ids
    )
    ids = runner.prompt_ids(PROMPTS)
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2)
    metadata = [{"delays": delays or {"slow": SLOW_S}}] * len(PROMPTS)
    try:
        return runner.run(PROMPTS, metadata, ids, sampling, engine.generate, 0, 0, concurrent_episodes=concurrent), ids
    finally:
        runner.close()


@pytest.mark.parametrize("concurrent", [8, 1], ids=["independent", "turn-by-turn"])
def test_an_episode_goes_on_as_soon_as_its_environment_answered(concurrent):
    engine, Talks.step_ends = ConcurrentHF(), []
    episodes, ids = play(engine, concurrent)
    assert [len(e.turns) for e in episodes] == [3] * 8 and not any(e.truncated for e in episodes)
    first_slow_step = min(t for prompt, t in Talks.step_ends if prompt == "slow")
    fast_calls = [t for t, contexts, _ in engine.calls[1:] if all(c[: len(ids[0])] != ids[0] for c in contexts)]
    if concurrent > 1:  # the fast episodes' turns 2 and 3, each its own call, all before the slow step ended
        assert len(fast_calls) == 12 and max(fast_calls) < first_slow_step
        assert all(len(contexts) == 1 for _, contexts, _ in engine.calls[1:])
    else:  # one call per turn for every going episode: the second one waits for the slow step
        assert len(engine.calls) == 3 and engine.calls[1][0] > first_slow_step


def test_each_turn_is_the_engines_sample_for_its_context_and_seed_whatever_finishes_first():
    """The episodes do not depend on the order the environments answer in: each turn after the first is the
    engine's sample for that episode's context, seeded by the episode and the turn."""
    engine = ConcurrentHF()
    runs = [play(engine, 8, delays)[0] for delays in ({"slow": 0.3}, {"ab": 0.3, "cd": 0.15})]
    assert [[t.completion for t in e.turns] for e in runs[0]] == [[t.completion for t in e.turns] for e in runs[1]]
    for index, episode in enumerate(runs[0]):
        context = list(episode.prompt_ids)
        for turn_number, turn in enumerate(episode.turns, start=1):
            if turn_number > 1:
                one = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
                (alone,) = HFEngine.generate(engine, [context], one, seed=_episode_seed(0, index, turn_number))
                assert alone == turn.completion
            context += turn.completion.token_ids + turn.observation_ids
        assert context == episode.context_ids
    turn_by_turn, _ = play(engine, 1)
    assert [e.turns[0].completion for e in turn_by_turn] == [e.turns[0].completion for e in runs[0]]  # one first call


class FailsOnce(Talks):
    def step(self, reply: str) -> StepResult:
        if self.prompt == "cd":
            raise ValueError("the sandbox is gone")
        return super().step(reply)


def test_a_failing_episode_is_raised_and_the_others_stop_at_their_next_call():
    engine = ConcurrentHF()
    runner = EpisodeRunner(EpisodeSettings(environment=FailsOnce, max_turns=4), CharTokenizer(), engine.stop_ids)
    ids = runner.prompt_ids(PROMPTS)
    metadata = [{"delays": {"slow": 1.0}}] * len(PROMPTS)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="FailsOnce.step raised ValueError: the sandbox is gone"):
        runner.run(PROMPTS, metadata, ids, SamplingConfig(max_new_tokens=4, samples_per_prompt=2), engine.generate, 0,
                   0, concurrent_episodes=8)  # fmt: skip
    assert time.monotonic() - started < 1.0 * 2  # the slow episodes ended after one step, not after three
    runner.close()


def test_a_stop_starts_no_further_step_or_turn():
    """The first step of the "ab" episodes stops the run while the other episodes' first steps still run: no
    episode starts a second turn."""
    engine, stopped = ConcurrentHF(), threading.Event()

    class StopsTheRun(Talks):
        def step(self, reply: str) -> StepResult:
            if self.prompt == "ab":
                stopped.set()
            return super().step(reply)

    runner = EpisodeRunner(EpisodeSettings(environment=StopsTheRun, max_turns=4), CharTokenizer(), engine.stop_ids)
    ids = runner.prompt_ids(PROMPTS)
    metadata = [{"delays": {"slow": 0.5, "cd": 0.5, "ef": 0.5}}] * len(PROMPTS)
    with pytest.raises(RolloutStopped, match="episodes"):
        runner.run(PROMPTS, metadata, ids, SamplingConfig(max_new_tokens=4, samples_per_prompt=2), engine.generate, 0,
                   0, stop=stopped.is_set, concurrent_episodes=8)  # fmt: skip
    assert len(engine.calls) == 1  # the first turns' call only
    runner.close()


def test_a_push_interrupts_every_turn_in_flight_once_and_waits_for_all_of_them():
    """The producer's turns are held side by side (one per independent episode): a push interrupts them with
    one call, holds the engine only once all have ended, and no turn starts while it does."""
    from lightning_offpolicy.batch import PromptBatch
    from lightning_offpolicy.rollout.producer import RolloutProducer
    from tests.test_async_rollout import fake_rollout, wait_for

    interrupts, release, lock = [], threading.Event(), threading.Lock()
    held = {"now": 0, "most": 0}
    producer: RolloutProducer

    def interrupt():  # an engine honours it: every call in flight returns
        interrupts.append(1)
        release.set()

    def episode() -> None:
        with producer.generation_turn():
            with lock:
                held["now"] += 1
                held["most"] = max(held["most"], held["now"])
            release.wait(10)
            with lock:
                held["now"] -= 1

    def produce(prompts, index):
        episodes = [threading.Thread(target=episode) for _ in range(4)]
        for thread in episodes:
            thread.start()
        for thread in episodes:
            thread.join()
        return fake_rollout([0, 0]), 0.0

    stream = (PromptBatch(prompts=[f"p{i}"]) for i in range(100))
    producer = RolloutProducer(
        produce, stream, max_staleness=1, steps_per_batch=1, first_index=0, trainer_version=0, engine_version=0,
        interrupt=interrupt,
    )  # fmt: skip
    producer.start()
    try:
        wait_for(lambda: held["most"] == 4)  # four turns at once
        with producer.engine_access():
            assert held["now"] == 0 and interrupts == [1]
            release.clear()  # the next batch's turns would wait here, were they let in
            time.sleep(0.1)
            assert held["now"] == 0  # none started during the access
        wait_for(lambda: held["now"] == 4)  # the next batch's four, after the access
    finally:
        release.set()
        producer.close()


def test_shared_lock_holders_side_by_side_and_an_exclusive_one_alone_first():
    from lightning_offpolicy.rollout.shared_lock import SharedLock

    lock, order = SharedLock(), []
    with lock.shared(), lock.shared():  # two shared holders at once (no wait)
        assert not lock.acquire(blocking=False) and not lock.acquire(timeout=0.05)
    in_shared, leave = threading.Event(), threading.Event()

    def reader(name: str, hold: threading.Event | None = None) -> None:
        with lock.shared():
            order.append(name)
            if hold is not None:
                in_shared.set()
                hold.wait(10)

    def writer() -> None:
        with lock:
            order.append("sync")

    first = threading.Thread(target=reader, args=("first", leave))
    first.start()
    in_shared.wait(10)
    sync = threading.Thread(target=writer)
    sync.start()
    time.sleep(0.1)  # the sync waits for the first holder
    late = threading.Thread(target=reader, args=("late",))
    late.start()
    time.sleep(0.1)  # the late holder waits behind the waiting sync
    assert order == ["first"]
    leave.set()
    for thread in (first, sync, late):
        thread.join(10)
    assert order == ["first", "sync", "late"]
    assert lock.acquire(timeout=0.05)
    lock.release()
    with pytest.raises(RuntimeError, match="not held alone"):
        lock.release()
