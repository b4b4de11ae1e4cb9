"""Held-out evaluation through Lightning's validation loop: greedy decoding, val/* metrics, no effect on training.

Real components: the tiny SFT-warmed Llama, HFEngine, Lightning's fit / validate loops, gloo DDP.
The references are written by hand: an argmax loop and a multinomial sampling loop over the same
model, each completion scored with the task's own reward.
"""

from __future__ import annotations

import copy
from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.batch import EvaluationBatch, PromptBatch
from lightning_offpolicy.data.tasks import TASKS, CopyTask, PromptDataModule
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.metrics.evaluation import EvaluationMetrics
from lightning_offpolicy.rollout import AsyncSettings, HFEngine
from lightning_offpolicy.rollout.engine import SamplingConfig, prompt_seed
from tests.module_helpers import argmax_completion, tiny_model

SAMPLES, NEW_TOKENS, SEED, THRESHOLD = 3, 7, 3, 0.75


# ------------------------------------------------------------------------------ hand-written references
@torch.no_grad()
def sampled_completions(model, prompt: list[int], k: int, max_new_tokens: int, eos: int, pad: int, seed: int):
    """``k`` samples at temperature 1: seed, then one multinomial draw per row and step (finished rows get pad)."""
    torch.manual_seed(seed)
    rows, outs, done = [list(prompt) for _ in range(k)], [[] for _ in range(k)], [False] * k
    for _ in range(max_new_tokens):
        probs = torch.softmax(model(input_ids=torch.tensor(rows)).logits[:, -1].float(), dim=-1)
        drawn = torch.multinomial(probs, num_samples=1).squeeze(1).tolist()
        for r in range(k):
            token = pad if done[r] else drawn[r]
            rows[r].append(token)
            if not done[r]:
                outs[r].append(token)
                done[r] = token == eos
        if all(done):
            break
    return outs


