"""The environment steps of a turn run concurrently (rollout/env_steps.py), on a real engine and runner.

Sleeping steps need no CPU, so their wall time is a bound that holds on a loaded machine: N steps of
``s`` seconds side by side take about ``s``, one after another at least ``N * s``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from lightning_offpolicy.data.environments import StepResult, Tools
from lightning_offpolicy.rollout import SamplingConfig
from lightning_offpolicy.rollout.env_steps import ConcurrentSteps
from lightning_offpolicy.rollout.multi_turn import EpisodeSettings
from lightning_offpolicy.rollout.partial import RolloutStopped
from tests.test_multi_turn import _one_token_turns, _play
from tests.test_tools import call, sleep_forever

PROMPTS = ["abc", "de", "fgh", "ij"]  # x 2 samples: 8 episodes
STEP_S = 0.25


class Sleepy:
    """Each step sleeps STEP_S seconds (a tool's latency), then ends the episode with a reward of 1."""

    def reset(self, prompt, metadata) -> None:
        self.started = time.perf_counter()

    def step(self, reply: str) -> StepResult:
        time.sleep(STEP_S)
        return StepResult(messages=[], reward=1.0, done=True, tool_calls=1, tool_seconds=STEP_S)


class AsyncSleepy:
    """Sleepy with ``async def reset`` / ``step``, episodes of 1-3 steps; counts the steps in flight at once."""

    made = running = most = 0

    def __init__(self) -> None:
        AsyncSleepy.made += 1
        self.steps_left = 1 + AsyncSleepy.made % 3

    async def reset(self, prompt, metadata) -> None:
        await asyncio.sleep(0)

    async def step(self, reply: str) -> StepResult:
        AsyncSleepy.running += 1  # one event loop: no lock needed
        AsyncSleepy.most = max(AsyncSleepy.most, AsyncSleepy.running)
        await asyncio.sleep(STEP_S)
        AsyncSleepy.running -= 1
        self.steps_left -= 1
        return StepResult(messages=[{"role": "user", "content": "more"}], reward=0.5, done=self.steps_left == 0)


class HangingTool:
    """The kit's tool environment calling a tool that never returns: each step ends at the tool's timeout."""

    def reset(self, prompt, metadata) -> None:
        self.tools = Tools([sleep_forever], timeout_s=STEP_S)()

    def step(self, reply: str) -> StepResult:
        result = self.tools.step(call("sleep_forever", {"x": 1}))
        return StepResult(messages=result.messages, done=True, tool_calls=result.tool_calls, tool_errors=1)


def _timed(settings: EpisodeSettings) -> tuple[float, list]:
    runner, engine = _one_token_turns(settings)
    _play(runner, engine, ["warm"])  # the first forward passes out of the timing
    started = time.perf_counter()
    episodes = _play(runner, engine, PROMPTS)
    elapsed = time.perf_counter() - started
    runner.close()
    return elapsed, episodes


def test_the_steps_of_a_turn_run_side_by_side_and_one_at_a_time_when_asked():
    concurrent, episodes = _timed(EpisodeSettings(environment=Sleepy))
    serial, same = _timed(EpisodeSettings(environment=Sleepy, max_concurrent_env_steps=1))
    assert len(episodes) == 8 and all(e.environment_reward == 1.0 for e in episodes)
    assert serial >= 8 * STEP_S
    assert concurrent < 4 * STEP_S, (concurrent, serial)
    assert [e.turns[0].completion.token_ids for e in episodes] == [e.turns[0].completion.token_ids for e in same]


@pytest.mark.filterwarnings("ignore:Every one of the .* tool calls of a batch failed")
def test_tools_that_hang_cost_one_timeout_not_one_each():
    elapsed, episodes = _timed(EpisodeSettings(environment=HangingTool, tool_timeout_s=STEP_S))
    assert [e.tool_errors for e in episodes] == [1] * 8
    assert elapsed < 4 * STEP_S, elapsed  # 8 timeouts one after another: 2 s


def test_async_environments_are_awaited_side_by_side_within_the_bound():
    AsyncSleepy.made = AsyncSleepy.running = AsyncSleepy.most = 0
    elapsed, episodes = _timed(EpisodeSettings(environment=AsyncSleepy, max_turns=3, max_concurrent_env_steps=4))
    assert AsyncSleepy.most == 4 and AsyncSleepy.running == 0  # 8 steps in the first turn, 4 at a time
    steps = sum(len(e.turns) for e in episodes)  # every turn was answered (one-token replies end by a stop id)
    assert sorted(len(e.turns) for e in episodes) == [1, 1, 2, 2, 2, 3, 3, 3]
    assert all(e.environment_reward == 0.5 * len(e.turns) for e in episodes)
    assert elapsed < 0.6 * steps * STEP_S, (elapsed, steps)  # one after another: 4 s; 4 at a time: ~1.25 s


class Scrambled:
    """Steps that finish in reverse order of their episode (the later the episode, the shorter the sleep); each
    answers with a message of its own and ends after 1-3 steps."""

    made = 0

    def __init__(self) -> None:
        Scrambled.made += 1
        self.index = Scrambled.made
        self.steps = 0

    def reset(self, prompt, metadata) -> None:
        self.delay = 0.02 * (9 - self.index)

    def step(self, reply: str) -> StepResult:
        time.sleep(self.delay)
        self.steps += 1
        message = {"role": "user", "content": "xyz"[: self.index % 3 + 1] * self.steps}
        return StepResult(messages=[message], reward=self.index * self.steps, done=self.steps > self.index % 3)


def test_episodes_do_not_depend_on_the_order_the_steps_finish_in():
    def play(limit: int) -> list:
        Scrambled.made = 0
        runner, engine = _one_token_turns(EpisodeSettings(environment=Scrambled, max_turns=3,
                                                          max_concurrent_env_steps=limit))  # fmt: skip
        episodes = _play(runner, engine, PROMPTS)
        runner.close()
        return [(e.response_ids, e.environment_reward, e.truncated, e.tool_calls, len(e.turns)) for e in episodes]

    assert play(16) == play(1)


class Raising:
    def reset(self, prompt, metadata) -> None:
        self.prompt = prompt

    def step(self, reply: str) -> StepResult:
        if self.prompt == "de":
            raise ValueError("broken tool")
        time.sleep(0.05)
        return StepResult(messages=[], done=True)


def test_a_step_that_raises_is_named_and_leaves_no_step_running():
    runner, engine = _one_token_turns(EpisodeSettings(environment=Raising))
    with pytest.raises(RuntimeError, match=r"Raising\.step raised ValueError: broken tool"):
        _play(runner, engine, PROMPTS)
    runner.close()
    deadline = time.perf_counter() + 5
    while any(t.name.startswith("env-step") for t in threading.enumerate()) and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("env-step_")]


