"""The run's seed: a component given ``seed=None`` takes ``seed_everything``'s (Lightning's ``PL_GLOBAL_SEED``).

``lightning-offpolicy fit --seed_everything=N`` (or ``lightning.seed_everything(N)`` before the
components are built) then seeds the whole run: the prompt set and its order, the rollout sampler,
the mini-batch shuffles. A component's own ``seed`` still wins, and says so once.
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities import rank_zero_info

from lightning_offpolicy.argcheck import is_int

__all__ = ["RUN_SEED_ENV", "run_seed"]

#: Where ``lightning.seed_everything`` (and LightningCLI's ``seed_everything``) leaves the run's seed.
RUN_SEED_ENV = "PL_GLOBAL_SEED"


def run_seed(seed: int | None, setting: str) -> int:
    """The seed a component uses: ``seed`` when given, else the run's (0 when nothing seeded the run).

    Args:
        seed: The component's own setting (``None``: the run's).
        setting: Its name, for the messages (e.g. ``"RolloutCallback.seed"``).

    Raises:
        ValueError: ``seed`` is neither an int nor ``None``.
    """
    found = os.environ.get(RUN_SEED_ENV)
    run = int(found) if found is not None and found.lstrip("-").isdigit() else None
    if seed is None:
        return 0 if run is None else run
    if not is_int(seed):
        raise ValueError(f"{setting}={seed!r} must be an int, or None to take the run's seed (seed_everything).")
    if run is not None and seed != run:
        rank_zero_info(f"{setting}={seed} is set explicitly: it wins over the run's seed_everything={run}.")
    return int(seed)
