"""TextArena's single-player games as multi-turn environments (``pip install 'lightning-offpolicy[games]'``).

`TextArena <https://github.com/LeonGuertler/TextArena>`_ games run in-process, offline, behind a
reset / step interface: ``env.reset(num_players, seed)``, ``env.step(action) -> (done, info)``,
``env.get_observation()`` for what the game said since the player's last turn, ``env.close()`` for
the rewards when the game is over. This adapter maps that onto the kit's contract: the model's reply
is the action, the game's new observation text is one ``"user"`` message, and the game's final
reward is the step's reward. Why TextArena and not another library: docs/environments.md.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_offpolicy.data.environments.base import StepResult

__all__ = ["TextArenaGame"]

# TextArena draws from Python's global ``random`` (on import, and ``random.seed(seed)`` at every
# reset): each environment keeps a generator state of its own and swaps it in around each call into
# the library, under this lock, so a game depends only on its seed and the rest of the process sees
# the global state unmoved (a thread drawing from ``random`` during such a call is not shielded).
_GLOBAL_RANDOM = threading.RLock()


def _textarena() -> Any:
    """The ``textarena`` module; importing it draws from the global ``random`` too, so that is undone."""
    try:
        with _GLOBAL_RANDOM:
            outside = random.getstate()
            try:
                import textarena
            finally:
                random.setstate(outside)
    except ImportError as error:
        raise ImportError(
            "TextArenaGame needs the `textarena` package: pip install 'lightning-offpolicy[games]' "
            "(or pip install textarena)."
        ) from error
    return textarena


def _observation_text(observation: Iterable[tuple[int, str, Any]]) -> str:
    """The text of what the game said, the echo of the player's own action left out."""
    textarena = _textarena()
    return "\n".join(
        message.strip()
        for _, message, kind in observation
        if kind != textarena.ObservationType.PLAYER_ACTION and message.strip()
    )


def _core(env: Any) -> Any:
    """The game under TextArena's wrappers (their observation wrappers repeat the whole history each turn)."""
    textarena = _textarena()
    while isinstance(env, textarena.Wrapper):
        env = env.env
    return env


class TextArenaGame:
    """One TextArena game; ``reset`` starts it from ``metadata["seed"]``, ``step`` plays one move.

    Pair it with prompts from :meth:`rows` (the game's first observation and its ``seed``) and the
    environment reward. In YAML::

        rollout:
          episodes:
            environment:
              class_path: lightning_offpolicy.data.environments.TextArenaGame
              init_args: {env_id: GuessTheNumber-v0}

    Games that run offline include ``GuessTheNumber-v0``, ``Mastermind-v0``, ``TowerOfHanoi-v0``,
    ``Minesweeper-v0``, ``Sudoku-v0``, ``FrozenLake-v0``, ``Countdown-v0``; ``Wordle`` and
    ``Hangman`` download an NLTK word list on first use, ``TwentyQuestions`` calls a hosted model.

    Moves go through the game's default action wrappers (the game id's wrappers, e.g. brackets added
    around a bare guess); observations are read from the game itself, only the new messages of each
    turn, because the chat context already holds the earlier ones.

    Args:
        env_id: A TextArena game id (``textarena.envs.registration.ENV_REGISTRY``), single-player.
        env_kwargs: Arguments of the game overriding its registered ones (e.g. ``{"max_turns": 6}``).

    Raises:
        ImportError: ``textarena`` is not installed.
        ValueError: ``env_id`` is not a registered TextArena game.
    """

    def __init__(self, env_id: str = "GuessTheNumber-v0", env_kwargs: Mapping[str, Any] | None = None) -> None:
        registry = _textarena().envs.registration.ENV_REGISTRY
        if env_id not in registry:
            close = sorted(name for name in registry if name.split("-")[0].lower() in env_id.lower())
            raise ValueError(
                f"TextArenaGame: unknown `env_id` {env_id!r}"
                + (f"; close: {', '.join(close[:8])}" if close else "")
                + ". The game ids are the keys of textarena.envs.registration.ENV_REGISTRY."
            )
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.game: Any = None
        self.done = False
        self._random_state: Any = None

    def _call(self, target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """``target.<method>(...)`` with this game's own global-``random`` state swapped in."""
        with _GLOBAL_RANDOM:
            outside = random.getstate()
            if self._random_state is not None:
                random.setstate(self._random_state)
            try:
                return getattr(target, method)(*args, **kwargs)
            finally:
                self._random_state = random.getstate()
                random.setstate(outside)

    def _new_observation(self) -> str:
        """What the game said since the player's last move (read from the game under the wrappers)."""
        _, observation = self._call(_core(self.game), "get_observation")
        return _observation_text(observation)

    def start(self, seed: int) -> str:
        """Make and reset the game for ``seed``; returns its first observation (the episode's prompt).

        Raises:
            ValueError: The game is not a single-player game.
        """
        self.game = _textarena().make(self.env_id, **self.env_kwargs)
        self._random_state = None
        self.done = False
        try:
            self._call(self.game, "reset", num_players=1, seed=seed)
        except AssertionError as error:  # TextArena asserts the number of players
            raise ValueError(
                f"TextArenaGame: {self.env_id!r} is not a single-player game ({error}); the adapter plays one "
                "player against the game."
            ) from error
        return self._new_observation()

    def reset(self, prompt: Any, metadata: Mapping[str, Any]) -> None:
        """Start the game seeded by ``metadata["seed"]``; the prompt should be its first observation.

        The prompt itself is not read: the rows of :meth:`rows` pair each seed with the
        game's first observation for it.

        Raises:
            ValueError: ``metadata`` has no int ``"seed"``, or the game is not a single-player game.
        """
        seed = metadata.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(
                f"TextArenaGame: the row's metadata needs an int 'seed' (the game's seed; got {seed!r}, keys: "
                f"{sorted(metadata)}). Build the prompts with TextArenaGame.rows(seeds)."
            )
        self.start(seed)  # its first observation is the prompt the model already has

    def step(self, reply: str) -> StepResult:
        """Play ``reply`` as the move.

        Returns:
            When the game is over, ``done`` with the game's reward for the player; otherwise a
            ``"user"`` message with what the game answered (a hint, the board, an invalid-move
            notice) and reward 0.

        Raises:
            RuntimeError: Called before :meth:`reset` or after the game ended.
        """
        if self.game is None or self.done:
            state = "before reset()" if self.game is None else "after the game ended"
            raise RuntimeError(f"TextArenaGame: step() called {state}; call reset(prompt, metadata) to start a game.")
        done, _ = self._call(self.game, "step", reply)
        if done:
            self.done = True
            rewards, _ = self._call(self.game, "close")
            return StepResult(reward=float((rewards or {}).get(0, 0.0)), done=True)
        return StepResult(messages=[{"role": "user", "content": self._new_observation()}])

    def rows(self, seeds: Iterable[int]) -> list[dict[str, Any]]:
        """Prompt rows, one per seed: ``{"prompt": the game's first observation, "seed": seed}``.

        A ``datasets.Dataset.from_list(rows)`` is a ``DatasetDataModule`` source whose ``seed``
        column reaches :meth:`reset` as ``metadata["seed"]``.

        Raises:
            ValueError: The game is not a single-player game.
        """
        return [{"prompt": TextArenaGame(self.env_id, self.env_kwargs).start(seed), "seed": seed} for seed in seeds]

    def __repr__(self) -> str:
        return f"TextArenaGame(env_id={self.env_id!r}, env_kwargs={self.env_kwargs!r})"
