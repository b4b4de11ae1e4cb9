"""Packed, padding-free micro-batches: the same logprobs, loss, correction, metrics and gradients as padded ones.

The batch's sequences differ ~10x in length (7 to 45 tokens), so a padded micro-batch is mostly padding
and a packed one has none. The references are the padded forward (float64 models: agreement to
rounding) and, for the logprobs, each row run alone without padding.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from lightning_offpolicy.batch import RolloutBatch
from lightning_offpolicy.correction import OffPolicyCorrectionConfig, PolicyLossConfig
from lightning_offpolicy.demo.tiny import tiny_llama_config
from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.logprobs import causal_lm_token_logprobs
from lightning_offpolicy.logprobs.packed import pack_rows, packing_refusal, packs_rows
from tests.module_helpers import TOKENIZER, fit_on

VOCAB = 64
PROMPT_LENGTHS = [3, 5, 2, 4, 6, 3]
RESPONSE_LENGTHS = [4, 40, 6, 35, 3, 30]


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, attention: str = "sdpa", seed: int = 0):
    """A tiny Llama or Qwen2 (qkv biases) built from a config, eval mode, a peaked head as after training."""
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config = tiny_llama_config(VOCAB, max_position_embeddings=128)
    if arch == "qwen2":
        config = Qwen2Config(**config.to_dict())
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM)(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model.to(dtype).eval()


def long_tail_batch(model, seed: int = 0, support: bool = False, mismatch: float = 0.3) -> RolloutBatch:
    """Rows of 7 to 45 real tokens; rollout logprobs = the model's + noise; top-k-like kept sets with ``support``."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    responses = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in RESPONSE_LENGTHS]
    supports = None
    if support:
        supports = []
        for response in responses:
            rows = []
            for t, token in enumerate(response):
                if t % 3 == 2:  # some positions keep the whole vocabulary
                    rows.append([])
                    continue
                others = [v for v in torch.randperm(VOCAB, generator=gen)[:6].tolist() if v != token][:5]
                rows.append([token, *others])
            supports.append(rows)
    batch = RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        rewards=torch.rand(len(prompts), generator=gen),
        advantages=torch.randn(len(prompts), generator=gen),
        group_ids=list(range(len(prompts))),
        policy_versions=[0] * len(prompts),
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        pad_token_id=TOKENIZER.pad_token_id,
        sampling_supports=supports,
    )
    with torch.no_grad():
        true = logprobs(model, batch, packed=False).float()
    noise = mismatch * torch.randn(true.shape, generator=gen)
    return batch.with_fields(rollout_logprobs=(true + noise) * batch.response_mask)


