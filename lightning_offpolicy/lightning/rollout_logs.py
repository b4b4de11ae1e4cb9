"""What :class:`~lightning_offpolicy.lightning.callback.RolloutCallback` logs of a rollout step: its timings,
each reward component's mean over every rank, the staleness histogram (docs/metrics.md lists the keys)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.lightning.log_steps import is_logging_step

__all__ = ["log_reward_components", "log_staleness_histogram", "log_timing", "steps_per_batch"]


def steps_per_batch(pl_module: LightningModule) -> int:
    """Policy versions one training batch advances (the module's ``optimizer_steps_per_batch``, default 1)."""
    return int(getattr(pl_module, "optimizer_steps_per_batch", 1))


def log_timing(trainer: Trainer, pl_module: LightningModule, batch_idx: int, timing: dict[str, Any]) -> None:
    """``rollout/*`` timings (``timing``: ``generate_s``, ``tokens`` and any other seconds) on the batches whose
    values reach the logger; the progress bar's ``gen_tok/s`` on every batch."""
    timing = dict(timing)
    generate_s = max(timing.pop("generate_s"), 1e-9)
    tokens_per_s = timing.pop("tokens") / generate_s
    # The step already ran: global_step counts its optimizer steps.
    logging = is_logging_step(trainer, batch_idx, steps_per_batch(pl_module), steps_done=True)
    if logging or trainer.progress_bar_callback is not None:
        pl_module.log("gen_tok/s", tokens_per_s, prog_bar=True, batch_size=1, logger=False)
    if not logging:
        return
    values = {"rollout/generate_s": generate_s, "rollout/tokens_per_s": tokens_per_s}
    values.update({f"rollout/{name}": value for name, value in timing.items()})
    pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)


def log_reward_components(trainer: Trainer, pl_module: LightningModule, components: dict[str, torch.Tensor]) -> None:
    """``reward/<name>``: each weighted part's mean over the step's completions of every rank (exact)."""
    sums = torch.stack([v.double().sum() for v in components.values()])
    counts = torch.tensor([float(v.numel()) for v in components.values()], dtype=torch.float64)
    totals = torch.cat([sums, counts]).to(pl_module.device)
    if trainer.world_size > 1:  # every rank has the same parts, in the same order
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
    means = totals[: len(components)] / totals[len(components) :].clamp(min=1)
    for name, mean in zip(components, means, strict=True):
        pl_module.log(f"reward/{name}", mean.float(), on_step=True, on_epoch=False, batch_size=1, sync_dist=False)


def log_staleness_histogram(trainer: Trainer, version: int, rollout: RolloutBatch) -> None:
    """``staleness/hist``: the staleness of every trained token, to each TensorBoard logger."""
    tokens = rollout.response_mask.bool()
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger) and tokens.any():
            staleness = (version - rollout.policy_version[tokens]).float()
            logger.experiment.add_histogram("staleness/hist", staleness, global_step=trainer.global_step)
