"""DAPO's dynamic sampling, overlong filtering and soft overlong punishment, on a real tiny Llama
sampled by the real HFEngine (the reward function decides which groups carry a signal)."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.data.tasks import PromptDataModule
from lightning_offpolicy.data.tokenizers import CharTokenizer
from lightning_offpolicy.demo.tiny import build_tiny_llama
from lightning_offpolicy.lightning.callback import RolloutCallback
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.rollout.advantages import compute_advantages
from lightning_offpolicy.rollout.asynchrony import AsyncSettings
from lightning_offpolicy.rollout.dapo import DAPOSettings, informative_rows, overlong_penalty
from lightning_offpolicy.rollout.engine import SamplingConfig
from lightning_offpolicy.rollout.hf.engine import HFEngine
from lightning_offpolicy.rollout.rollouter import RolloutControls, Rollouter

TOKENIZER = CharTokenizer()
SAMPLES = 4


def alternating_reward(prompts, completions, metadata):
    """1/0 alternating within a group for "mixed" prompts (a signal), 1.0 for "same" prompts (none)."""
    rewards, position = [], {}
    for prompt, meta in zip(prompts, metadata, strict=True):
        k = position[prompt] = position.get(prompt, -1) + 1
        rewards.append(float(k % 2) if meta["kind"] == "mixed" else 1.0)
    return rewards


def _prompts(*kinds: str, start: int = 0) -> PromptBatch:
    texts = [f"p{start + i}:{kind}" for i, kind in enumerate(kinds)]
    return PromptBatch(prompts=texts, metadata=[{"kind": kind} for kind in kinds])


def _rollouter(dapo: DAPOSettings, refills: list[PromptBatch] | None = None, max_new_tokens: int = 6) -> Rollouter:
    engine = HFEngine(pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id)
    engine.update_weights(build_tiny_llama(vocab_size=TOKENIZER.vocab_size), version=0)
    queue = refills  # popped in place: a test sees how many were drawn
    return Rollouter(
        engine,
        TOKENIZER,
        alternating_reward,
        SamplingConfig(max_new_tokens=max_new_tokens, samples_per_prompt=SAMPLES),
        dapo=dapo,
        controls=RolloutControls(more_prompts=(lambda: queue.pop(0)) if refills is not None else None),
    )


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([0, 10, 12, 13, 14, 16])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0], dtype=torch.float64)
    torch.testing.assert_close(overlong_penalty(lengths, max_new_tokens=16, buffer=4, factor=1.0), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4, 0.5), expected * 0.5)
    assert not overlong_penalty(lengths, 16, 0, 1.0).any()


def test_informative_rows():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert informative_rows(rewards, groups).tolist() == [False, False, True, True, False, False, False]


def test_dynamic_sampling_drops_flat_groups_and_refills():
    rollouter = _rollouter(
        DAPOSettings(dynamic_sampling=True), refills=[_prompts("mixed", "same", "mixed", "mixed", start=10)]
    )
    rollout, _ = rollouter.rollout(_prompts("same", "mixed", "same", "mixed"), index=0)
    # 2 informative groups of the batch, then the first 2 informative ones of the refill.
    assert rollouter.last_stats == {"groups_dropped": 3.0, "refill_batches": 1.0, "groups_short": 0.0}
    assert rollout.num_sequences == 4 * SAMPLES
    assert rollout.group_ids.tolist() == [g for g in range(4) for _ in range(SAMPLES)]
    for group in range(4):
        rows = rollout.group_ids == group
        assert rollout.rewards[rows].unique().numel() == 2, "every kept group carries a signal"
    torch.testing.assert_close(
        rollout.advantages[:, 0], compute_advantages("grpo", rollout.rewards, rollout.group_ids) * 1.0
    )


def test_refills_stop_at_the_cap_and_train_what_they_have():
    same = [_prompts("same", "same", start=10 + 2 * i) for i in range(5)]
    rollouter = _rollouter(DAPOSettings(dynamic_sampling=True, max_refill_batches=2), refills=same)
    rollout, _ = rollouter.rollout(_prompts("same", "mixed", "same", "mixed"), index=0)
    assert rollouter.last_stats == {"groups_dropped": 6.0, "refill_batches": 2.0, "groups_short": 2.0}
    assert rollout.num_sequences == 2 * SAMPLES
    assert len(same) == 3, "exactly two refill batches were drawn"


def test_nothing_informative_trains_the_batch_itself():
    rollouter = _rollouter(DAPOSettings(dynamic_sampling=True), refills=None)
    rollout, _ = rollouter.rollout(_prompts("same", "same"), index=0)
    assert rollout.num_sequences == 2 * SAMPLES and not rollout.advantages.any()
    assert rollouter.last_stats == {"groups_dropped": 2.0, "refill_batches": 0.0, "groups_short": 2.0}


def test_overlong_filter_and_soft_punishment():
    plain = _rollouter(DAPOSettings(), max_new_tokens=3)
    base, _ = plain.rollout(_prompts("mixed", "mixed", "mixed"), index=0)
    assert plain.last_stats == {}

    dapo = DAPOSettings(overlong_filter=True, overlong_buffer=2, overlong_penalty_factor=0.5)
    rollouter = _rollouter(dapo, max_new_tokens=3)
    rollout, _ = rollouter.rollout(_prompts("mixed", "mixed", "mixed"), index=0)
    lengths = base.response_mask.sum(-1)
    penalty = overlong_penalty(lengths, 3, 2, 0.5).float()
    # Same seed, same completions; the reward is lowered near the limit.
    torch.testing.assert_close(rollout.rewards, base.rewards + penalty)
    torch.testing.assert_close(rollout.reward_components["overlong_penalty"], penalty)
    assert bool((penalty < 0).any())
    # Completions cut at max_new_tokens leave the loss; their rewards still set the baseline.
    cut = torch.tensor([c == 3 for c in lengths.tolist()]) & (
        base.input_ids[:, base.prompt_length + 2] != TOKENIZER.eos_token_id
    )
    assert rollouter.last_stats["overlong_filtered"] == float(cut.sum()) > 0
    assert not rollout.response_mask[cut].any()
    torch.testing.assert_close(rollout.response_mask[~cut], base.response_mask[~cut])
    advantages = compute_advantages("grpo", rollout.rewards, rollout.group_ids)
    torch.testing.assert_close(rollout.advantages[~cut, 0], advantages[~cut])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dapo=dict(max_refill_batches=-1)), "max_refill_batches"),
        (dict(dapo=dict(overlong_buffer=17)), r"overlong_buffer=17 must be an int in \[0, max_new_tokens=16\]"),
        (dict(dapo=dict(overlong_penalty_factor=-1.0)), "overlong_penalty_factor"),
        (
            {
                "dapo": {"dynamic_sampling": True},
                "sampling": {"samples_per_prompt": 1},
                "advantage_estimator": "reinforce",
            },
            "samples_per_prompt >= 2",
        ),
    ],
)
def test_bad_settings_name_the_argument(kwargs, message):
    kwargs = dict(kwargs)
    sampling = SamplingConfig(max_new_tokens=16, **kwargs.pop("sampling", {}))
    with pytest.raises(ValueError, match=message):
        RolloutCallback(sampling=sampling, dapo=DAPOSettings(**kwargs.pop("dapo")), **kwargs)


class _Logged(L.Callback):
    """Keeps the logged rollout/* and reward/* values and each trained batch's group count."""

    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []
        self.groups: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.groups.append(int(batch.rollout.group_ids.unique().numel()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(
            {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("rollout/", "reward/"))}
        )


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_fit_with_dapo_logs_the_counts(tmp_path, max_staleness):
    """A real fit (tiny:reverse, whose rewards are often flat within a group): dynamic sampling refills
    from a second pass over the train prompts, in the synchronous and the background callback."""
    L.seed_everything(0)
    module = OffPolicyRLModule(model="tiny:reverse", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    callback = RolloutCallback(
        engine=HFEngine(dtype="float32"),
        sampling=SamplingConfig(samples_per_prompt=2, max_new_tokens=7),
        asynchrony=AsyncSettings(max_staleness=max_staleness),
        dapo=DAPOSettings(dynamic_sampling=True, max_refill_batches=2, overlong_filter=True, overlong_buffer=2),
    )
    logged = _Logged()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, callbacks=[callback, logged], default_root_dir=tmp_path,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(task="reverse", prompts_per_step=4, num_train_prompts=64))
    assert len(logged.values) == 4
    for values, groups in zip(logged.values, logged.groups, strict=True):
        for key in ("groups_dropped", "refill_batches", "groups_short", "overlong_filtered"):
            assert f"rollout/{key}" in values, values
        assert values["rollout/refill_batches"] <= 2
        assert groups == 4 - values["rollout/groups_short"] or values["rollout/groups_short"] == 4
        assert values["reward/overlong_penalty"] <= 0
    assert sum(v["rollout/groups_dropped"] for v in logged.values) > 0, "the task must have flat groups to drop"