def logprobs(model, batch: RolloutBatch, packed: bool, **kwargs):
    return causal_lm_token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.prompt_length,
        sampling_support=batch.sampling_support,
        packed=packed,
        **kwargs,
    )


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------ the forward
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fused_head", [None, False], ids=["fused-head", "logits"])
@pytest.mark.parametrize("support", [False, True], ids=["full-vocab", "sampling-support"])
def test_packed_logprobs_entropy_and_gradients_equal_padded(arch, fused_head, support):
    model = tiny_model(arch)
    batch = long_tail_batch(model, support=support)
    real = batch.attention_mask[:, batch.prompt_length :].bool()
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * real
    results = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        lp, ent = logprobs(model, batch, packed, return_entropy=True, fused_head=fused_head, chunk_size=16)
        ((lp * weights).sum() + 0.3 * (ent * weights).sum()).backward()
        results[packed] = (lp.detach(), ent.detach(), gradients(model))
    (lp_pad, ent_pad, grad_pad), (lp_pack, ent_pack, grad_pack) = results[False], results[True]
    assert lp_pack.dtype == torch.float64 and lp_pack.shape == lp_pad.shape
    torch.testing.assert_close(lp_pack[real], lp_pad[real], rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_pack[real], ent_pad[real], rtol=0, atol=1e-10)
    assert (lp_pack[~real] == 0).all() and (ent_pack[~real] == 0).all()
    assert grad_pack.keys() == grad_pad.keys() and len(grad_pad) == len(list(model.parameters()))
    for name, grad in grad_pad.items():
        torch.testing.assert_close(grad_pack[name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_packed_logprobs_equal_each_row_run_alone():
    model = tiny_model("llama")
    batch = long_tail_batch(model)
    with torch.no_grad():
        lp = logprobs(model, batch, packed=True)
    for i, (p_len, r_len) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
        row = batch.input_ids[i][batch.attention_mask[i].bool()][None]
        with torch.no_grad():
            alone = torch.log_softmax(model(input_ids=row).logits[0], -1)
        expected = alone[p_len - 1 : -1].gather(-1, row[0, p_len:, None]).squeeze(-1)
        torch.testing.assert_close(lp[i, :r_len], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("fused_head", [None, False], ids=["rows", "one-row"])
def test_no_packed_sequence_sees_another(arch, attention, fused_head):
    """New tokens in row 0 (same lengths) leave every other row's packed logprobs bit-identical, packed in
    several rows (the fused head; row 0 shares one with row 3) or in one (the logits path); the same packed
    row with one continuous run of position ids (one sequence) does leak, so the check can fail."""
    model = tiny_model(arch, attention=attention)
    batch = long_tail_batch(model)
    other_ids = batch.input_ids.clone()
    real = batch.attention_mask[0].bool()
    other_ids[0, real] = (other_ids[0, real] + 7) % (VOCAB - 3) + 3
    changed = batch.with_fields(input_ids=other_ids)
    with torch.no_grad():
        before = logprobs(model, batch, packed=True, fused_head=fused_head)
        after = logprobs(model, changed, packed=True, fused_head=fused_head)
    assert not torch.equal(before[0], after[0])
    assert torch.equal(before[1:], after[1:])

    # Control: one sequence over the packed tokens; row 1's logits now depend on row 0's tokens.
    layouts = [pack_rows(b.input_ids, b.attention_mask, b.prompt_length) for b in (batch, changed)]
    row1 = slice(sum(PROMPT_LENGTHS[:1] + RESPONSE_LENGTHS[:1]), sum(PROMPT_LENGTHS[:2] + RESPONSE_LENGTHS[:2]))
    with torch.no_grad():
        continuous = [
            model(input_ids=layout.input_ids, position_ids=torch.arange(layout.input_ids.shape[1])[None]).logits
            for layout in layouts
        ]
    assert not torch.allclose(continuous[0][0, row1], continuous[1][0, row1])


def test_pack_rows_lays_each_sequence_whole_and_finds_each_tokens_predictor():
    # Three sequences of 3, 2 and 4 real tokens (prompt columns 0-2, response columns 3-4).
    ids = torch.tensor([[0, 11, 12, 13, 0], [0, 0, 21, 22, 0], [31, 32, 33, 34, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 0]])
    one = pack_rows(ids, mask, response_start=3)
    assert one.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert one.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert one.rows.tolist() == [0, 1, 2] and one.columns.tolist() == [0, 0, 0]
    assert one.source.tolist() == [1, 3, 7]  # the token before each response token, in its own sequence
    # Rows at most 5 wide, first-fit by decreasing length: [seq 2 | tail], [seq 0, seq 1].
    rows = pack_rows(ids, mask, response_start=3, width=5)
    assert rows.input_ids.tolist() == [[31, 32, 33, 34, 0], [11, 12, 13, 21, 22]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert rows.source.tolist() == [6, 8, 2]  # flat indices into the 2 x 5 cells
    # A row whose first real token is a response token has nothing to predict it.
    with pytest.raises(ValueError, match="at least one prompt token per row"):
        pack_rows(ids, torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 1, 0], [1, 1, 1, 1, 0]]), response_start=3)


def test_a_packed_micro_batch_budgets_real_tokens():
    batch = long_tail_batch(tiny_model("llama"))
    # Real tokens per row: 7, 45, 8, 39, 9, 33; greedy in order within 50.
    assert batch.attention_mask.sum(-1).tolist() == [7, 45, 8, 39, 9, 33]
    assert batch.micro_batch_rows(50, packed=True) == [[0], [1], [2, 3], [4, 5]]
    # Padded, every pair costs 2 x (longest prompt + longest response) > 50: one row each.
    assert batch.micro_batch_rows(50) == [[0], [1], [2], [3], [4], [5]]
    assert batch.micro_batch_rows(100, packed=True) == [[0, 1, 2, 3], [4, 5]]


# ------------------------------------------------------------------------------ the training step
def module(model, **kwargs) -> OffPolicyRLModule:
    defaults = dict(
        tokenizer=TOKENIZER,
        optimizer=partial(torch.optim.SGD, lr=0.01),
        correction=OffPolicyCorrectionConfig.token_tis(clip_high=1.5),
        loss=PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, rollout_kl_coef=0.05),
        gradient_clip_val=None,
        shuffle_minibatches=False,
        num_minibatches=2,
        max_tokens_per_microbatch=60,
    )
    defaults.update(kwargs)
    return OffPolicyRLModule(model=model, **defaults)


