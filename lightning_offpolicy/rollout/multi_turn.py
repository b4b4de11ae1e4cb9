"""Multi-turn episodes: the model's turns from the engine, the environment's answers appended as ids.

:class:`EpisodeSettings` says what the episodes talk to (tools, or an environment) and their limits;
:class:`EpisodeRunner` plays a batch of episodes turn by turn on any
:class:`~lightning_offpolicy.rollout.engine.RolloutEngine`: every active episode's context goes to one
``generate`` call per turn, token ids in and token ids out, so the batch trains on exactly the ids the
engine sampled; the environment steps of a turn (tool calls) run concurrently
(:mod:`~lightning_offpolicy.rollout.env_steps`). How an episode runs and which tokens train:
docs/multi_turn.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import reprlib
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_offpolicy.argcheck import is_int, is_number
from lightning_offpolicy.data.chat import renderer_for
from lightning_offpolicy.data.environments.base import (
    Environment,
    EnvironmentFactory,
    Message,
    StepResult,
    environment_tools,
)
from lightning_offpolicy.data.tokenizers import encode_prompt
from lightning_offpolicy.rollout.engine import Completion, SamplingConfig
from lightning_offpolicy.rollout.env_steps import ConcurrentSteps, StepOutcome
from lightning_offpolicy.rollout.episode import Episode, Turn, single_turn_episodes
from lightning_offpolicy.rollout.partial import check_not_stopped

__all__ = ["EpisodeRunner", "EpisodeSettings", "Generate", "SingleTurn", "episode_metadata", "episode_stats"]

#: ``(prompt_ids, sampling, seed) -> completions``: one engine call (with partial rollouts continued).
Generate = Callable[[list[list[int]], SamplingConfig, "int | None"], list[Completion]]


@dataclass
class EpisodeSettings:
    """Multi-turn episodes: what the model talks to, and the limits of an episode.

    Give ``tools`` or ``environment`` (not both); with neither, a rollout is single-turn.

    Args:
        tools: Functions the model may call (import paths or callables), shown by the chat template;
            an episode ends at a reply without a tool call (docs/tools.md).
        environment: Makes one environment per episode: a class with ``reset`` / ``step`` (plain
            or ``async def``), e.g. ``lightning_offpolicy.data.environments.GuessNumber``, or any
            callable without arguments (docs/environments.md).
        max_turns: Most model turns per episode; an episode still going after them is truncated.
        max_episode_tokens: Most ids after the prompt (model and environment tokens); an episode
            that would pass it is truncated. Each turn samples at most
            ``min(sampling.max_new_tokens, tokens left)``.
        max_tool_result_tokens: A tool message's content is cut to this many tokens.
        tool_timeout_s: Longest a tool call may run; past it the call's result is an error message.
        max_concurrent_env_steps: Most environment steps (tool calls) and resets running at once; 1:
            one at a time.

    Raises:
        ValueError: A setting is out of range or both ``tools`` and ``environment`` are given.
    """

    tools: list[Any] = field(default_factory=list)
    environment: Callable[[], Environment] | None = None
    max_turns: int = 4
    max_episode_tokens: int = 512
    max_tool_result_tokens: int = 64
    tool_timeout_s: float | None = 10.0
    max_concurrent_env_steps: int = 32

    def __post_init__(self) -> None:
        if self.tools and self.environment is not None:
            raise ValueError(
                "EpisodeSettings: give `tools` (the kit's tool-calling environment) or `environment`, not both; "
                "an environment of your own can expose tools through its `tools` attribute."
            )
        for name in ("max_turns", "max_episode_tokens", "max_tool_result_tokens", "max_concurrent_env_steps"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"EpisodeSettings.{name}={value!r} must be an int >= 1.")
        if self.tool_timeout_s is not None and not (is_number(self.tool_timeout_s) and self.tool_timeout_s > 0):
            raise ValueError(f"EpisodeSettings.tool_timeout_s={self.tool_timeout_s!r} must be > 0 seconds or None.")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are episodes of possibly several turns."""
        return bool(self.tools) or self.environment is not None

    def factory(self) -> EnvironmentFactory:
        """The environment factory: ``environment``, or the kit's tool environment over ``tools``."""
        if self.environment is not None:
            return self.environment
        from lightning_offpolicy.data.environments.tools import Tools

        return Tools(self.tools, timeout_s=self.tool_timeout_s)