def test_a_preemption_during_concurrent_steps_starts_no_step_after_it():
    """Stopped while the first steps run: the runner raises RolloutStopped, and no step starts once the stop was
    seen: only the ones already running (at most max_concurrent_env_steps) ran."""
    started: list[str] = []

    class Slow:
        def reset(self, prompt, metadata) -> None:
            pass

        def step(self, reply: str) -> StepResult:
            started.append(reply)
            time.sleep(STEP_S)
            return StepResult(messages=[{"role": "tool", "name": "slow", "content": "1"}], tool_calls=1)

    runner, engine = _one_token_turns(EpisodeSettings(environment=Slow, max_concurrent_env_steps=2))
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2)
    ids = runner.prompt_ids(PROMPTS)
    with pytest.raises(RolloutStopped, match="environment steps"):
        runner.run(PROMPTS, [{}] * 4, ids, sampling, engine.generate, 0, 0, stop=lambda: bool(started))
    assert 1 <= len(started) <= 2  # of 8 episodes
    runner.close()


def test_the_setting_is_checked_and_one_runs_in_the_calling_thread():
    with pytest.raises(ValueError, match="max_concurrent_env_steps=0 must be an int >= 1"):
        EpisodeSettings(max_concurrent_env_steps=0)
    threads = ConcurrentSteps(1).run([threading.current_thread, threading.current_thread])
    assert [o.value for o in threads] == [threading.current_thread()] * 2


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "env-step-loop"]


def test_close_stops_and_closes_the_event_loop_after_the_async_steps_running():
    """close() while an async step runs: the step still ends (its worker is not left waiting on a stopped
    loop), then the loop's thread closes the loop (an open one holds file descriptors) and ends."""
    steps = ConcurrentSteps(2)
    before = set(_loop_threads())
    results: list = []
    started: list[int] = []

    async def slow() -> str:
        started.append(1)
        await asyncio.sleep(STEP_S)
        return "done"

    running = threading.Thread(target=lambda: results.extend(steps.run([slow, slow])))
    running.start()
    deadline = time.perf_counter() + 10
    while len(started) < 2 and time.perf_counter() < deadline:  # both steps are on the loop
        time.sleep(0.005)
    assert len(started) == 2
    (loop,) = set(_loop_threads()) - before
    steps.close()
    running.join(timeout=5)
    loop.join(timeout=5)
    assert [o.value for o in results] == ["done", "done"]
    assert not running.is_alive() and not loop.is_alive()
    assert steps._loop is None
    steps.close()  # a second close is a no-op
