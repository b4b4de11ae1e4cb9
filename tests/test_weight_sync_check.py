"""The weight-sync self-check's decision rules (``sync.check.SyncCheck`` / ``sync_tolerance``), without an engine.

The real-engine versions (a bfloat16 vLLM engine on a peaked policy, missing and partial syncs)
are in tests/test_vllm_engine.py; these pin the arithmetic with hand-computed numbers.
"""

from __future__ import annotations

import pytest
import torch

from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.rollout.vllm.sync.check import SyncCheck, SyncTolerance, sync_tolerance, weights_dtype


def _module(dtype: torch.dtype) -> torch.nn.Module:
    return torch.nn.Linear(2, 2).to(dtype)


@pytest.mark.parametrize(
    ("engine", "trainer", "atol", "expected"),
    [
        (torch.float32, torch.float32, None, SyncTolerance(1e-3, 0.0)),
        (torch.float32, torch.float32, 0.5, SyncTolerance(0.5, 0.0)),
        # bfloat16: eps 2**-7, times 16 = 0.125; float16: eps 2**-10, times 16
        (torch.bfloat16, torch.float32, None, SyncTolerance(1.0, 0.125)),
        (torch.float16, torch.float32, None, SyncTolerance(1.0, 16 * 2**-10)),
        (torch.float32, torch.bfloat16, None, SyncTolerance(1.0, 0.125)),  # a bfloat16 trainer counts too
        (torch.float16, torch.bfloat16, 2.0, SyncTolerance(2.0, 0.125)),  # the coarser of the two
        (None, torch.float32, None, SyncTolerance(1.0, 0.125)),  # unknown engine dtype: bfloat16 assumed
    ],
)
def test_sync_tolerance_follows_the_coarsest_dtype(engine, trainer, atol, expected):
    assert sync_tolerance(engine, _module(trainer), atol) == expected


def test_peaked_policy_in_bfloat16_is_no_false_alarm():
    # A peaked policy: the probe tokens sit at -200 nats; a healthy bfloat16 engine is off by ~1% of that.
    trainer = torch.tensor([-200.0, -150.0, -0.01, -300.0], dtype=torch.float64)
    engine = trainer * 1.011  # the largest relative gap measured on a real bfloat16 vLLM engine
    tol = sync_tolerance(torch.bfloat16, _module(torch.float32), None)
    check = SyncCheck("E")
    with pytest.raises(RuntimeError, match="differ from the trainer's by up to 3.3"):
        SyncCheck("old")(engine, trainer, 1.0)  # the former fixed tolerance: the false alarm of issue 11 §1
    assert check(engine, trainer, tol) == pytest.approx(3.3)
    assert check.last_max_abs_diff == pytest.approx(3.3)


def test_weights_that_arrived_wrong_are_caught_in_reduced_precision():
    trainer = torch.tensor([-200.0, -4.0, -2.0], dtype=torch.float64)
    tol = sync_tolerance(torch.bfloat16, _module(torch.float32), None)
    # Token 2: |diff| 3.0 > 1 + 0.125 * 4 = 1.5 (another model's weights: tens of percent off).
    engine = torch.tensor([-200.0, -7.0, -2.0], dtype=torch.float64)
    with pytest.raises(
        RuntimeError, match=r"probe token 2: engine -7, trainer -4; accepted: weight_sync\.tolerance=1 "
    ):
        SyncCheck("E")(engine, trainer, tol)
    # Token 1: 30 nats off at -200 is 15% (> 12.5%): caught although the absolute bound alone would be huge.
    with pytest.raises(RuntimeError, match="did not arrive"):
        SyncCheck("E")(torch.tensor([-230.0, -4.0, -2.0], dtype=torch.float64), trainer, tol)
    with pytest.raises(RuntimeError, match="did not arrive"):
        SyncCheck("E")(torch.tensor([float("nan"), -4.0, -2.0], dtype=torch.float64), trainer, tol)


def test_an_unchanged_engine_is_caught_at_once_even_when_peaked():
    tol = sync_tolerance(torch.bfloat16, _module(torch.float32), None)  # movement threshold atol / 100 = 0.01
    check = SyncCheck("E")
    trainer0 = torch.tensor([-200.0, -100.0], dtype=torch.float64)
    engine0 = torch.tensor([-201.0, -100.5], dtype=torch.float64)
    check(engine0, trainer0, tol)
    # The trainer moved by 0.02 nats (far below the 25-nat agreement bound at -200), the engine not at all.
    with pytest.raises(RuntimeError, match="moved by up to 0.02 .*did not change at all"):
        check(engine0.clone(), trainer0 + torch.tensor([0.02, 0.0], dtype=torch.float64), tol)


def test_small_missed_movements_add_up_from_the_engines_last_change():
    tol = SyncTolerance(atol=1.0, rtol=0.125)  # movement threshold 0.01
    check = SyncCheck("E")
    engine = torch.tensor([-10.0, -20.0], dtype=torch.float64)
    trainer = engine.clone()
    check(engine, trainer, tol)
    # Three syncs that each moved the trainer by 0.004 (below the threshold) while the engine stayed put:
    # the first two pass (0.004, 0.008 since the engine's last change), the third (0.012) is caught.
    step = torch.tensor([0.004, 0.0], dtype=torch.float64)
    check(engine.clone(), trainer + step, tol)
    check(engine.clone(), trainer + 2 * step, tol)
    with pytest.raises(RuntimeError, match="did not change at all"):
        check(engine.clone(), trainer + 3 * step, tol)


def test_an_engine_that_moves_resets_the_reference():
    tol = SyncTolerance(atol=1e-3)
    check = SyncCheck("E")
    values = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    check(values, values, tol)
    check(values + 1e-4, values + 1e-4, tol)  # both moved
    check(values + 1e-4, values + 1e-4 + 5e-6, tol)  # engine unchanged, trainer moved 5e-6 < 1e-5: accepted
    check.reset()
    check(values, values + 0.5e-3, tol)  # after a reset nothing to compare the movement with


# ---------------------------------------------------------------------------- the engine's dtype="auto"
def test_weights_dtype_is_the_dtype_of_most_parameter_elements():
    model = build_tiny_llama()
    assert weights_dtype(model) == torch.float32
    assert weights_dtype(model.to(torch.bfloat16)) == torch.bfloat16
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in lora.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    # float32 adapters around a bfloat16 base: the engine computes in the base's dtype.
    assert {p.dtype for p in lora.parameters()} == {torch.float32, torch.bfloat16}
    assert weights_dtype(lora) == torch.bfloat16
    with pytest.raises(ValueError, match="no floating-point parameters"):
        weights_dtype(torch.nn.Module())