def train_both_ways(make_model, batch: RolloutBatch, **kwargs):
    """One batch (two optimizer steps), packed and padded: the modules and their logged metrics."""
    out = {}
    for packing in ("on", "off"):
        trained = module(make_model(), packing=packing, **kwargs)
        assert trained.packed is (packing == "on")
        trainer = fit_on(trained, [batch], max_steps=trained.optimizer_steps_per_batch)
        out[packing] = (trained, {k: float(v) for k, v in trainer.callback_metrics.items()})
    return out["on"], out["off"]


def assert_same_training(packed, padded, start) -> None:
    (packed_module, packed_metrics), (padded_module, padded_metrics) = packed, padded
    moved = 0.0
    for (name, a), b, s in zip(
        packed_module.policy.named_parameters(), padded_module.policy.parameters(), start.parameters(), strict=True
    ):
        moved = max(moved, float((b - s).detach().abs().max()))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=name)
    assert moved > 1e-4  # the step is not trivially zero
    keys = [k for k in padded_metrics if not k.startswith("perf/")]
    assert {"rollout_corr/kl", "rollout_corr/is_weight_mean", "ppo/clip_frac", "train/grad_norm"} <= set(keys)
    assert set(packed_metrics) == set(padded_metrics)
    for key in keys:
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_packed_step_trains_and_logs_what_a_padded_step_does(arch):
    """Two optimizer steps over several micro-batches each (different groupings in the two modes): the same
    weights (so the same gradients: plain SGD), loss, correction and metrics."""
    start = tiny_model(arch)
    batch = long_tail_batch(start)
    packed, padded = train_both_ways(lambda: copy.deepcopy(start), batch)
    assert len(batch.micro_batch_rows(60, packed=True)) < len(batch.micro_batch_rows(60))
    assert_same_training(packed, padded, start)


def test_a_packed_step_under_a_sampling_mask_with_an_entropy_bonus():
    start = tiny_model("llama")
    batch = long_tail_batch(start, support=True)
    loss = PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, entropy_coef=0.01)
    packed, padded = train_both_ways(lambda: copy.deepcopy(start), batch, loss=loss)
    assert_same_training(packed, padded, start)


