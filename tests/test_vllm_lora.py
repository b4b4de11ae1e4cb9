"""LoRA (peft) weight sync into VLLMEngine, both ``weight_sync.lora`` modes, on real vLLM.

The export itself (:func:`merged_state_dict`, :func:`base_state_dict`) is checked in pure Python
against a float64 hand computation. The engine tests start one engine per mode (never two alive
at once: the machine may be a 2-core CPU shared with other vLLM tests) with the settings of the
shared engine in ``tests/vllm_fixtures.py``. Measured numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lightning_offpolicy.data.tasks import get_task
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from lightning_offpolicy.rollout.engine import Completion, SamplingConfig
from lightning_offpolicy.rollout.vllm.inprocess import VLLMEngine
from lightning_offpolicy.rollout.vllm.settings import WeightSyncSettings
from lightning_offpolicy.rollout.vllm.sync.peft_export import (
    adapter_rank,
    base_state_dict,
    merged_state_dict,
    save_adapter,
)
from tests.vllm_fixtures import (
    ENGINE_START,
    lose_syncs,
    requires_vllm,
)

peft = pytest.importorskip("peft")

#: LoRA of the tests: rank 8 on the attention's q and v projections (scaling alpha / r = 2).
RANK, ALPHA, TARGETS = 8, 16, ["q_proj", "v_proj"]
#: Largest |engine - peft model| per-token logprob residual accepted (float32 on both sides).
LOGPROB_TOL = 1e-4
MEASURED: dict[str, float] = {}


def _lora(base: torch.nn.Module, seed: int = 0, **config) -> torch.nn.Module:
    """``base`` with a LoRA whose A and B are random (peft starts B at zero: no effect)."""
    settings = dict(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    settings.update(config)
    model = peft.get_peft_model(base, peft.LoraConfig(**settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _tiny_lora(**config) -> torch.nn.Module:
    from lightning_offpolicy.demo.tiny import build_tiny_llama

    return _lora(build_tiny_llama(), **config)


def _ckpt_lora(ckpt: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return _lora(LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval())


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bit_identical(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == snapshot.keys() and all(torch.equal(state[k], v) for k, v in snapshot.items())


def _optimizer_step(model: torch.nn.Module, seed: int) -> None:
    """One SGD step on the trainable (LoRA) parameters, as training would take."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(seed))
    model.train()
    loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    with torch.no_grad():
        for p in trainable:
            p.sub_(0.5 * p.grad)
            p.grad = None
    model.eval()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    task, tok, rng = get_task("reverse"), CharTokenizer(), random.Random(seed)
    return [tok.encode(task.sample(rng)[0], add_bos=True) for _ in range(n)]


@torch.no_grad()
def _teacher_forced(model: torch.nn.Module, prompts: list[list[int]], completions: list[Completion]) -> list[float]:
    """The model's temperature-1 logprob of every generated token, flattened in completion order."""
    out: list[float] = []
    for c in completions:
        prompt = prompts[c.prompt_index]
        ids = torch.tensor([prompt + c.token_ids])
        lp = causal_lm_token_logprobs(model, ids, torch.ones_like(ids), response_start=len(prompt))
        out.extend(lp[0].tolist())
    return out


def _residual(engine: VLLMEngine, model: torch.nn.Module, seed: int) -> tuple[float, float, list[Completion]]:
    """Max |engine - model| logprob of sampled tokens, and the mean |engine - base model| (adapters off)."""
    prompts = _prompts(12, seed=seed)
    completions = engine.generate(prompts, SamplingConfig(max_new_tokens=12, samples_per_prompt=2), seed=seed)
    sampled = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float64)
    with model.disable_adapter():
        base = torch.tensor(_teacher_forced(model, prompts, completions), dtype=torch.float64)
    peft_lp = torch.tensor(_teacher_forced(model, prompts, completions), dtype=torch.float64)
    return float((sampled - peft_lp).abs().max()), float((sampled - base).abs().mean()), completions


