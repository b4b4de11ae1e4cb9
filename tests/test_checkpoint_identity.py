"""A checkpoint records the policy it was saved from; resuming it into another model is refused, naming both.

Issue 28 item 4: a config naming one checkpoint resumed with ``--ckpt_path`` from a run of another model trained
the file's weights without a word (same shapes), or stopped in Lightning's wall of ``size mismatch`` lines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.demo.tiny_bpe import build_bpe_checkpoint
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.checkpoint_identity import IDENTITY_KEY, CheckpointMismatchError, policy_identity
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout import SamplingConfig
from tests.module_helpers import tiny_model
from tests.tokenizer_builders import save_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Three model directories: a tiny Llama with an HF char tokenizer, a copy of it under another name, and a
    tiny Qwen2 with a byte-level BPE tokenizer (what tiny_bpe builds)."""
    root = tmp_path_factory.mktemp("models")
    llama = root / "llama"
    build_tiny_llama(seed=0).save_pretrained(str(llama))
    save_char_tokenizer(llama)
    copy = root / "llama-copy"
    shutil.copytree(llama, copy)
    qwen = build_bpe_checkpoint(root / "qwen2", ["reverse abc", "cba", "hello world"] * 10, vocab_size=300)
    return {"llama": llama, "llama-copy": copy, "qwen2": qwen}


def fit(module: OffPolicyRLModule, root: Path, max_steps: int, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[RolloutCallback(sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=4), seed=1)],
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=16)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def saved_run(module: OffPolicyRLModule, root: Path) -> Path:
    """One optimizer step of ``module``, saved."""
    trainer = fit(module, root, max_steps=1)
    path = root / "saved.ckpt"
    trainer.save_checkpoint(path)
    return path


def module(model, **kwargs) -> OffPolicyRLModule:
    return OffPolicyRLModule(model=model, optimizer=partial(torch.optim.AdamW, lr=1e-3), **kwargs)


def test_same_shapes_and_another_tokenizer_is_refused_naming_both_models(tmp_path, models):
    """The silent case: a tiny Llama trained with the CharTokenizer and a Llama directory of the same shapes with
    another tokenizer. Lightning loaded the weights without a word and trained them."""
    checkpoint = saved_run(module(build_tiny_llama(), tokenizer=CharTokenizer()), tmp_path)
    with pytest.raises(CheckpointMismatchError) as error:
        fit(module(str(models["llama"])), tmp_path, max_steps=2, ckpt_path=checkpoint)
    message = str(error.value)
    assert message.startswith(
        f"The checkpoint '{checkpoint}' was saved from a run of a LlamaForCausalLM instance passed from Python, and "
        f"this run trains model '{models['llama']}' (LlamaForCausalLM): its weights would replace this model's."
    )
    assert error.value.differences == ["tokenizer: CharTokenizer of 48 ids vs HFTokenizer of 48 ids"]
    assert (
        "To resume it, pass the model it was saved from (a LlamaForCausalLM instance passed from Python) and" in message
    )
    assert (
        "leave model.tokenizer unset, or set it to the tokenizer that run used; to train this model, start" in message
    )


def test_another_architecture_is_refused_before_lightning_loads_the_weights(tmp_path, models):
    """The issue's case: the config names a Qwen2 checkpoint, the file was saved by a run of the tiny Llama."""
    checkpoint = saved_run(module(str(models["llama"])), tmp_path)
    with pytest.raises(CheckpointMismatchError) as error:
        fit(module(str(models["qwen2"])), tmp_path, max_steps=2, ckpt_path=checkpoint)
    differences = error.value.differences
    assert differences[:3] == [
        "architecture: LlamaForCausalLM vs Qwen2ForCausalLM",
        "model_type: llama vs qwen2",
        "vocab_size: 64 vs 320",
    ]
    assert any(d.startswith("parameter names and shapes: 21 tensors") for d in differences)
    assert any(d.startswith("tokenizer: HFTokenizer of 48 ids vs HFTokenizer of") for d in differences)
    assert f"set model.model to the model it was saved from ('{models['llama']}'); to train" in str(error.value)


def test_a_checkpoint_saved_without_an_identity_is_compared_by_its_parameters(tmp_path, models):
    """Checkpoints written before identities were recorded: Lightning's strict-load error becomes one that names
    the model in the checkpoint's hyperparameters and the parameters that differ."""
    checkpoint = saved_run(module(str(models["llama"])), tmp_path)
    state = torch.load(checkpoint, weights_only=False)
    del state[IDENTITY_KEY]
    torch.save(state, checkpoint)
    with pytest.raises(CheckpointMismatchError) as error:
        fit(module(str(models["qwen2"])), tmp_path, max_steps=2, ckpt_path=checkpoint)
    message = str(error.value)
    assert f"saved from a run of model '{models['llama']}', and this run trains model '{models['qwen2']}'" in message
    assert "the checkpoint records no identity, so its parameters were compared" in message
    assert "parameters of other shapes (2): policy.model.embed_tokens.weight [64, 128] vs [320, 128]" in message
    assert "parameters only in this model (6): policy.model.layers.0.self_attn.q_proj.bias" in message
    # The same model still resumes from such a checkpoint.
    resumed = module(str(models["llama"]))
    fit(resumed, tmp_path, max_steps=2, ckpt_path=checkpoint)
    assert resumed.policy_version == 2