def test_lora_with_gradient_checkpointing_trains_the_same_packed():
    start = tiny_model("qwen2")
    batch = long_tail_batch(start)
    lora = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "v_proj", "lm_head"])

    def make_model():
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):  # peft draws lora_A from the global generator
            torch.manual_seed(5)
            config = LoraConfig(r=4, lora_alpha=8.0, target_modules=lora["lora_target_modules"])
            model = get_peft_model(copy.deepcopy(start), config)
        with torch.no_grad():  # lora_B starts at 0: give the adapters a value, so that A's gradient counts too
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
        return model

    packed, padded = train_both_ways(make_model, batch, gradient_checkpointing=True, **lora)
    assert any(getattr(m, "gradient_checkpointing", False) for m in packed[0].policy.modules())
    assert_same_training(packed, padded, make_model())


def test_packing_is_the_default_and_the_forward_sees_only_real_tokens():
    model = tiny_model("llama", dtype=torch.float32)
    trained = module(model, num_minibatches=1, max_tokens_per_microbatch=8192)
    assert trained.packing == "auto" and trained.packed
    batch = long_tail_batch(model)
    shapes = []
    model.base_model.register_forward_hook(lambda mod, args, kwargs, out: shapes.append(kwargs), with_kwargs=True)
    fit_on(trained, [batch], max_steps=1)
    (inputs,) = shapes  # pi_prox came from the step's own forward: one forward
    assert inputs["attention_mask"] is None
    # sdpa: the 141 real tokens (7, 45, 8, 39, 9, 33) in rows as wide as the padded batch (46), first-fit
    # by decreasing length: [45], [39, 7], [33, 9], [8]; the padded forward costs 6 x 46 positions.
    assert tuple(batch.input_ids.shape) == (6, 46) and int(batch.attention_mask.sum()) == 141
    assert tuple(inputs["input_ids"].shape) == (4, 46) and int((inputs["input_ids"] != 0).sum()) == 141


# ------------------------------------------------------------------------------ fallback and errors
def tiny_gpt2():
    """A transformers causal LM outside PACKED_ARCHITECTURES."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=1, n_head=2)
        return GPT2LMHeadModel(config).eval()


def test_a_model_that_cannot_pack_falls_back_to_padded_micro_batches():
    start = tiny_gpt2()
    assert "GPT2LMHeadModel is not in" in packing_refusal(start)
    batch = long_tail_batch(start)
    auto = module(copy.deepcopy(start), packing="auto")
    off = module(copy.deepcopy(start), packing="off")
    assert not auto.packed and not off.packed
    fit_on(auto, [batch], max_steps=2)
    fit_on(off, [batch], max_steps=2)
    for a, b in zip(auto.policy.parameters(), off.policy.parameters(), strict=True):
        assert torch.equal(a, b)


def test_packing_on_is_refused_for_a_model_that_cannot_pack():
    with pytest.raises(ValueError, match=r"OffPolicyRLModule.packing='on', but .*GPT2LMHeadModel"):
        module(tiny_gpt2(), packing="on")
    with pytest.raises(ValueError, match="packed=True, but this model cannot run packed sequences"):
        logprobs(tiny_gpt2(), long_tail_batch(tiny_gpt2()), packed=True)
    llama = tiny_model("llama")
    llama.config._attn_implementation = "paged|sdpa"
    assert "attention implementation 'paged|sdpa'" in packing_refusal(llama)


def test_the_flash_kernels_get_one_packed_row_and_the_mask_builders_several():
    """flash_attention_* find packed sequences only in a batch of one row; eager / sdpa / flex in every row."""
    llama = tiny_model("llama")
    assert packs_rows(llama) and packs_rows(get_peft_model_of(llama))
    for implementation in ("flash_attention_2", "flash_attention_3"):
        llama.config._attn_implementation = implementation
        assert packing_refusal(llama) is None and not packs_rows(llama)


def get_peft_model_of(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))


@pytest.mark.parametrize("value", ["yes", True, None])
def test_a_bad_packing_setting_names_it(value):
    with pytest.raises(ValueError, match=r"OffPolicyRLModule.packing=.* is not known; allowed: 'auto'"):
        module(tiny_model("llama"), packing=value)