class SingleTurn:
    """Single-turn rollouts as episodes of one turn, with :class:`EpisodeRunner`'s interface: the rollouter
    plays, counts and scores both alike.

    Args:
        tokenizer: Encodes each prompt by its own rule (:func:`~lightning_offpolicy.data.tokenizers.encode_prompt`).
        max_new_tokens: The most ids a completion adds after its prompt.
    """

    def __init__(self, tokenizer: Any, max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.budget = (max_new_tokens, "rollout.sampling.max_new_tokens")

    def prompt_ids(self, prompts: Sequence[Any]) -> list[list[int]]:
        """Each prompt's ids by the tokenizer's own rule (bos where it adds one; chat via its template)."""
        return [encode_prompt(self.tokenizer, prompt) for prompt in prompts]

    def run(
        self,
        prompts: Sequence[Any],
        metadata: Sequence[Mapping[str, Any]],
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        generate: Generate,
        seed: int | None,
        group_offset: int,
        stop: Callable[[], bool] | None = None,
        concurrent_episodes: int = 1,
    ) -> list[Episode]:
        """One ``generate`` call: an episode of one turn per completion (:meth:`EpisodeRunner.run`'s arguments)."""
        return single_turn_episodes(prompt_ids, generate(prompt_ids, sampling, seed), group_offset)

    def stats(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """Nothing beyond the rollouter's own counts."""
        return {}

    def reward_metadata(self, episode: Episode, metadata: Mapping[str, Any]) -> Mapping[str, Any]:
        """The row's metadata, as it is."""
        return metadata

    def close(self) -> None:
        """Nothing to stop."""


def _episode_seed(seed: int | None, episode: int, turn: int) -> int | None:
    """The sampler seed of an episode's ``turn``-th call when episodes are played independently."""
    if seed is None:
        return None
    return (seed * 1_000_003 + episode * 104_729 + turn * 15_485_863) % (2**31 - 1)


def _turn_seed(seed: int | None, turn: int, budget: int) -> int | None:
    """The sampler seed of an episode batch's ``turn``-th call for rows with ``budget`` tokens left."""
    if seed is None:
        return None
    return (seed * 1_000_003 + turn * 15_485_863 + budget * 7_919) % (2**31 - 1)


class EpisodeRunner:
    """Play episodes turn by turn.

    Args:
        settings: The environment and the limits.
        tokenizer: Renders the prompts and the environment's messages with its chat template, or as
            plain text without one (:func:`~lightning_offpolicy.data.chat.renderer_for`), and decodes
            the model's replies.
        stop_ids: The ids that end a model turn (the engine's stop ids).
    """

    def __init__(self, settings: EpisodeSettings, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.factory = settings.factory()
        self.renderer = renderer_for(tokenizer, environment_tools(self.factory))
        self.stop_ids = set(int(t) for t in stop_ids)
        self._cut_by: Counter[str] = Counter()  # the limit that ended each truncated episode of a run, by setting
        self._warned: set[str] = set()  # each warning once per runner (it lives as long as the callback)
        self._steps = ConcurrentSteps(settings.max_concurrent_env_steps)
        self._record_lock = threading.Lock()  # episodes played independently record their turns one at a time

    def close(self) -> None:
        """Stop the threads that run the environment steps (the runner starts them again if used after)."""
        self._steps.close()

    @property
    def budget(self) -> tuple[int, str]:
        """The most ids an episode adds after its prompt, and the setting that says so."""
        return self.settings.max_episode_tokens, "rollout.episodes.max_episode_tokens"

    def prompt_ids(self, prompts: Sequence[Any]) -> list[list[int]]:
        """Each prompt's ids, rendered with the template and the tools."""
        return [self.renderer.prompt_ids(p) for p in prompts]

    def stats(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """A batch's per-episode means (:func:`episode_stats`)."""
        return episode_stats(episodes)

    def reward_metadata(self, episode: Episode, metadata: Mapping[str, Any]) -> Mapping[str, Any]:
        """The row's metadata with what the reward function is told about ``episode`` (:func:`episode_metadata`)."""
        return episode_metadata(episode, metadata, transcript=self.tokenizer.decode(episode.response_ids))

    def run(
        self,
        prompts: Sequence[Any],
        metadata: Sequence[Mapping[str, Any]],
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        generate: Generate,
        seed: int | None,
        group_offset: int,
        stop: Callable[[], bool] | None = None,
        concurrent_episodes: int = 1,
    ) -> list[Episode]:
        """``sampling.samples_per_prompt`` episodes per prompt, played to their end.

        The first turns are one ``generate`` call. After it, with ``concurrent_episodes`` 1, the episodes
        go turn by turn: each turn's environment steps, then every going episode's next turn in one
        call. With more, each episode goes on alone as soon as its environment answered (at most
        ``concurrent_episodes`` at once, each turn its own call, seeded by the episode and the turn):
        for engines that batch concurrent calls themselves (``concurrent_calls`` > 1, the vLLM
        engines), so that no episode waits for another's tool or longest reply.

        Args:
            prompts: The prompts (texts or chat messages), given to each environment's ``reset``.
            metadata: Each prompt's dataset row.
            prompt_ids: Each prompt's ids (:meth:`prompt_ids`).
            sampling: How turns are sampled; ``max_new_tokens`` caps each turn.
            generate: One engine call (partial rollouts continued by the caller).
            seed: The first turn's seed; later turns derive theirs from it.
            group_offset: The group of the first prompt.
            stop: Returns ``True`` once the rollout must stop (a preemption): checked before each
                environment step.
            concurrent_episodes: Most episodes played independently at once; 1: turn by turn.

        Returns:
            The episodes, grouped by prompt in order (rewards not yet set).

        Raises:
            RuntimeError: An environment's ``reset`` or ``step`` raised (its error is the cause; the
                first such episode in order when several did).
            RolloutStopped: ``stop`` returned ``True`` (the environment steps left were not run).
            TypeError: An environment's ``step`` returned something else than a ``StepResult`` (a
                gym-style tuple, ``None``); the message names the class and what it returned.
        """
        self._cut_by.clear()
        first = generate(prompt_ids, dataclasses.replace(sampling, max_new_tokens=self._first_budget(sampling)), seed)
        episodes = [Episode(group=group_offset + c.prompt_index, prompt_ids=prompt_ids[c.prompt_index]) for c in first]
        environments = [self.factory() for _ in first]
        starts = [(prompts[c.prompt_index], metadata[c.prompt_index]) for c in first]
        resets = [functools.partial(env.reset, *start) for env, start in zip(environments, starts, strict=True)]
        outcomes = self._steps.run(resets, stop, "episodes' resets")
        for environment, outcome in zip(environments, outcomes, strict=True):
            _value(environment, "reset", outcome)
        if concurrent_episodes > 1:
            self._play_independently(episodes, environments, first, sampling, generate, seed, stop, concurrent_episodes)
            self._warn_if_nothing_can_train(episodes)
            return episodes
        pending = dict(enumerate(first))
        turn = 1
        while pending:
            replies = {i: self._record_turn(episodes[i], c) for i, c in pending.items()}
            replies = {i: reply for i, reply in replies.items() if reply is not None}
            # A preemption abandons the environment steps (tool calls) not yet started: the batch is
            # dropped anyway, and each step may take up to its tool's timeout.
            calls = [functools.partial(environments[i].step, reply) for i, reply in replies.items()]
            outcomes = self._steps.run(calls, stop, "episodes' environment steps")
            going = []
            for i, outcome in zip(replies, outcomes, strict=True):
                result = _value(environments[i], "step", outcome)
                if not isinstance(result, StepResult):
                    raise TypeError(_not_a_step_result(environments[i], result))
                if self._answer(episodes[i], result, pending[i], turn):
                    going.append(i)
            turn += 1
            pending = {}
            for budget, rows in self._by_budget(episodes, going, sampling.max_new_tokens):
                contexts = [episodes[i].context_ids for i in rows]
                one_each = dataclasses.replace(sampling, samples_per_prompt=1, max_new_tokens=budget)
                completions = generate(contexts, one_each, _turn_seed(seed, turn, budget))
                if len(completions) != len(rows):
                    raise RuntimeError(
                        f"generate returned {len(completions)} completions for {len(rows)} episode contexts (one each)."
                    )
                pending.update(zip(rows, completions, strict=True))
        self._warn_if_nothing_can_train(episodes)
        return episodes

    def _play_independently(
        self,
        episodes: list[Episode],
        environments: list[Environment],
        first: list[Completion],
        sampling: SamplingConfig,
        generate: Generate,
        seed: int | None,
        stop: Callable[[], bool] | None,
        concurrent_episodes: int,
    ) -> None:
        """Each episode from its first turn to its end in a thread of its own (see :meth:`run`)."""
        failed = threading.Event()  # an episode raised: the others end before their next step or turn

        def play(i: int) -> None:
            completion, turn = first[i], 1
            while True:
                with self._record_lock:
                    reply = self._record_turn(episodes[i], completion)
                if reply is None or failed.is_set():
                    return
                step = functools.partial(environments[i].step, reply)
                result = _value(environments[i], "step", self._steps.one(step, stop, "episodes' environment steps"))
                if not isinstance(result, StepResult):
                    raise TypeError(_not_a_step_result(environments[i], result))
                with self._record_lock:
                    going = self._answer(episodes[i], result, completion, turn)
                if not going or failed.is_set():
                    return
                check_not_stopped(stop, "episodes")  # a preemption starts no new turn
                turn += 1
                left = min(sampling.max_new_tokens, self.settings.max_episode_tokens - len(episodes[i].response_ids))
                one = dataclasses.replace(sampling, samples_per_prompt=1, max_new_tokens=left)
                completions = generate([episodes[i].context_ids], one, _episode_seed(seed, i, turn))
                if len(completions) != 1:
                    raise RuntimeError(f"generate returned {len(completions)} completions for one episode context.")
                completion = completions[0]

        errors: dict[int, BaseException] = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, min(concurrent_episodes, len(episodes))), "episode") as pool:
            futures = {pool.submit(play, i): i for i in range(len(episodes))}
            for future in concurrent.futures.as_completed(futures):
                if (error := future.exception()) is not None:
                    errors[futures[future]] = error
                    failed.set()
        check_not_stopped(stop, "episodes")
        if errors:  # the first failing episode in order, as turn by turn
            raise errors[min(errors)]

    def _warn_if_nothing_can_train(self, episodes: list[Episode]) -> None:
        """Warn once when a batch's episodes all hit a limit, or its tool calls all failed: a configuration
        under which the model cannot learn to finish, or learns only from error messages."""
        if episodes and all(e.truncated for e in episodes) and "truncated" not in self._warned:
            self._warned.add("truncated")
            limits = ", ".join(f"{setting}: {count}" for setting, count in self._cut_by.most_common())
            warnings.warn(
                f"Every one of the {len(episodes)} episodes of a batch was truncated by a limit before the model or "
                f"the environment ended it ({limits}): with all episodes cut the same way the model has nothing to "
                "learn the end from. Raise the setting named most (each turn and each environment message must fit "
                "in rollout.episodes.max_episode_tokens).",
                stacklevel=3,
            )
        calls = sum(e.tool_calls for e in episodes)
        if calls and sum(e.tool_errors for e in episodes) == calls and "tool_errors" not in self._warned:
            self._warned.add("tool_errors")
            warnings.warn(
                f"Every one of the {calls} tool calls of a batch failed: the model sees only error messages "
                "(rollout/tool_errors_per_episode). Check rollout.episodes.tools (a tool that raises on every call, "
                "tool_timeout_s too short) against a transcript (docs/tools.md).",
                stacklevel=3,
            )

    def _first_budget(self, sampling: SamplingConfig) -> int:
        return min(sampling.max_new_tokens, self.settings.max_episode_tokens)

    def _record_turn(self, episode: Episode, completion: Completion) -> str | None:
        """Record ``completion`` as the episode's next turn; the reply the environment answers (``None``: the
        turn was cut at its token budget, which ends the episode)."""
        episode.turns.append(Turn(completion))
        stopped = completion.finish_reason == "stop" and bool(completion.token_ids)
        if not stopped:  # cut at its token budget: the reply is unfinished
            episode.truncated = True
            whole = len(episode.response_ids) >= self.settings.max_episode_tokens
            self._cut_by["rollout.episodes.max_episode_tokens" if whole else "rollout.sampling.max_new_tokens"] += 1
            return None
        reply_ids = completion.token_ids[:-1] if completion.token_ids[-1] in self.stop_ids else completion.token_ids
        return self.renderer.decode(reply_ids)

    def _answer(self, episode: Episode, result: StepResult, completion: Completion, turn: int) -> bool:
        """Record the environment's ``result`` for the episode's last turn; whether the episode goes on."""
        episode.environment_reward += float(result.reward)
        episode.tool_calls += int(result.tool_calls)
        episode.tool_errors += int(result.tool_errors)
        episode.tool_seconds += float(result.tool_seconds)
        if result.done:
            return False
        if turn >= self.settings.max_turns:
            episode.truncated = True
            self._cut_by["rollout.episodes.max_turns"] += 1
            return False
        stop_text = self.renderer.decode(completion.token_ids[-1:])
        observation = self.renderer.observation_ids(self._capped(result.messages), stop_text)
        # One more model token must fit after what the environment appends.
        if len(episode.response_ids) + len(observation) + 1 > self.settings.max_episode_tokens:
            episode.truncated = True
            self._cut_by["rollout.episodes.max_episode_tokens (an environment message did not fit)"] += 1
            return False
        episode.turns[-1].observation_ids = observation
        return True

    def _capped(self, messages: list[Message]) -> list[Message]:
        """The messages, each tool result cut to ``max_tool_result_tokens`` tokens."""
        cap = self.settings.max_tool_result_tokens
        capped = []
        for message in messages:
            content = message.get("content")
            if message.get("role") == "tool" and isinstance(content, str):
                ids = self.renderer.encode(content)
                if len(ids) > cap:
                    kept = self.renderer.decode(ids[:cap])
                    message = {**message, "content": f"{kept} ... (cut to {cap} tokens)"}
            capped.append(message)
        return capped

    def _by_budget(self, episodes: list[Episode], rows: list[int], max_new_tokens: int) -> list[tuple[int, list[int]]]:
        """The going episodes grouped by the tokens their next turn may sample, largest first."""
        groups: dict[int, list[int]] = {}
        for i in rows:
            left = self.settings.max_episode_tokens - len(episodes[i].response_ids)
            groups.setdefault(min(max_new_tokens, left), []).append(i)
        return sorted(groups.items(), reverse=True)


def _value(environment: Environment, method: str, outcome: StepOutcome) -> Any:
    """What ``environment.<method>`` returned; its error, naming the environment, if it raised."""
    if outcome.error is not None:
        error = outcome.error
        raise RuntimeError(f"{type(environment).__name__}.{method} raised {type(error).__name__}: {error}") from error
    return outcome.value


def _not_a_step_result(environment: Environment, result: Any) -> str:
    """What to say when ``environment.step`` returned ``result``, which is not a :class:`StepResult`."""
    # reprlib bounds the text: a returned observation may be a whole transcript.
    what = "None" if result is None else f"a {type(result).__name__} ({reprlib.repr(result)})"
    gym = " A gym-style (observation, reward, done, ...) tuple is not read." if isinstance(result, tuple) else ""
    return (
        f"{type(environment).__name__}.step returned {what}, not a StepResult.{gym} Return "
        "lightning_offpolicy.data.environments.StepResult(messages=[{'role': 'user', 'content': ...}], reward=..., "
        "done=...) from step (docs/environments.md, 'The contract')."
    )


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-episode means of a batch: turns, tool calls and errors, seconds in tools, model and
    environment tokens, and the truncated fraction (``rollout/*`` in docs/metrics.md)."""
    count = max(len(episodes), 1)

    def mean(values: Sequence[float]) -> float:
        return float(sum(values)) / count

    return {
        "turns_per_episode": mean([len(e.turns) for e in episodes]),
        "tool_calls_per_episode": mean([e.tool_calls for e in episodes]),
        "tool_errors_per_episode": mean([e.tool_errors for e in episodes]),
        "tool_s_per_episode": mean([e.tool_seconds for e in episodes]),
        "model_tokens_per_episode": mean([e.model_tokens for e in episodes]),
        "environment_tokens_per_episode": mean([e.environment_tokens for e in episodes]),
        "truncated_frac": mean([float(e.truncated) for e in episodes]),
    }


def episode_metadata(episode: Episode, metadata: Mapping[str, Any], transcript: str) -> dict[str, Any]:
    """A dataset row's metadata with what the reward function is told about the episode."""
    return {
        **metadata,
        "turns": len(episode.turns),
        "truncated": episode.truncated,
        "environment_reward": episode.environment_reward,
        "transcript": transcript,
    }
