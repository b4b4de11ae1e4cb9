"""Real 2-process runs on CPU (gloo): metrics and batch-normalised weights are exact across ranks.

Two ranks holding half of a batch each must report exactly what one process reports on the
whole batch: the metric states are sums / max / min, never means of means.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_offpolicy.correction import (
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    compute_correction,
    policy_loss,
)
from lightning_offpolicy.metrics.correction import CorrectionMetrics, PolicyLossMetrics
from tests.module_helpers import TWO_RANK_START_METHOD

WORLD_SIZE = 2
CONFIGS = {
    "geo_token_tis": OffPolicyCorrectionConfig.geo_mis_token_tis(low=0.97, high=1.03, clip_high=1.3),
    "seq_tis_normalized": OffPolicyCorrectionConfig(
        tis_level="sequence", tis_clip_high=3.0, normalize_weights=True, outlier_token_veto=True
    ),
    "token_tis_normalized": OffPolicyCorrectionConfig(
        tis_level="token",
        tis_clip_high=1.5,
        normalize_weights=True,
        token_mask=True,
        kl_reject="k3",
        kl_reject_threshold=0.05,
    ),
}


def full_batch(seed: int = 0, batch: int = 8, length: int = 12):
    gen = torch.Generator().manual_seed(seed)
    prox = -torch.rand(batch, length, generator=gen) * 3
    rollout = prox + 0.25 * torch.randn(batch, length, generator=gen)
    rollout[1, 2] = prox[1, 2] + 12.0  # an outlier token for the veto
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[5] = 0  # a row with no response token
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    logprobs = prox + 0.1 * torch.randn(batch, length, generator=gen)
    advantages = torch.randn(batch, generator=gen)
    return prox, rollout, mask, logprobs, advantages


def run_on(rows: torch.Tensor, cfg: OffPolicyCorrectionConfig):
    prox, rollout, mask, logprobs, advantages = (t[rows] for t in full_batch())
    out = compute_correction(prox, rollout, mask, cfg)
    corr_metrics, loss_metrics = CorrectionMetrics(cfg), PolicyLossMetrics()
    corr_metrics.update(stats=out.stats)
    _, info = policy_loss(
        logprobs, prox, rollout, advantages, mask, PolicyLossConfig(rollout_kl_coef=0.1), correction=out
    )
    loss_metrics.update(info=info)
    values = {k: float(v) for k, v in {**corr_metrics.compute(), **loss_metrics.compute()}.items()}
    return values, out.weights, out.mask


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {}
        for name, cfg in CONFIGS.items():
            # Uneven, interleaved shards: rank 0 gets 3 rows, rank 1 gets 5.
            rows = torch.tensor([0, 3, 6]) if rank == 0 else torch.tensor([1, 2, 4, 5, 7])
            values, weights, mask = run_on(rows, cfg)
            results[name] = {
                "values": values,
                "rows": rows.tolist(),
                "weights": weights.tolist(),
                "mask": mask.tolist(),
            }
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_metrics_and_normalized_weights_equal_single_process(tmp_path):
    mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD_SIZE, start_method=TWO_RANK_START_METHOD
    )
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for name, cfg in CONFIGS.items():
        expected, weights, mask = run_on(torch.arange(8), cfg)
        for rank in ranks:
            got = rank[name]["values"]
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
            rows = rank[name]["rows"]
            assert torch.allclose(torch.tensor(rank[name]["weights"]), weights[rows], rtol=1e-6, atol=1e-7), name
            assert torch.equal(torch.tensor(rank[name]["mask"]), mask[rows]), name
    # The scenario exercises what it claims to: masks fire and weights are not all 1.
    values, weights, _ = run_on(torch.arange(8), CONFIGS["seq_tis_normalized"])
    assert values["rollout_corr/outlier_veto_seq_reject_rate"] > 0
    assert not torch.allclose(weights, torch.ones_like(weights))
    values, _, _ = run_on(torch.arange(8), CONFIGS["token_tis_normalized"])
    assert values["rollout_corr/token_mask_token_reject_rate"] > 0
    assert values["rollout_corr/kl_reject_seq_reject_rate"] > 0
