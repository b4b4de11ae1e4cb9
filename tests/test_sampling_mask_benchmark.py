"""benchmarks/sampling_mask_cost.py: its masked step against a float64 hand computation, its ratios by construction."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sampling_mask_cost  # noqa: E402  (benchmarks/ is not a package)


@pytest.mark.parametrize("path", ["fused", "lean"])
def test_the_masked_step_is_the_renormalized_logprob_and_its_gradient(path):
    generator = torch.Generator().manual_seed(0)
    tokens, vocab, hidden = 6, 11, 4
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    hidden_states = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    support = sampling_mask_cost.supports(tokens, vocab, 3, targets, generator)
    logits = hidden_states @ weight.T
    if path == "fused":
        inputs = {"hidden": hidden_states.clone().requires_grad_(True), "weight": weight.clone().requires_grad_(True)}
    else:
        inputs = {"logits": logits.clone().requires_grad_(True)}
    total = sampling_mask_cost.step(path, inputs, targets, support, temperature=0.9)

    reference = logits.clone().requires_grad_(True)
    expected = torch.zeros((), dtype=torch.float64)
    for t in range(tokens):
        kept = support[t].tolist()
        assert len(set(kept)) == len(kept) and int(targets[t]) in kept
        z = reference[t, kept] / 0.9
        expected = expected + z[kept.index(int(targets[t]))] - torch.logsumexp(z, dim=0)
    expected.backward()
    assert total == pytest.approx(float(expected.detach()), abs=1e-9)
    grad = inputs["logits"].grad if path == "lean" else None
    if grad is not None:
        torch.testing.assert_close(grad, reference.grad, atol=1e-9, rtol=0)
    else:
        torch.testing.assert_close(inputs["weight"].grad, reference.grad.T @ hidden_states, atol=1e-9, rtol=0)


def test_measure_reports_every_width_against_the_plain_row():
    settings = {"vocab": 50, "hidden": 8, "tokens": 16, "widths": [0, 3, 7], "repeats": 1}
    rows = sampling_mask_cost.measure("lean", settings)
    assert [row["width"] for row in rows] == [0, 3, 7]
    assert rows[0]["time_ratio"] == 1.0 and all(row["time_s"] > 0 for row in rows)
    text = sampling_mask_cost.render({"machine": "m", "date": "d", "code": "c", "command": "x"}, settings, rows)
    assert text.count("| lean |") == 3 and "plain (no mask)" in text
