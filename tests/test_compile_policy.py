"""``compile_policy``: the policy's decoder compiled with dynamic shapes gives the eager values and gradients.

Compilation is slow on CPU, so the compiled models are built once per file (module-scoped fixtures) and
each test that trains one puts its weights back.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

from lightning_offpolicy.lightning.module import OffPolicyRLModule
from lightning_offpolicy.train.compiled_policy import compile_policy, is_compiled, resolve_compile
from tests.module_helpers import TOKENIZER, fit_on
from tests.test_packing import gradients, logprobs, long_tail_batch, module, tiny_gpt2, tiny_model

SETTING = "OffPolicyRLModule.compile_policy"


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def assert_close_gradients(compiled: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> None:
    """float32 rounding of other summation orders: close relative to each gradient's largest entry."""
    for name, grad in eager.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(compiled[name], grad, rtol=0, atol=1e-5 * scale + 1e-7, msg=name)


@contextlib.contextmanager
def restored(*models: torch.nn.Module) -> Iterator[None]:
    """Put the models' weights back after the block (the fixtures are shared)."""
    states = [copy.deepcopy(m.state_dict()) for m in models]
    try:
        yield
    finally:
        for m, state in zip(models, states, strict=True):
            m.load_state_dict(state)
            m.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(eager, compiled)``: the same float32 tiny Llama twice, the second with its decoder compiled."""
    eager = tiny_model("llama", dtype=torch.float32)
    compiled = copy.deepcopy(eager)
    compile_policy(compiled)
    assert is_compiled(compiled) and not is_compiled(eager)
    return eager, compiled


@pytest.fixture(scope="module")
def batch(pair) -> object:
    """Six rows of 3 to 40 response tokens (7 to 45 real tokens): the packed rows differ more than 10x."""
    return long_tail_batch(pair[0])


# ------------------------------------------------------------------------------ the forward and backward
@pytest.mark.long("the first test of the file compiles the decoder (forward and backward): ~35 s cold on 2 cores")
def test_compiled_logprobs_entropy_and_gradients_equal_eager(pair, batch):
    eager, compiled = pair
    real = batch.attention_mask[:, batch.prompt_length :].bool()
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(3)) * real
    results = []
    with restored(eager, compiled):
        for model in (eager, compiled):
            lp, ent = logprobs(model, batch, packed=True, return_entropy=True)
            ((lp * weights).sum() + 0.3 * (ent * weights).sum()).backward()
            results.append((lp.detach(), ent.detach(), gradients(model)))
    (lp_e, ent_e, grad_e), (lp_c, ent_c, grad_c) = results
    torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_c, ent_e, rtol=0, atol=1e-5)
    assert grad_c.keys() == grad_e.keys() and len(grad_e) == len(list(eager.parameters()))
    assert_close_gradients(grad_c, grad_e)


def test_micro_batches_of_other_lengths_reuse_the_graph(pair, batch):
    eager, compiled = pair
    with restored(compiled):
        logprobs(compiled, batch, packed=True).sum().backward()  # compiled here if no test did before
        before = graphs()
        # Sequences of 7-9 and of 33-45 real tokens, each packed into 3 rows (a micro-batch packed into one
        # row would be a second graph: dynamic shapes specialize sizes of 1).
        for rows in ([0, 2, 4], [1, 3, 5]):
            micro = batch.select(rows).trim()
            lp = logprobs(compiled, micro, packed=True)
            lp.sum().backward()
            with torch.no_grad():
                expected = logprobs(eager, micro, packed=True)
            torch.testing.assert_close(lp.detach(), expected, rtol=0, atol=1e-5)
    assert graphs() == before


def test_generation_and_copies_stay_eager(pair):
    eager, compiled = pair
    before = graphs()
    prompt = torch.tensor([[1, 5, 9, 12]])
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(compiled.generate(prompt, **kwargs), eager.generate(prompt, **kwargs))
    assert graphs() == before  # a call with a KV cache runs the eager forward
    assert not is_compiled(copy.deepcopy(compiled))  # a copy would otherwise run the original's weights


# ------------------------------------------------------------------------------ the training step, checkpoints
def test_one_training_step_compiled_equals_eager_and_checkpoints_cross_load(pair, batch, tmp_path):
    eager, compiled = pair
    trained = {}
    with restored(eager, compiled):
        for name, model, mode in (("eager", eager, "off"), ("compiled", compiled, "on")):
            # One micro-batch of the whole batch (the graph the fixture built) and pi_prox from its own forward.
            m = module(model, num_minibatches=1, max_tokens_per_microbatch=8192, compile_policy=mode)
            trainer = fit_on(m, [batch], max_steps=1)
            assert m.packed and is_compiled(m.policy) is (mode == "on")
            trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("perf/")}
            trained[name] = (m, metrics, {k: v.clone() for k, v in m.state_dict().items()})
        (m_e, metrics_e, state_e), (m_c, metrics_c, state_c) = trained["eager"], trained["compiled"]
        assert {"ppo/clip_frac", "train/grad_norm", "rollout_corr/kl"} <= metrics_e.keys() == metrics_c.keys()
        for key, value in metrics_e.items():
            assert metrics_c[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        assert list(state_c) == list(state_e) and not any("_orig_mod" in k for k in state_c)
        for key, value in state_e.items():
            torch.testing.assert_close(state_c[key], value, rtol=1e-4, atol=1e-6, msg=key)
        # Each checkpoint loads, strictly, into the module of the other setting.
        for source, target in (("compiled", m_e), ("eager", m_c)):
            checkpoint = torch.load(tmp_path / f"{source}.ckpt", weights_only=False)
            target.load_state_dict(checkpoint["state_dict"], strict=True)
            expected = trained[source][2]
            assert all(torch.equal(v, expected[k]) for k, v in target.state_dict().items())


def test_lora_with_gradient_checkpointing_compiles_to_the_eager_gradients(batch, monkeypatch):
    """peft's LoRA layers and gradient checkpointing (its recomputation in the backward) under dynamo and AOT
    autograd, run op by op (``aot_eager``): what inductor's code computes for this decoder is the test above's."""
    import functools

    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    from lightning_offpolicy.train.policy import enable_gradient_checkpointing

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        eager = get_peft_model(tiny_model("llama", dtype=torch.float32), LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():  # lora_B starts at 0: give it a value, so that lora_A's gradient counts too
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    enable_gradient_checkpointing(eager)
    compiled = copy.deepcopy(eager)
    compile_policy(compiled)
    results = []
    for model in (eager, compiled):
        lp = logprobs(model, batch, packed=True)
        lp.sum().backward()
        results.append((lp.detach(), gradients(model)))
    (lp_e, grad_e), (lp_c, grad_c) = results
    torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=1e-5)
    assert grad_c.keys() == grad_e.keys() and grad_e and all("lora" in k for k in grad_e)
    assert_close_gradients(grad_c, grad_e)


# ------------------------------------------------------------------------------ settings
def test_auto_is_eager_on_cpu_and_off_is_eager():
    for mode in ("auto", "off"):
        m = module(tiny_model("llama", dtype=torch.float32), compile_policy=mode)
        m.configure_model()
        assert m.compile_policy == mode and not is_compiled(m.policy)


def test_on_is_refused_under_fsdp2_and_auto_stays_eager_there(pair):
    with pytest.raises(ValueError, match=rf"{SETTING}='on', but the policy is sharded by FSDP2"):
        resolve_compile("on", pair[0], torch.device("cpu"), sharded=True, setting=SETTING)
    for device in ("cpu", "cuda"):
        assert not resolve_compile("auto", pair[0], torch.device(device), sharded=True, setting=SETTING)


def test_on_is_refused_for_a_head_that_cannot_be_fused():
    m = module(tiny_gpt2(), compile_policy="on")
    with pytest.raises(ValueError, match=rf"{SETTING}='on', but only the decoder under the fused head .*GPT2LMHead"):
        m.configure_model()


@pytest.mark.parametrize("value", ["yes", True, None])
def test_a_bad_compile_policy_setting_names_it(value):
    with pytest.raises(ValueError, match=rf"{SETTING}=.* is not known; allowed: 'auto'"):
        OffPolicyRLModule(model=tiny_model("llama"), tokenizer=TOKENIZER, compile_policy=value)
