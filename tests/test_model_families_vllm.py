"""The weight-sync conformance matrix on real vLLM engines, for the families the demo checkpoints do not
cover: a tied output layer with its own vLLM module (Qwen2), a tied one without (Gemma-2, with attention
logits large enough for its soft-capping to matter), mixture-of-experts (Qwen3-MoE); and a sync that
leaves one tensor out, caught at that sync whatever the tolerance. The other families:
``lightning-offpolicy check-model --family all`` (``make soak``)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_offpolicy.modelcheck import cli as check_model
from lightning_offpolicy.modelcheck.families import build_tiny, family_config
from lightning_offpolicy.modelcheck.matrix import FLOAT32_ATOL, check_vllm
from lightning_offpolicy.rollout.vllm.settings import RemoteWeightSyncSettings
from tests.vllm_fixtures import requires_vllm

pytestmark = [requires_vllm, pytest.mark.long("three vLLM engines start (~30 s each on 2 cores)")]


@pytest.fixture(scope="module")
def rows():
    """check-model's rows for Qwen2 tied and Qwen3-MoE, and the cells of a Gemma-2 with large attention logits."""
    out = check_model.run([(name, family_config(name)) for name in ("qwen2-tied", "qwen3-moe")], ["vllm"])
    gemma = build_tiny(family_config("gemma2"))
    with torch.no_grad():
        for name, param in gemma.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(30)  # attention logits past the soft-capping's knee (50)
    out.append(("gemma2 (q, k x30)", True, check_vllm(gemma)))
    return {label: {cell.name: cell for cell in cells} for label, _, cells in out}


@pytest.mark.parametrize("label", ["qwen2-tied", "qwen3-moe", "gemma2 (q, k x30)"])
def test_every_cell_passes(rows, label):
    cells = rows[label]
    assert {"vllm memory", "vllm file", "vllm memory == file", "vllm lora merged"} <= set(cells)
    for name in ("vllm memory", "vllm file", "vllm lora merged"):
        assert cells[name].ok and cells[name].max_abs_diff <= FLOAT32_ATOL, (name, cells[name])
    assert cells["vllm memory == file"].ok and cells["vllm memory == file"].max_abs_diff == 0.0
    if "trainer packed / fused head" in cells:
        assert cells["trainer packed / fused head"].ok


def test_the_table(rows):
    """What a user sees: every cell ok with its difference."""
    table = check_model.format_table([(label, True, list(cells.values())) for label, cells in rows.items()])
    assert "FAIL" not in table and table.count("| ok (") == 3 * 4 + 2


@pytest.mark.parametrize("transport", ["memory", "file"])
@pytest.mark.parametrize("left_out", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
def test_a_tensor_left_out_of_a_sync_is_an_error_at_that_sync(
    vllm_engine, trainer_model, tiny_ckpt, monkeypatch, transport, left_out
):
    """Even with a tolerance that would let the difference through (a bfloat16 engine's 1 nat), a sync whose
    tensors miss one of the engine's parameters, or one part of a fused one (k of qkv), raises naming it."""
    import lightning_offpolicy.rollout.vllm.sync.in_process as inprocess
    from lightning_offpolicy.modelcheck.matrix import move_every_parameter

    real = inprocess.full_state_dict
    monkeypatch.setattr(
        inprocess, "full_state_dict", lambda *a, **k: {n: t for n, t in real(*a, **k).items() if n != left_out}
    )
    monkeypatch.setattr(vllm_engine, "weight_transport", transport)
    monkeypatch.setattr(vllm_engine, "weight_sync_tolerance", 1.0)
    move_every_parameter(trainer_model, seed=1, scale=0.001)  # a step's worth: under the tolerance
    expected = "model.layers.0.self_attn.qkv_proj (partly)" if "k_proj" in left_out else left_out
    try:
        with pytest.raises(RuntimeError, match=r"received nothing .*" + re.escape(expected)):
            vllm_engine.update_weights(trainer_model, 7)
    finally:
        monkeypatch.undo()
        from transformers import LlamaForCausalLM

        vllm_engine.update_weights(LlamaForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32), 0)
    assert vllm_engine.last_sync_check_max_abs_diff < 1e-4  # whole again


def test_the_remote_server_runs_the_kits_receiver_and_checks_what_arrived(vllm_server, trainer_model, tmp_path):
    """launch_local_server starts vLLM with the kit's receiver: the remote sync drops a tied alias, processes
    tied layers again and names a tensor that did not arrive, as the in-process engine does."""
    from lightning_offpolicy.rollout.vllm.remote import RemoteVLLMEngine

    engine = RemoteVLLMEngine(
        vllm_server.base_url,
        eos_token_id=2,
        request_timeout_s=300,
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path)),
    )
    try:
        assert engine._has_receiver() and engine._tied_export() == "drop"
        state = {k: v for k, v in trainer_model.state_dict().items() if k != "model.norm.weight"}
        with pytest.raises(RuntimeError, match=r"received nothing .*model\.norm\.weight"):
            engine.update_weights(state, 3)
        engine.update_weights(trainer_model, 0)
    finally:
        engine.close()