# ---------------------------------------------------------------------- the export, no engine


def test_merged_state_dict_is_w_plus_scaled_ba_in_float64():
    model = _tiny_lora()
    before = _snapshot(model)
    base = model.get_base_model()
    merged = merged_state_dict(model)
    assert _bit_identical(model, before), "the export wrote the trainer's weights"
    plain_names = {k.replace(".base_layer", "") for k in base.state_dict() if "lora_" not in k}
    assert set(merged) == plain_names and not any("lora" in k or "base_layer" in k for k in merged)
    checked = 0
    for name, module in base.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        w = module.base_layer.weight.double()
        a, b = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
        expected = w + (ALPHA / RANK) * b @ a
        got = merged[f"{name}.weight"]
        assert got.dtype == torch.float32 and got.shape == w.shape
        assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
        assert (got.double() - w).abs().max() > 0.1  # the adapter does change this layer
        checked += 1
    assert checked == 2 * len(base.model.layers)
    untouched = [k for k in merged if not any(t in k for t in TARGETS)]
    assert untouched and all(torch.equal(merged[k], base.state_dict()[k]) for k in untouched)


def test_merged_weights_compute_what_the_peft_model_computes():
    from transformers import LlamaForCausalLM

    model = _tiny_lora()
    plain = LlamaForCausalLM(model.get_base_model().config).eval()
    plain.load_state_dict(merged_state_dict(model), strict=True)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (plain(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
        with model.disable_adapter():
            effect = (plain(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
    assert diff < 1e-4 < 0.1 < effect


def test_export_follows_the_model_state():
    model = _tiny_lora()
    base_weights = {k.replace(".base_layer", ""): v.clone() for k, v in model.get_base_model().state_dict().items()}
    base = base_state_dict(model)
    assert base.keys() <= base_weights.keys() and all(torch.equal(v, base_weights[k]) for k, v in base.items())
    with model.disable_adapter():  # the forward is the base model's: so is the export
        assert all(torch.equal(v, base[k]) for k, v in merged_state_dict(model).items())
    out_of_place = merged_state_dict(model)
    model.merge_adapter()  # peft's in-place merge: the export must not add the adapter twice
    try:
        merged_in_place = merged_state_dict(model)
        assert max(float((merged_in_place[k] - v).abs().max()) for k, v in out_of_place.items()) < 1e-6
        with pytest.raises(ValueError, match="unmerge"):
            base_state_dict(model)
    finally:
        model.unmerge_adapter()


def test_modules_to_save_exports_the_copy_in_use():
    model = _tiny_lora(modules_to_save=["lm_head"])
    with torch.no_grad():
        model.get_base_model().lm_head.modules_to_save["default"].weight.add_(1.0)
    original = model.get_base_model().lm_head.original_module.weight
    assert torch.equal(merged_state_dict(model)["lm_head.weight"], original + 1.0)
    assert torch.equal(base_state_dict(model)["lm_head.weight"], original)  # the trained copy is the adapter's


def test_unsupported_models_are_refused():
    with pytest.raises(TypeError, match="peft model"):
        merged_state_dict(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="DoRA"):
        merged_state_dict(_tiny_lora(use_dora=True))


def test_save_adapter_and_rank(tmp_path):
    model = _tiny_lora(rank_pattern={"v_proj": 12})
    assert adapter_rank(model) == 12
    path = save_adapter(model, tmp_path / "a")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}


@requires_vllm
def test_adapter_mode_needs_a_peft_model_and_a_first_sync():
    from lightning_offpolicy.demo.tiny import build_tiny_llama
    from lightning_offpolicy.rollout.vllm.sync.lora import vllm_lora_rank

    engine = VLLMEngine(model="unused", eos_token_id=2, weight_sync=WeightSyncSettings(lora="adapter"))
    with pytest.raises(TypeError, match=r"weight_sync\.lora='merged'"):
        engine.update_weights(build_tiny_llama(), 0)
    with pytest.raises(TypeError, match=r"weight_sync\.lora='merged'"):
        engine.update_weights({"w": torch.zeros(1)}, 0)
    with pytest.raises(RuntimeError, match="update_weights before generate"):
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2))
    assert not engine.started
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 17, 320)] == [1, 8, 8, 16, 32, 320]
    with pytest.raises(ValueError, match=r"weight_sync\.lora='merged'"):
        vllm_lora_rank(4096)


