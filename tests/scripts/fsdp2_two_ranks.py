"""Two CPU processes, ModelParallelStrategy (FSDP2 ``fully_shard`` per decoder layer, gloo), started once
for every two-rank check of tests/test_module_fsdp.py (each start re-imports torch, Lightning and
transformers on both ranks):

1. two decoupled PPO steps: rank 0 saves the gathered full weights, the exported state dict and the
   logged metrics to ``<out>/step.pt``;
2. three distributed checkpoints of that run to one path, the second failing on rank 1 (a full disk
   while it writes its shard), first with Lightning alone, then with ``make_sharded_saves_atomic``:
   rank 0 writes, for each, the checkpoint directory's files and bytes after each save, whether the
   save raised and the names left beside it to ``<out>/saves.json``.

Lightning's ModelParallelStrategy starts its other ranks by re-running the command (no spawn
launcher), which must not be pytest itself: hence a script.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_offpolicy.lightning.checkpointing import make_sharded_saves_atomic  # noqa: E402
from lightning_offpolicy.rollout.hf.engine import HFEngine  # noqa: E402
from lightning_offpolicy.rollout.vllm.sync.export import export_state_dict  # noqa: E402
from tests.module_helpers import fit_on, make_rollout, tiny_model  # noqa: E402
from tests.test_module_ddp import make_module  # noqa: E402


def listing(directory: Path) -> dict[str, str]:
    """Each file of the checkpoint directory and a hash of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def step_report(trainer, module) -> dict:
    """The trained weights, what a rollout engine would receive, and the refusal to sample sharded."""
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.policy.named_parameters()
    }
    # What a rollout engine receives from the sharded trainer (a collective: every rank calls it).
    exported = export_state_dict(module.policy, "fsdp2 test")
    sharded = sum(hasattr(p, "full_tensor") for p in module.policy.parameters())
    try:  # an engine sampling from the policy sharded over both ranks would hang: refused
        HFEngine().update_weights(module.policy, 2)
        refused = ""
    except ValueError as err:
        refused = str(err)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"weights": weights, "exported": exported, "metrics": metrics, "sharded": sharded, "refused": refused}


def three_saves(trainer, module, directory: Path) -> list[dict]:
    """Three saves to ``directory/last.ckpt``, the second failing on rank 1; what rank 0 found after each."""
    path = directory / "last.ckpt"
    saves = []
    write_data = FileSystemWriter.write_data

    def full_disk_on_rank_1(self, *args, **kwargs):
        if trainer.global_rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, *args, **kwargs)

    for attempt in range(3):
        with torch.no_grad():  # each save holds other weights
            for p in module.policy.parameters():
                p.add_(0.01)
        if attempt == 1:
            FileSystemWriter.write_data = full_disk_on_rank_1
        try:
            trainer.save_checkpoint(path)
            raised = ""
        except BaseException as err:  # noqa: BLE001 - reported to the test (CheckpointException is a BaseException)
            raised = f"{type(err).__name__}: {err}"[:300]
        finally:
            FileSystemWriter.write_data = write_data
        if trainer.global_rank == 0:
            saves.append({"raised": raised, "files": listing(path), "hidden": sorted(os.listdir(directory))})
        trainer.strategy.barrier("report")
    return saves


if __name__ == "__main__":
    out = Path(sys.argv[1])
    model = tiny_model()
    full = make_rollout(model, seed=3, rows=8)
    module = make_module(model)
    trainer = fit_on(
        module,
        [full.select([0, 1, 2, 3]), full.select([4, 5, 6, 7])],
        max_steps=2,
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    )
    step = step_report(trainer, module)
    if trainer.global_rank == 0:
        torch.save(step, out / "step.pt")
    saves = {"lightning-alone": three_saves(trainer, module, out / "lightning-alone" / "checkpoints")}
    assert make_sharded_saves_atomic(trainer.strategy)
    saves["atomic"] = three_saves(trainer, module, out / "atomic" / "checkpoints")
    if trainer.global_rank == 0:
        (out / "saves.json").write_text(json.dumps(saves, indent=1))
