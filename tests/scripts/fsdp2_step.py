"""Two CPU processes, ModelParallelStrategy (FSDP2 ``fully_shard`` per decoder layer, gloo): two decoupled
PPO steps; rank 0 saves the gathered full weights and the logged metrics to ``sys.argv[1]``.

Run by tests/test_module_fsdp.py as a script: Lightning's ModelParallelStrategy starts its other
ranks by re-running the command (no spawn launcher), which must not be pytest itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_offpolicy.rollout.hf.engine import HFEngine  # noqa: E402
from lightning_offpolicy.rollout.vllm.export import export_state_dict  # noqa: E402
from tests.module_helpers import fit_on, make_rollout, tiny_model  # noqa: E402
from tests.test_module_ddp import make_module  # noqa: E402

if __name__ == "__main__":
    model = tiny_model()
    full = make_rollout(model, seed=3, rows=8)
    halves = [full.select([0, 1, 2, 3]), full.select([4, 5, 6, 7])]
    module = make_module(model)
    trainer = fit_on(
        module,
        halves,
        max_steps=2,
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    )
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
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save(
            {"weights": weights, "exported": exported, "metrics": metrics, "sharded": sharded, "refused": refused},
            sys.argv[1],
        )