# ---------------------------------------------------------------------- real engines, one at a time


@pytest.fixture
def merged_engine(vllm_engine, tiny_ckpt):
    """The session's shared engine: started from a module with ``weight_sync.lora="merged"`` (the default), what a
    merged-LoRA run starts; the checkpoint's weights are put back after the test."""
    from transformers import LlamaForCausalLM

    assert vllm_engine.lora_sync == "merged"
    yield vllm_engine
    vllm_engine.update_weights(LlamaForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32), 0)


@pytest.fixture(scope="module")
def adapter_engine(vllm_engine_holder, tiny_ckpt):
    """An engine of its own with vLLM's LoRA on, started from the checkpoint (the base weights pushed at the
    first sync, and only then)."""
    vllm_engine_holder.close()  # the session's shared engine, if a test started it: one engine at a time
    engine = VLLMEngine(
        model=str(tiny_ckpt), eos_token_id=2, start=ENGINE_START, weight_sync=WeightSyncSettings(lora="adapter")
    )
    yield engine
    engine.close()
    print("\nMEASURED", {k: round(v, 6) for k, v in MEASURED.items()})


@pytest.fixture(scope="module")
def lora_model(tiny_ckpt):
    """The trainer's peft model (shared by the engine tests in order: they change its LoRA weights)."""
    return _ckpt_lora(tiny_ckpt)


@pytest.mark.slow
@requires_vllm
def test_merged_sync_matches_the_peft_model(merged_engine, lora_model):
    engine = merged_engine
    before = _snapshot(lora_model)
    engine.update_weights(lora_model, 0)  # the merged weights replace the checkpoint's
    assert _bit_identical(lora_model, before)
    assert engine.last_sync_check_max_abs_diff <= 1e-3
    residual, vs_base, _ = _residual(engine, lora_model, seed=1)
    MEASURED["merged_start_residual_max"] = residual
    print(f"\nmerged (start): |engine - peft| max {residual:.3g}, |engine - base| mean {vs_base:.3g}")
    assert residual <= LOGPROB_TOL and vs_base > 0.05

    # (2) an optimizer step on the LoRA weights, then a real push into the running engine
    _optimizer_step(lora_model, seed=2)
    before = _snapshot(lora_model)
    engine.update_weights(lora_model, 1)
    assert _bit_identical(lora_model, before), "the merged sync changed the trainer's weights"
    MEASURED["merged_sync_s"] = engine.last_sync_time_s
    MEASURED["merged_check_max_abs_diff"] = engine.last_sync_check_max_abs_diff
    residual, vs_base, completions = _residual(engine, lora_model, seed=3)
    MEASURED["merged_sync_residual_max"] = residual
    print(f"merged sync {engine.last_sync_time_s:.4f} s: |engine - peft| max {residual:.3g}")
    assert engine.version == 1 and {c.policy_version for c in completions} == {1}
    assert residual <= LOGPROB_TOL and vs_base > 0.05


@pytest.mark.slow
@requires_vllm
def test_merged_sync_that_did_not_arrive_is_caught(merged_engine, lora_model, monkeypatch):
    engine = merged_engine
    engine.update_weights(lora_model, 10)  # a good sync: the check's reference point
    lose_syncs(monkeypatch, engine)  # the peer bug: nothing arrives
    _optimizer_step(lora_model, seed=4)
    with pytest.raises(RuntimeError, match="did not arrive"):
        engine.update_weights(lora_model, 11)
    assert engine.version == 10
    monkeypatch.undo()
    engine.update_weights(lora_model, 11)
    assert engine.version == 11 and engine.last_sync_check_max_abs_diff <= 1e-3