def expected_val_metrics(model, tokenizer, task, items, k=SAMPLES, seed=SEED, threshold=THRESHOLD) -> dict:
    """val/* of ``items`` (prompt, metadata) recomputed by hand from ``model``'s weights."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    greedy_rewards, sampled_rewards, passed, greedy_lengths, sampled_lengths = [], [], [], [], []
    for prompt, metadata in items:
        ids = tokenizer.encode(prompt)
        greedy = argmax_completion(model, ids, NEW_TOKENS, eos)
        greedy_rewards.append(task.reward(tokenizer.decode(greedy), metadata))
        greedy_lengths.append(len(greedy))
        samples = sampled_completions(model, ids, k, NEW_TOKENS, eos, pad, prompt_seed(seed, prompt))
        rewards = [task.reward(tokenizer.decode(s), metadata) for s in samples]
        sampled_rewards += rewards
        sampled_lengths += [len(s) for s in samples]
        passed.append(any(r >= threshold for r in rewards))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "val/reward_greedy": mean(greedy_rewards),
        "val/reward_sampled": mean(sampled_rewards),
        "val/pass@k": mean(passed),
        "val/length": mean(sampled_lengths),
        "val/length_greedy": mean(greedy_lengths),
    }


# ------------------------------------------------------------------------------ greedy decoding in the engines
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_hf_engine_greedy_equals_a_hand_written_argmax_loop(dtype):
    model = tiny_model()
    prompts = [[1, 5, 6, 7], [1, 9], [1, 12, 13, 14, 15, 16]]  # varied lengths: left padding in one batch
    engine = HFEngine(dtype=dtype, pad_token_id=0, eos_token_id=2)
    engine.update_weights(model, version=4)
    completions = engine.generate(prompts, SamplingConfig(max_new_tokens=10, samples_per_prompt=1, greedy=True))
    assert [c.prompt_index for c in completions] == [0, 1, 2]
    for c in completions:
        assert c.token_ids == argmax_completion(model, prompts[c.prompt_index], 10, eos=2)
        assert c.policy_version == 4
    # Deterministic: a seed changes nothing.
    again = engine.generate(prompts, SamplingConfig(max_new_tokens=10, samples_per_prompt=1, greedy=True), seed=5)
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]


def test_sampling_config_greedy_rules():
    with pytest.raises(ValueError, match=r"greedy=True, samples_per_prompt=4.*samples_per_prompt=1"):
        SamplingConfig(greedy=True)
    with pytest.raises(ValueError, match=r"temperature=0.*greedy=True"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="greedy='yes' must be a bool"):
        SamplingConfig(greedy="yes", samples_per_prompt=1)
    greedy = SamplingConfig(temperature=0.0, top_k=5, samples_per_prompt=1, greedy=True)
    # What the vLLM engines send: temperature 0 is vLLM's argmax; the filters are neutral.
    assert greedy.sampler_settings() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    assert SamplingConfig(temperature=0.7, top_k=5, top_p=0.9).sampler_settings() == {
        "temperature": 0.7,
        "top_k": 5,
        "top_p": 0.9,
    }


# ------------------------------------------------------------------------------ the metric
def test_evaluation_metrics_aggregate_exactly_and_pass_at_k_by_hand():
    first = EvaluationBatch.from_scores(
        greedy_rewards=[1.0, 0.5],
        sampled_rewards=[[0.2, 1.0, 0.0], [0.7, 0.6, 0.74]],
        greedy_lengths=[3, 5],
        sampled_lengths=[[1, 2, 3], [4, 5, 6]],
        success_threshold=0.75,
    )
    second = EvaluationBatch.from_scores(
        greedy_rewards=[0.0],
        sampled_rewards=[[0.75, 0.0, 0.0]],
        greedy_lengths=[7],
        sampled_lengths=[[2, 2, 2]],
        success_threshold=0.75,
    )
    assert first.passed.tolist() == [True, False] and second.passed.tolist() == [True]
    metrics = EvaluationMetrics()
    metrics.update(first)
    metrics.update(second)
    values = {k: float(v) for k, v in metrics.compute().items()}
    assert values == pytest.approx(
        {
            "val/reward_greedy": 1.5 / 3,  # a mean over prompts, not a mean of batch means
            "val/reward_sampled": (1.2 + 2.04 + 0.75) / 9,
            "val/pass@k": 2 / 3,
            "val/length": (6 + 15 + 6) / 9,
            "val/length_greedy": 15 / 3,
        },
        rel=1e-12,
    )


# ------------------------------------------------------------------------------ the data module
def test_held_out_prompts_are_disjoint_from_training_and_leave_training_unchanged():
    plain = PromptDataModule(task="addition", prompts_per_step=8, num_train_prompts=3000, seed=1)
    held = PromptDataModule(task="addition", prompts_per_step=8, num_train_prompts=3000, seed=1, num_val_prompts=200)
    assert held.train_dataset.items == plain.train_dataset.items  # same training prompts whatever the split
    train = {p for p, _ in held.train_dataset.items}
    val = [p for p, _ in held.val_dataset.items]
    # 3000 draws from 10^4 addition prompts: an independent stream would repeat ~25% of them.
    assert len(val) == 200 and not train & set(val) and len(set(val)) == 200
    assert [
        p
        for p, _ in PromptDataModule(
            task="addition", num_train_prompts=3000, seed=1, num_val_prompts=200
        ).val_dataset.items
    ] == val  # reproducible
    batches = list(held.val_dataloader())
    assert [len(b) for b in batches] == [16] * 12 + [8] and isinstance(batches[0], PromptBatch)
    assert [p for b in batches for p in b.prompts] == val  # fixed order
    assert plain.val_dataloader() == []


def test_held_out_prompt_errors_name_the_setting(monkeypatch):
    with pytest.raises(ValueError, match=r"`num_val_prompts` must be an int >= 0.*-1"):
        PromptDataModule(num_val_prompts=-1)
    with pytest.raises(ValueError, match=r"`val_prompts_per_step` must be a positive int.*0"):
        PromptDataModule(num_val_prompts=4, val_prompts_per_step=0)
    monkeypatch.setitem(TASKS, "two_prompts", lambda: CopyTask(letters="ab", min_len=1, max_len=1))
    with pytest.raises(ValueError, match=r"could not draw 1 held-out prompts.*lower `num_val_prompts`"):
        PromptDataModule(task="two_prompts", prompts_per_step=1, num_train_prompts=20, num_val_prompts=1)


# ------------------------------------------------------------------------------ through Lightning's loops
class EvalSpy(L.Callback):
    """Per validation epoch: the trainer's weights and version at its start, the val/* values at its end."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.train_rewards: list[float] = []
        self.train_prompts: list[list[str]] = []

    def on_validation_epoch_start(self, trainer, pl_module):
        self.records.append(
            {
                "sanity": trainer.sanity_checking,
                "version": pl_module.policy_version,
                "weights": copy.deepcopy(pl_module.policy.state_dict()),
                "generated_batches": trainer.callbacks[0].generated_batches,
            }
        )

    def on_validation_end(self, trainer, pl_module):
        record = self.records[-1]
        record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        producer = trainer.callbacks[0].producer
        record["engine_version"] = None if producer is None else producer.engine_version

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train_prompts.append(list(batch.prompts))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_rewards.append(float(trainer.callback_metrics["train/reward"]))