def test_other_lora_adapters_are_refused_naming_the_lora_settings(tmp_path, models):
    checkpoint = saved_run(module(str(models["llama"]), lora_rank=4), tmp_path)
    with pytest.raises(CheckpointMismatchError) as error:
        fit(module(str(models["llama"])), tmp_path, max_steps=2, ckpt_path=checkpoint)
    assert error.value.differences[0] == (
        "LoRA adapters: rank 4 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj vs none (lora_rank=0)"
    )
    both = f"and this run both name model '{models['llama']}' (LlamaForCausalLM), but the checkpoint holds another"
    assert both in str(error.value)
    assert "configure the adapters as the run that saved it did (model.lora_rank" in str(error.value)
    resumed = module(str(models["llama"]), lora_rank=4)
    fit(resumed, tmp_path, max_steps=2, ckpt_path=checkpoint)  # the same adapters resume
    assert resumed.policy_version == 2


def test_the_same_policy_under_another_name_resumes_with_a_warning(tmp_path, models):
    """A moved or copied directory: the same architecture, shapes and tokenizer load, and the warning says whose
    weights are trained."""
    trained = module(str(models["llama"]))
    checkpoint = saved_run(trained, tmp_path)
    resumed = module(str(models["llama-copy"]))
    with pytest.warns(UserWarning, match=f"saved from a run of model '{models['llama']}' \\(LlamaForCausalLM\\)"):
        fit(resumed, tmp_path, max_steps=2, ckpt_path=checkpoint)
    assert resumed.policy_version == 2


def test_a_resume_trains_its_own_settings_and_names_each_that_differs_from_the_checkpoints(tmp_path, models):
    """A checkpoint of a token-TIS run resumed by a run configured with geo-MIS and another micro-batch size:
    the resumed run trains geo-MIS (what it was configured with), and the warning names both settings."""
    from lightning_offpolicy.correction import OffPolicyCorrectionConfig

    path = saved_run(module(str(models["llama"]), correction=OffPolicyCorrectionConfig.token_tis()), tmp_path)
    resumed = module(
        str(models["llama"]), correction=OffPolicyCorrectionConfig.geo_mis(), max_tokens_per_microbatch=512
    )
    with pytest.warns(UserWarning, match=r"settings other than the run that saved it") as record:
        fit(resumed, tmp_path, max_steps=2, ckpt_path=path)
    (message,) = [str(w.message) for w in record if "settings other than" in str(w.message)]
    assert "max_tokens_per_microbatch: 8192 -> 512" in message
    assert "correction.tis_level: 'token' -> None" in message and "correction.geo_mask: False -> True" in message
    assert resumed.correction == OffPolicyCorrectionConfig.geo_mis() and resumed.policy_version == 2
    same = module(str(models["llama"]), correction=OffPolicyCorrectionConfig.token_tis())
    import warnings

    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        fit(same, tmp_path, max_steps=2, ckpt_path=path)
    assert not [w for w in quiet if "settings other than" in str(w.message)]


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_policy_has_the_identity_of_the_unsharded_one(one_rank_group):
    """FSDP2 (ModelParallelStrategy) swaps in an FSDP<Class> subclass and DTensor parameters: the identity names
    the model's own class and the global shapes, so checkpoints of sharded and unsharded runs compare equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = tiny_model()
    mesh = init_device_mesh("cpu", (1,))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    assert type(sharded).__name__ == "FSDPLlamaForCausalLM"
    tokenizer = CharTokenizer()
    assert policy_identity(sharded, tokenizer, "x") == policy_identity(tiny_model(), tokenizer, "x")


@pytest.mark.slow
@pytest.mark.parametrize("given", ["last", "file"])
def test_cli_ckpt_path_from_a_run_of_another_model_is_refused(tmp_path, models, given):
    """`lightning-offpolicy fit --model.model=<qwen2> --ckpt_path last|FILE` where the checkpoint is a tiny Llama
    run's (the quickstart's name kept, its model.model changed): refused before any step. With a FILE, LightningCLI
    alone parses the checkpoint's settings over the config and would train the Llama without a word."""
    checkpoints = tmp_path / "quickstart" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copy(saved_run(module(str(models["llama"])), tmp_path), checkpoints / "last.ckpt")
    command = [
        sys.executable, "-m", "lightning_offpolicy.cli", "fit",
        "--config", str(ROOT / "configs" / "quickstart.yaml"),
        f"--model.model={models['qwen2']}",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        f"--ckpt_path={'last' if given == 'last' else checkpoints / 'last.ckpt'}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 1, log[-3000:]
    assert (f"--ckpt_path last: resuming from {checkpoints / 'last.ckpt'}" in log) == (given == "last")
    assert (
        f"CheckpointMismatchError: The checkpoint '{checkpoints / 'last.ckpt'}' was saved from a run of model "
        f"'{models['llama']}' (LlamaForCausalLM), and this run trains model '{models['qwen2']}' (Qwen2ForCausalLM)"
    ) in log
    assert "give each model's runs their own trainer.logger name" in log
    # Nothing was trained or saved: the new version directory holds no checkpoint.
    assert sorted(p.name for p in (tmp_path / "quickstart").iterdir()) == ["version_0", "version_1"]
    assert not list((tmp_path / "quickstart" / "version_1").rglob("*.ckpt"))
