"""Settings that would train nothing or crash after the start fail before the first step, naming the setting."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from lightning_offpolicy.cli import _constructor_error
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.preflight import GROUP_ESTIMATORS, looks_local
from lightning_offpolicy.rollout import HFEngine, SamplingConfig
from lightning_offpolicy.rollout.advantages import compute_advantages
from lightning_offpolicy.rollout.vllm.settings import StartSettings
from tests.test_cli import ROOT, parse


class CountingHFEngine(HFEngine):
    """The real embedded engine, counting its generate calls (to prove a check came before any)."""

    calls = 0

    def generate(self, *args, **kwargs):
        CountingHFEngine.calls += 1
        return super().generate(*args, **kwargs)


def fit(module, callback, tmp_path, steps: int = 2) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=8))
    return trainer


# ---------------------------------------------------------------------------- samples_per_prompt=1
@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_give_zero_advantages_for_groups_of_one(estimator):
    """Why the check exists: the estimator's own output is identically 0 for groups of one."""
    rewards = torch.tensor([0.1, 0.9, 0.4, 1.0])
    advantages = compute_advantages(estimator, rewards, torch.arange(4))
    torch.testing.assert_close(advantages, torch.zeros(4), rtol=0, atol=0)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_one_sample_per_prompt_with_a_group_estimator_is_refused_at_construction(estimator):
    with pytest.raises(ValueError) as info:
        RolloutCallback(sampling=SamplingConfig(samples_per_prompt=1), advantage_estimator=estimator)
    message = str(info.value)
    for text in (
        "rollout.sampling.samples_per_prompt=1",
        f"rollout.advantage_estimator={estimator!r}",
        "reinforce",
        ">= 2",
    ):
        assert text in message


def test_one_sample_per_prompt_is_fine_with_reinforce_and_groups_of_two_with_grpo():
    RolloutCallback(sampling=SamplingConfig(samples_per_prompt=1), advantage_estimator="reinforce")
    RolloutCallback(sampling=SamplingConfig(samples_per_prompt=2), advantage_estimator="grpo")


def test_cli_refuses_one_sample_per_prompt_with_grpo():
    with pytest.raises(ValueError, match="rollout.sampling.samples_per_prompt=1"):
        parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--rollout.sampling.samples_per_prompt=1")


# ---------------------------------------------------------------------------- vocabulary
def test_tokenizer_larger_than_the_embedding_fails_before_the_first_step(tmp_path):
    tokenizer = CharTokenizer()
    assert len(tokenizer) == 48  # the tiny models' embeddings have 64 rows, this test's 32
    model = build_tiny_llama(vocab_size=32)
    module = OffPolicyRLModule(model=model, tokenizer=tokenizer)
    CountingHFEngine.calls = 0
    callback = RolloutCallback(
        engine=CountingHFEngine(), sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=4)
    )
    with pytest.raises(ValueError) as info:
        fit(module, callback, tmp_path)
    assert "48 token ids" in str(info.value) and "32 rows" in str(info.value)
    assert module.policy_version == 0 and CountingHFEngine.calls == 0


def test_the_rollout_callback_checks_the_vocabulary_of_any_module(tmp_path):
    """A module other than OffPolicyRLModule (no check of its own) is checked by the callback at fit start."""

    class PlainModule(OffPolicyRLModule):
        def configure_model(self) -> None:  # skips OffPolicyRLModule's own check
            self.policy.eval()

    module = PlainModule(model=build_tiny_llama(vocab_size=40), tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="48 token ids but the model's input embedding only 40 rows"):
        fit(module, RolloutCallback(sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=4)), tmp_path)
    assert module.policy_version == 0


# ---------------------------------------------------------------------------- context length
def test_max_new_tokens_at_the_models_context_fails_at_fit_start(tmp_path):
    model = build_tiny_llama()
    assert model.config.max_position_embeddings == 256
    module = OffPolicyRLModule(model=model, tokenizer=CharTokenizer())
    CountingHFEngine.calls = 0
    callback = RolloutCallback(
        engine=CountingHFEngine(), sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=256)
    )
    with pytest.raises(ValueError) as info:
        fit(module, callback, tmp_path)
    assert "rollout.sampling.max_new_tokens=256" in str(info.value) and "max_position_embeddings=256" in str(info.value)
    assert CountingHFEngine.calls == 0


def test_prompt_plus_max_new_tokens_past_the_context_fails_before_generating(tmp_path):
    """HFEngine alone only warns and generates past the model's positions; the callback refuses first."""
    tokenizer = CharTokenizer()
    data = PromptDataModule(task="reverse", prompts_per_step=2, num_train_prompts=8)
    shortest = min(len(tokenizer.encode(prompt)) for prompt, _ in data.train_dataset.items)
    max_new_tokens = 256 - shortest + 1  # every prompt of the set runs past 256
    module = OffPolicyRLModule(model=build_tiny_llama(), tokenizer=tokenizer)
    CountingHFEngine.calls = 0
    callback = RolloutCallback(
        engine=CountingHFEngine(), sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=max_new_tokens)
    )
    with pytest.raises(ValueError) as info:
        fit(module, callback, tmp_path)
    message = str(info.value)
    assert f"rollout.sampling.max_new_tokens={max_new_tokens}" in message and "max_position_embeddings=256" in message
    longest = int(message.split("(")[1].split(" tokens")[0])
    assert longest + max_new_tokens > 256 and longest >= shortest
    assert CountingHFEngine.calls == 0 and module.policy_version == 0