@pytest.mark.slow
@requires_vllm
def test_adapter_sync_matches_the_peft_model(adapter_engine, lora_model, monkeypatch):
    # Started from the checkpoint: the base weights are pushed at the first sync, and only then.
    engine = adapter_engine
    base_pushes = []
    push = engine._push_weights
    monkeypatch.setattr(engine, "_push_weights", lambda tensors: (base_pushes.append(len(tensors)), push(tensors)))
    before = _snapshot(lora_model)
    engine.update_weights(lora_model, 0)
    assert _bit_identical(lora_model, before)
    assert engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank == RANK
    MEASURED["adapter_first_sync_s"] = engine.last_sync_time_s  # base push + adapter
    residual, vs_base, _ = _residual(engine, lora_model, seed=1)
    MEASURED["adapter_start_residual_max"] = residual
    print(f"\nadapter (first sync {engine.last_sync_time_s:.3f} s): |engine - peft| max {residual:.3g}")
    assert residual <= LOGPROB_TOL and vs_base > 0.05

    first_request = engine._lora_request
    _optimizer_step(lora_model, seed=5)
    before = _snapshot(lora_model)
    engine.update_weights(lora_model, 1)
    assert _bit_identical(lora_model, before)
    MEASURED["adapter_sync_s"] = engine.last_sync_time_s
    MEASURED["adapter_check_max_abs_diff"] = engine.last_sync_check_max_abs_diff
    residual, vs_base, completions = _residual(engine, lora_model, seed=3)
    MEASURED["adapter_sync_residual_max"] = residual
    print(f"adapter sync {engine.last_sync_time_s:.4f} s: |engine - peft| max {residual:.3g}")
    assert residual <= LOGPROB_TOL and vs_base > 0.05
    assert engine.version == 1 and {c.policy_version for c in completions} == {1}
    assert len(base_pushes) == 1, "the base weights must be pushed once"
    request = engine._lora_request
    assert request.lora_int_id != first_request.lora_int_id and request.lora_path != first_request.lora_path
    assert set(engine.llm.llm_engine.list_loras()) == {request.lora_int_id}  # the old adapter was unloaded
    assert [p.name for p in engine._lora_dir.iterdir()] == [Path(request.lora_path).name]  # old files deleted
    adapter_files = [f for f in Path(request.lora_path).rglob("*") if f.is_file()]
    assert engine.last_sync_bytes == sum(f.stat().st_size for f in adapter_files)  # the adapter only

    # The same version again (a sync without an optimizer step) still gets a fresh adapter id.
    _optimizer_step(lora_model, seed=6)
    engine.update_weights(lora_model, 1)
    assert engine._lora_request.lora_int_id not in (request.lora_int_id, first_request.lora_int_id)
    assert _residual(engine, lora_model, seed=7)[0] <= LOGPROB_TOL


@pytest.mark.slow
@requires_vllm
def test_adapter_sync_that_did_not_arrive_is_caught(adapter_engine, lora_model, monkeypatch):
    engine = adapter_engine
    engine.update_weights(lora_model, 20)
    monkeypatch.setattr(engine, "_load_adapter", lambda request: None)  # written, never loaded: the peer bug
    _optimizer_step(lora_model, seed=8)
    with pytest.raises(RuntimeError, match="did not arrive"):
        engine.update_weights(lora_model, 21)
    assert engine.version == 20
    monkeypatch.undo()
    engine.update_weights(lora_model, 21)
    assert engine.version == 21 and engine.last_sync_check_max_abs_diff <= 1e-3