def fit(
    root,
    num_val_prompts: int,
    max_staleness: int = 0,
    sync_every: int = 1,
    engine=None,
    callbacks=(),
    batches: int = 4,
    val_check_interval: int = 2,
):
    L.seed_everything(0)
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    rollout = RolloutCallback(
        engine=engine,
        sampling=SamplingConfig(samples_per_prompt=SAMPLES, max_new_tokens=NEW_TOKENS),
        seed=SEED,
        asynchrony=AsyncSettings(max_staleness=max_staleness, sync_every=sync_every),
        success_threshold=THRESHOLD,
    )
    spy = EvalSpy()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=batches,
        callbacks=[rollout, spy, *callbacks],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        val_check_interval=val_check_interval,
        check_val_every_n_epoch=None,  # val_check_interval counts training batches across epochs
        num_sanity_val_steps=2,
        log_every_n_steps=1,  # the spy reads train/reward after every batch
    )
    data = PromptDataModule(
        task="reverse",
        prompts_per_step=4,
        num_train_prompts=64,
        num_val_prompts=num_val_prompts,
        val_prompts_per_step=4,
    )
    trainer.fit(module, data)
    return module, rollout, spy, trainer, data


def check_against_hand_recomputation(spy: EvalSpy, module, data) -> None:
    model = copy.deepcopy(module.policy).float()
    for record in spy.records:
        model.load_state_dict(record["weights"])
        expected = expected_val_metrics(model, module.tokenizer, data.task, data.val_dataset.items)
        assert record["metrics"] == pytest.approx(expected, rel=1e-6), record["version"]


def test_val_metrics_equal_a_hand_recomputation_and_validation_leaves_training_unchanged(tmp_path):
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/reward_greedy", mode="max")
    module, rollout, spy, trainer, data = fit(tmp_path / "val", num_val_prompts=6, callbacks=[checkpoint])
    # The sanity check (2 batches: all 6 prompts, the last batch short), then after training batches 2 and 4.
    assert [(r["sanity"], r["version"]) for r in spy.records] == [(True, 0), (False, 2), (False, 4)]
    evaluated = [r for r in spy.records if not r["sanity"]]
    check_against_hand_recomputation(spy, module, data)
    # The weights did move between evaluations (the recomputation is not of one fixed model).
    first, second = (list(r["weights"].values()) for r in evaluated)
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # val/reward_greedy is a usable ModelCheckpoint monitor.
    best = max(r["metrics"]["val/reward_greedy"] for r in evaluated)
    assert float(checkpoint.best_model_score) == pytest.approx(best, rel=1e-6)
    # Validation never advanced the training stream's counter (it numbers the seeds and is checkpointed).
    assert [r["generated_batches"] for r in spy.records] == [0, 2, 4]

    plain_module, plain_rollout, plain_spy, _, _ = fit(tmp_path / "plain", num_val_prompts=0)
    assert plain_spy.records == []  # num_val_prompts=0: no validation at all
    assert spy.train_prompts == plain_spy.train_prompts
    assert spy.train_rewards == plain_spy.train_rewards
    for a, b in zip(module.policy.parameters(), plain_module.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rollout.state_dict() == plain_rollout.state_dict()


@pytest.mark.slow
def test_async_validation_uses_the_current_weights_between_generation_requests(tmp_path):
    # Weights are pushed every 2 optimizer steps (versions 2, 4); the evaluation comes at version 3,
    # when the producer's engine still holds version 2: it must push the current weights itself.
    module, rollout, spy, trainer, data = fit(
        tmp_path,
        num_val_prompts=4,
        max_staleness=1,
        sync_every=2,
        engine=HFEngine(dtype="float32"),
        batches=4,
        val_check_interval=3,
    )
    assert [(r["sanity"], r["version"]) for r in spy.records] == [(True, 0), (False, 3)]
    check_against_hand_recomputation(spy, module, data)
    # The producer was told its engine holds the current weights.
    assert [r["engine_version"] for r in spy.records] == [None, 3]


def test_validation_needs_prompt_batches_and_the_callback(tmp_path):
    module = OffPolicyRLModule(model="tiny:reverse")
    with pytest.raises(TypeError, match="val_dataloader\\(\\) yielded list"):
        RolloutCallback().on_validation_batch_start(None, module, [["rev abc="]], 0)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=8, num_val_prompts=4)
    with pytest.raises(RuntimeError, match="Add\\s+lightning_offpolicy.lightning.callback.RolloutCallback"):
        trainer.validate(module, data)