def test_vllm_max_model_len_is_checked_before_the_engine_starts(tmp_path):
    pytest.importorskip("vllm")
    from lightning_offpolicy.rollout import VLLMEngine

    engine = VLLMEngine(eos_token_id=2, start=StartSettings(max_model_len=32))
    module = OffPolicyRLModule(model=build_tiny_llama(), tokenizer=CharTokenizer())
    callback = RolloutCallback(engine=engine, sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=40))
    with pytest.raises(ValueError) as info:
        fit(module, callback, tmp_path)
    assert "rollout.sampling.max_new_tokens=40" in str(info.value) and "max_model_len=32" in str(info.value)
    assert not engine.started


# ---------------------------------------------------------------------------- model path
@pytest.mark.parametrize("kind", ["relative", "absolute", "home", "parent_exists"])
def test_a_missing_local_model_directory_is_named(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    name = {
        "relative": "./no_such_model",
        "absolute": str(tmp_path / "no_such_model"),
        "home": "~/no_such_model",
        "parent_exists": "checkpoints/step-100",
    }[kind]
    with pytest.raises(FileNotFoundError) as info:
        OffPolicyRLModule(model=name)
    assert "was not found" in str(info.value) and "OffPolicyRLModule.model" in str(info.value)
    assert "Repo id" not in str(info.value)


def test_a_file_is_not_a_model_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file, not a model directory"):
        OffPolicyRLModule(model=str(tmp_path / "model.safetensors"))


def test_hub_ids_and_tiny_specs_are_not_taken_for_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_local("Qwen/Qwen2.5-1.5B-Instruct") and not looks_local("gpt2")
    assert not looks_local("tiny:reverse")
    OffPolicyRLModule(model="Qwen/Qwen2.5-1.5B-Instruct")  # not loaded before configure_model


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_misspelt_hub_name_without_network_fails_at_once(tmp_path):
    # A hub that refuses connections and an empty cache: huggingface_hub read both at import, hence a subprocess.
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{_free_port()}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
    }
    code = (
        "from lightning_offpolicy.train.policy import load_policy; load_policy('Qwen/Qwen2.5-0.5B-Instrcut', 'float32')"
    )
    begin = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - begin
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("OSError: OffPolicyRLModule.model='Qwen/Qwen2.5-0.5B-Instrcut' is not a local directory")
    assert "cannot be reached (ConnectError" in message and "Check the spelling" in message
    assert "Without network, set HF_HUB_OFFLINE=1" in message
    assert "Retrying" not in done.stderr
    assert elapsed < 30, elapsed  # before: ~60 s of retries (5 tries, 1+2+4+8+8 s back-off), then a generic OSError


def test_hub_names_offline_cached_or_local_are_judged_without_the_network(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from lightning_offpolicy import preflight

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(preflight, "_hub_unreachable", lambda *a: pytest.fail("the hub was asked"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"'org/missing' is not a local directory .* and HF_HUB_OFFLINE is set"):
        preflight.check_hub_model("org/missing")
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    preflight.check_hub_model("org/cached")  # in the cache: transformers loads it offline
    preflight.check_hub_model(str(tmp_path))  # a local directory
    preflight.check_hub_model("tiny:reverse")


def test_a_tokenizer_hub_name_that_cannot_be_fetched_fails_at_once_naming_the_setting(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from lightning_offpolicy import preflight
    from lightning_offpolicy.data.tokenizers import HFTokenizer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(preflight, "_hub_unreachable", lambda *a: pytest.fail("the hub was asked"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"HFTokenizer.path='org/missing' is not a local directory .* HF_HUB_OFFLINE"):
        HFTokenizer("org/missing")
    # A repo whose cache holds a tokenizer file but no config.json is judged by the tokenizer's files.
    snapshot = tmp_path / "hub" / "models--org--tok" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tok" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tok" / "refs" / "main").write_text("abc")
    preflight.check_hub_model("org/tok", "HFTokenizer.path", files=("tokenizer_config.json", "tokenizer.json"))
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set"):
        preflight.check_hub_model("org/tok")  # no config.json cached: a model could not load from it


def test_cli_names_the_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="was not found"):
        parse("--config", str(ROOT / "configs" / "quickstart.yaml"), f"--model.model={tmp_path}/missing")


# ---------------------------------------------------------------------------- unknown task
def test_cli_shows_the_unknown_task_message_itself():
    with pytest.raises(ValueError) as info:
        parse("--config", str(ROOT / "configs" / "quickstart.yaml"), "--data.init_args.task=foo")
    message = str(info.value)
    available = "addition, copy, guess_number, multiply, reverse"
    assert message.startswith(f"PromptDataModule: unknown `task` 'foo'; available: {available}")
    assert "Union subtypes" not in message


def test_other_union_errors_are_left_as_they_are():
    """Only a constructor's error under the union wrapper is unwrapped; jsonargparse's own errors stay whole."""
    plain = ValueError("Does not validate against any of the Union subtypes\n...")
    assert _constructor_error(plain) is None
    assert _constructor_error(ValueError("something else")) is None
