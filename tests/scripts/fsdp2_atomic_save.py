"""Two CPU processes, ModelParallelStrategy (FSDP2, gloo): three distributed checkpoints of the same run to
one path, the second failing on rank 1 (a full disk), with ``make_sharded_saves_atomic`` unless ``plain``
is given. Rank 0 writes what it found to ``sys.argv[1]``: the checkpoint directory's files and bytes
after each save, whether each save raised, and the hidden names left beside it.

Run by tests/test_checkpointing.py as a script: Lightning's ModelParallelStrategy starts its other
ranks by re-running the command (no spawn launcher), which must not be pytest itself.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_offpolicy.lightning.checkpointing import make_sharded_saves_atomic  # noqa: E402
from tests.module_helpers import fit_on, make_rollout, tiny_model  # noqa: E402
from tests.test_module_ddp import make_module  # noqa: E402


def listing(directory: Path) -> dict[str, str]:
    """Each file of the checkpoint directory and a hash of its bytes."""
    import hashlib

    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


if __name__ == "__main__":
    out, plain = Path(sys.argv[1]), "plain" in sys.argv[2:]
    model = tiny_model()
    full = make_rollout(model, seed=3, rows=8)
    module = make_module(model)
    trainer = fit_on(
        module,
        [full.select([0, 1, 2, 3]), full.select([4, 5, 6, 7])],
        max_steps=1,
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    )
    if not plain:
        assert make_sharded_saves_atomic(trainer.strategy)
    directory = out.parent / "checkpoints"
    path = directory / "last.ckpt"
    report: dict = {"saves": []}
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
            report["saves"].append({"raised": raised, "files": listing(path), "hidden": sorted(os.listdir(directory))})
        trainer.strategy.barrier("report")
    if trainer.global_rank == 0:
        out.write_text(json.dumps(report, indent=1))
