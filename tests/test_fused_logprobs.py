"""fused_linear_token_logprobs / the fused-head path of causal_lm_token_logprobs (LoRA on lm_head, tied).

References: a float64 re-derivation of ``log_softmax((h @ W.T + b) / T)[target]`` for the kernel,
and the logits path of ``causal_lm_token_logprobs`` (``fused_head=False``) for whole models.
"""

from __future__ import annotations

import pytest
import torch

from lightning_offpolicy.demo.tiny import tiny_llama_config
from lightning_offpolicy.logprobs import causal_lm_token_logprobs, token_logprobs
from lightning_offpolicy.logprobs.fused import fused_linear_token_logprobs
from lightning_offpolicy.logprobs.head import fused_head_parts


def _inputs(n, h, v, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5 * 3
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    weights = torch.randn(n, generator=g, dtype=torch.float64)  # a non-uniform upstream gradient
    leaf = [t.to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    return leaf, targets, weights


def _naive(hidden, weight, bias, targets, temperature):
    """float64 ``log_softmax(linear / T)[target]`` and entropy: the reference."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    z = torch.log_softmax(logits, -1)
    return z.gather(-1, targets[..., None]).squeeze(-1), -(z.exp() * z).sum(-1)


def _grads(tensors):
    return [t.grad.clone() if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_values_and_gradients_match_float64_reference(dtype, temperature, bias, chunk_size):
    (h, w, b), targets, up = _inputs(37, 24, 50, dtype, bias)
    lp, ent = fused_linear_token_logprobs(h, w, targets, b, temperature, chunk_size, return_entropy=True)
    assert lp.dtype == dtype and lp.shape == (37,) and ent.requires_grad
    # An entropy bonus trains through the entropy: both gradients, against autograd's.
    up_ent = torch.linspace(-1.0, 2.0, 37, dtype=torch.float64)
    (lp.double() * up + ent.double() * up_ent).sum().backward()
    got = _grads((h, w, b))

    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (h, w, b)]
    ref_lp, ref_ent = _naive(*ref, targets, temperature)
    (ref_lp * up + ref_ent * up_ent).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), **tol)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **tol)
    for g, r in zip(got, _grads(ref), strict=True):
        if r is None:
            assert g is None
        else:
            assert g.dtype == dtype
            torch.testing.assert_close(g.double(), r, **tol)
    # Without the entropy: the same logprobs.
    torch.testing.assert_close(fused_linear_token_logprobs(h, w, targets, b, temperature, chunk_size), lp)


def test_gradcheck_float64():
    (h, w, b), targets, _ = _inputs(9, 5, 11, torch.float64, True)
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_linear_token_logprobs(h, w, targets, b, 0.8, chunk_size=4), (h, w, b)
    )


def test_leading_dims_and_frozen_inputs():
    (h, w, _), targets, _ = _inputs(12, 8, 10, torch.float64, False)
    lp = fused_linear_token_logprobs(h.view(3, 4, 8), w.detach(), targets.view(3, 4))
    assert lp.shape == (3, 4)
    lp.sum().backward()  # weight frozen: only grad_hidden is computed
    assert h.grad is not None and h.grad.shape == (12, 8)
    empty = fused_linear_token_logprobs(torch.zeros(0, 8, requires_grad=True), w.float(), targets[:0])
    assert empty.shape == (0,)


def test_bfloat16_within_stated_tolerance():
    """bf16: relative errors against float64 < 1% of the norms and within 1.25x the unfused path's."""
    (h, w, _), targets, up = _inputs(300, 64, 500, torch.bfloat16, False)
    lp = fused_linear_token_logprobs(h, w, targets, chunk_size=64)
    assert lp.dtype == torch.float32
    (lp.double() * up).sum().backward()
    fused = [lp.detach().double()] + [g.double() for g in _grads((h, w))]
    h.grad = w.grad = None

    unfused_lp = token_logprobs(torch.nn.functional.linear(h, w), targets)  # the logits path in bf16
    (unfused_lp.double() * up).sum().backward()
    unfused = [unfused_lp.detach().double()] + [g.double() for g in _grads((h, w))]

    ref = [h.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ref_lp, _ = _naive(*ref, None, targets, 1.0)
    (ref_lp * up).sum().backward()
    exact = [ref_lp.detach()] + _grads(ref)
    for name, f, u, r in zip(("logprobs", "grad_hidden", "grad_weight"), fused, unfused, exact, strict=True):
        err_f = ((f - r).norm() / r.norm()).item()
        err_u = ((u - r).norm() / r.norm()).item()
        # Measured (CPU, float32 products by blocks): logprobs 5e-8, grad_hidden 0.17% (unfused 0.45%),
        # grad_weight 0.29% (unfused 0.48%).
        assert err_f < 1e-2 and err_f <= 1.25 * err_u + 1e-3, (name, err_f, err_u)


def test_nothing_logits_sized_is_saved_for_backward():
    n, hd, v = 40, 16, 96  # N * V = 3840: no other tensor here has as many elements
    (h, w, b), targets, _ = _inputs(n, hd, v, torch.float32, True)
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = fused_linear_token_logprobs(h, w, targets, b, chunk_size=8, return_entropy=True)
    assert saved and all(int(torch.Size(s).numel()) < n * v for s in saved), saved
    # The hook does see the logits when the unfused expression saves them (the check can fail).
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(torch.nn.functional.linear(h, w, b), targets)
    assert (n, v) in saved
    lp.sum().backward()


# --------------------------------------------------------------------------- whole models


def _build(cls_name="LlamaForCausalLM", vocab=97, seed=0, dtype=torch.float64, **overrides):
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, cls_name)(tiny_llama_config(vocab, **overrides))
    return model.to(dtype).eval()


def _padded_batch(vocab=97, seed=3):
    """[left-padded prompt | right-padded response], 4 rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 2, 7, 1)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (4, 6, 1, 3)]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    ids, mask = [], []
    for p, r in zip(prompts, responses, strict=True):
        ids.append([0] * (p_len - len(p)) + p + r + [0] * (r_len - len(r)))
        mask.append([0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_len - len(r)))
    return torch.tensor(ids), torch.tensor(mask), p_len


def _run(model, fused_head, temperature=1.0, chunk_size=5):
    """Values, entropy and every parameter's gradient of one weighted logprob sum."""
    ids, mask, p_len = _padded_batch()
    model.zero_grad(set_to_none=True)
    lp, ent = causal_lm_token_logprobs(
        model, ids, mask, p_len, temperature, chunk_size, return_entropy=True, fused_head=fused_head
    )
    up = torch.linspace(-1.0, 2.0, lp.numel(), dtype=torch.float64).view(lp.shape)
    (lp.double() * up * mask[:, p_len:]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent, grads


def _assert_same(a, b, tol):
    torch.testing.assert_close(a[0], b[0], **tol)
    torch.testing.assert_close(a[1], b[1], **tol)
    assert a[2].keys() == b[2].keys() and a[2]
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_tiny_llama_fused_equals_logits_path(dtype, temperature):
    model = _build(dtype=dtype)
    assert not isinstance(fused_head_parts(model), str)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    fused = _run(model, None, temperature)
    _assert_same(fused, _run(model, False, temperature), tol)
    _assert_same(fused, _run(model, True, temperature), dict(rtol=0, atol=0))
    assert fused[0].shape == (4, 6) and fused[0].dtype == dtype


def test_fused_path_never_calls_lm_head_and_saves_no_logits():
    model = _build(dtype=torch.float32)
    calls = []
    ids, mask, p_len = _padded_batch()
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_lm_token_logprobs(model, ids, mask, p_len)
    # V = 97 is no other size of the model: only the head weight [V, H] may have it.
    assert shapes and all(97 not in s for s in shapes if s != (97, 128)), shapes
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        shapes.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            causal_lm_token_logprobs(model, ids, mask, p_len)  # a hook on the head: logits path
        assert calls == [1] and (4, ids.shape[1] - p_len + 1, 97) in shapes
    finally:
        handle.remove()


def test_qwen2_and_tied_embeddings():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**tiny_llama_config(97).to_dict() | {"tie_word_embeddings": True})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(cfg).double().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's qkv biases
    fused = _run(model, True, 0.9)
    ref = _run(model, False, 0.9)
    # The shared weight gets both uses' gradients, as in the logits path.
    assert "model.embed_tokens.weight" in fused[2]
    _assert_same(fused, ref, dict(rtol=1e-10, atol=1e-12))


def _lora(model, targets, seed=7, **kwargs):
    """peft LoRA on ``targets`` with random (not zero) lora_B, so that the adapters count."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


def _naive_model_path(model, temperature=1.0):
    """The model's own forward (full logits), float64 log_softmax, gather; values and gradients."""
    ids, mask, p_len = _padded_batch()
    model.zero_grad(set_to_none=True)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p_len - 1 : -1]
    lp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids[:, p_len:, None]).squeeze(-1)
    up = torch.linspace(-1.0, 2.0, lp.numel(), dtype=torch.float64).view(lp.shape)
    (lp * up * mask[:, p_len:]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


def _assert_matches_naive(fused, naive, tol):
    torch.testing.assert_close(fused[0].double(), naive[0], **tol)
    assert fused[2].keys() == naive[1].keys() and fused[2]
    for name in naive[1]:
        torch.testing.assert_close(fused[2][name], naive[1][name], **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("train_base_head", [False, True])
def test_lora_on_lm_head_is_fused_and_matches_naive(dtype, train_base_head):
    model = _lora(_build(dtype=dtype), ["q_proj", "lm_head"])
    head = model.get_base_model().lm_head
    assert type(head).__name__ == "Linear" and hasattr(head, "lora_A")  # peft's lora.Linear
    if train_base_head:  # e.g. a full fine-tune with LoRA on top: the base weight gets its gradient too
        head.base_layer.weight.requires_grad_(True)
    parts = fused_head_parts(model)
    assert not isinstance(parts, str) and parts[1] is head
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    fused = _run(model, None, 0.8)
    naive = _naive_model_path(model, 0.8)
    assert any("lm_head" in n and "lora_A" in n for n in naive[1])
    assert any("lm_head" in n and "lora_B" in n for n in naive[1])
    assert any("lm_head.base_layer" in n for n in naive[1]) == train_base_head
    _assert_matches_naive(fused, naive, tol)
    _assert_same(fused, _run(model, False, 0.8), tol)  # and the logits path of causal_lm_token_logprobs


def test_lora_on_lm_head_never_calls_the_head():
    model = _lora(_build(dtype=torch.float32), ["lm_head"])
    head = model.get_base_model().lm_head
    calls = []
    orig = type(head).forward
    try:  # a class-level patch: the instance has no hook, so the fused path is still chosen
        type(head).forward = lambda self, *a, **k: calls.append(1) or orig(self, *a, **k)
        ids, mask, p_len = _padded_batch()
        causal_lm_token_logprobs(model, ids, mask, p_len).sum().backward()
        assert calls == []
        causal_lm_token_logprobs(model, ids, mask, p_len, fused_head=False)
        assert calls == [1]
    finally:
        type(head).forward = orig


def test_two_active_lora_adapters_on_lm_head():
    model = _lora(_build(), ["lm_head"])
    from peft import LoraConfig

    model.add_adapter("second", LoraConfig(r=2, lora_alpha=3, target_modules=["lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.second" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(9))
    model.base_model.set_adapter(["default", "second"])  # both active (and trainable)
    head = model.get_base_model().lm_head
    assert head.active_adapters == ["default", "second"]
    fused = _run(model, True)
    naive = _naive_model_path(model)
    assert any("lora_B.second" in n for n in naive[1])
    _assert_matches_naive(fused, naive, dict(rtol=1e-10, atol=1e-12))


def test_lora_on_lm_head_merged_disabled_and_dora():
    model = _lora(_build(), ["q_proj", "lm_head"])
    tol = dict(rtol=1e-10, atol=1e-12)
    ids, mask, p_len = _padded_batch()
    with model.disable_adapter(), torch.no_grad():  # the reference model of a LoRA policy
        assert not isinstance(fused_head_parts(model), str)
        off = causal_lm_token_logprobs(model, ids, mask, p_len, fused_head=True)
        torch.testing.assert_close(off, causal_lm_token_logprobs(model, ids, mask, p_len, fused_head=False), **tol)
    on = causal_lm_token_logprobs(model, ids, mask, p_len).detach()
    assert not torch.allclose(off, on)
    model.merge_adapter()  # the base weights now hold B A * scaling: the fused head uses them alone
    assert model.get_base_model().lm_head.merged and not isinstance(fused_head_parts(model), str)
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_token_logprobs(model, ids, mask, p_len, fused_head=True), on, **tol)
        with model.disable_adapter():  # peft's forward would unmerge first: left to it
            reason = fused_head_parts(model)
            assert isinstance(reason, str) and "merged but disabled" in reason
    model.unmerge_adapter()

    dora = _lora(_build(), ["q_proj", "lm_head"], use_dora=True)
    reason = fused_head_parts(dora)
    assert isinstance(reason, str) and "variant" in reason and "DoRA" in reason
    with pytest.raises(ValueError, match="cannot be fused"):
        _run(dora, True)
    _assert_matches_naive(_run(dora, None), _naive_model_path(dora), tol)  # falls back, same values


def test_low_rank_terms_match_float64_reference():
    (h, w, b), targets, up = _inputs(23, 12, 40, torch.float32, True)
    g = torch.Generator().manual_seed(5)
    terms = [
        (torch.randn(23, 3, generator=g, requires_grad=True), torch.randn(40, 3, generator=g, requires_grad=True), 0.5),
        (torch.randn(23, 2, generator=g, requires_grad=True), torch.randn(40, 2, generator=g, requires_grad=True), 2.0),
    ]
    lp = fused_linear_token_logprobs(h, w, targets, b, 0.9, chunk_size=4, low_rank=terms)
    (lp.double() * up).sum().backward()
    leaves = [h, w, b] + [t for u, bk, _ in terms for t in (u, bk)]
    got = _grads(leaves)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    logits = torch.nn.functional.linear(ref[0], ref[1], ref[2])
    logits = logits + 0.5 * ref[3] @ ref[4].T + 2.0 * ref[5] @ ref[6].T
    ref_lp = torch.log_softmax(logits / 0.9, -1).gather(-1, targets[:, None]).squeeze(-1)
    (ref_lp * up).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    for name, x, r in zip("h w b u0 B0 u1 B1".split(), got, _grads(ref), strict=True):
        torch.testing.assert_close(x.double(), r, rtol=1e-5, atol=1e-5, msg=name)

    u64 = [t.detach().double().requires_grad_() for t in leaves]
    assert torch.autograd.gradcheck(
        lambda h, w, u, bk: fused_linear_token_logprobs(h, w, targets, None, 0.8, 5, low_rank=[(u, bk, 1.5)]),
        (u64[0], u64[1], u64[3], u64[4]),
    )
    with pytest.raises(ValueError, match="B must have shape"):
        fused_linear_token_logprobs(h, w, targets, low_rank=[(terms[0][0], terms[0][1][:5], 1.0)])
    with pytest.raises(ValueError, match="u must have shape"):
        fused_linear_token_logprobs(h, w, targets, low_rank=[(terms[0][0][:5], terms[0][1], 1.0)])
    with pytest.raises(TypeError, match="scale"):
        fused_linear_token_logprobs(h, w, targets, low_rank=[(terms[0][0], terms[0][1], float("nan"))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_embeddings_llama(dtype):
    model = _build(vocab=97, dtype=dtype, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not isinstance(fused_head_parts(model), str)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    fused = _run(model, None)
    # The shared weight's gradient is the lookup's plus the head's, as in the logits path.
    assert "model.embed_tokens.weight" in fused[2] and "lm_head.weight" not in fused[2]
    _assert_same(fused, _run(model, False), tol)
    _assert_matches_naive(fused, _naive_model_path(model), tol)


def test_lora_on_attention_uses_fused_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_build(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(8))
    assert not isinstance(fused_head_parts(model), str)
    fused = _run(model, True)
    assert any("lora_A" in n for n in fused[2]) and not any("lm_head" in n for n in fused[2])
    _assert_same(fused, _run(model, False), dict(rtol=1e-10, atol=1e-12))
    ids, mask, p_len = _padded_batch()
    with model.disable_adapter(), torch.no_grad():  # the reference model of a LoRA policy (frozen)
        disabled = causal_lm_token_logprobs(model, ids, mask, p_len, fused_head=True)
        ref = causal_lm_token_logprobs(model, ids, mask, p_len, fused_head=False)
    torch.testing.assert_close(disabled, ref, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(disabled, fused[0])  # the adapters were off indeed


def test_softcapped_logits_fall_back():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**tiny_llama_config(97).to_dict() | {"final_logit_softcapping": 3.0})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = Gemma2ForCausalLM(cfg).double().eval()
    reason = fused_head_parts(model)
    assert isinstance(reason, str) and "final_logit_softcapping" in reason
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        _run(model, True)
    lp = _run(model, None)[0]
    ids, mask, p_len = _padded_batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p_len - 1 : -1]
    assert logits.abs().max() <= 3.0  # soft-capped indeed
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, p_len:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=1e-10, atol=1e-12)


def test_unknown_class_needs_force():
    from transformers import LlamaForCausalLM

    class MyLM(LlamaForCausalLM):  # could do anything after lm_head
        pass

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MyLM(tiny_llama_config(97)).double().eval()
    assert "FUSED_HEAD_ARCHITECTURES" in fused_head_parts(model)
    assert not isinstance(fused_head_parts(model, force=True), str)
    _assert_same(_run(model, True), _run(model, None), dict(rtol=1e-10, atol=1e-12))


def test_bad_arguments():
    (h, w, b), targets, _ = _inputs(6, 4, 9, torch.float32, True)
    with pytest.raises(ValueError, match="hidden must have shape"):
        fused_linear_token_logprobs(h[:, :3], w, targets)
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_linear_token_logprobs(h, w[0], targets)
    with pytest.raises(ValueError, match="bias"):
        fused_linear_token_logprobs(h, w, targets, b[:3])
    with pytest.raises(ValueError, match="share a dtype"):
        fused_linear_token_logprobs(h, w.double(), targets)
    with pytest.raises(ValueError, match="targets must lie"):
        fused_linear_token_logprobs(h, w, torch.full_like(targets, 9))
    with pytest.raises(ValueError, match="targets shape"):
        fused_linear_token_logprobs(h, w, targets[:3])
    with pytest.raises(TypeError, match="hidden"):
        fused_linear_token_logprobs(h.long(), w, targets)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_token_logprobs(h, w, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_token_logprobs(h, w, targets, chunk_size=0)
    ids = torch.randint(0, 97, (2, 6))
    with pytest.raises(TypeError, match="fused_head"):
        causal_lm_token_logprobs(_build(), ids, torch.ones_like(ids), 2, fused_head="yes")


@pytest.mark.parametrize("lora_targets", [None, ["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_trainer_step_takes_the_fused_head_by_default(monkeypatch, lora_targets):
    """OffPolicyRLModule -> step.response_logprobs -> causal_lm_token_logprobs: fused, no logits."""
    from functools import partial

    from transformers import LlamaForCausalLM

    import lightning_offpolicy.logprobs.head as fl
    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from tests.module_helpers import TOKENIZER, fit_on, make_rollout, tiny_model

    model = tiny_model()
    rollout = make_rollout(model, seed=1, rows=4)
    lora = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=lora_targets) if lora_targets else {}
    module = OffPolicyRLModule(
        model=model, tokenizer=TOKENIZER, optimizer=partial(torch.optim.SGD, lr=0.01), gradient_clip_val=None, **lora
    )
    fused_terms, full_forwards = [], []
    real_fused, real_forward = fl.fused_linear_token_logprobs, LlamaForCausalLM.forward

    def counting_fused(*args, **kwargs):
        fused_terms.append(len(kwargs.get("low_rank", ())))
        return real_fused(*args, **kwargs)

    def counting_forward(self, *args, **kwargs):  # the model's own forward: lm_head over all positions
        full_forwards.append(1)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(fl, "fused_linear_token_logprobs", counting_fused)
    monkeypatch.setattr(LlamaForCausalLM, "forward", counting_forward)
    fit_on(module, [rollout], max_steps=1)
    assert fused_terms and not full_forwards
    # LoRA on lm_head: one low-rank term per call; otherwise none.
    assert set(fused_terms) == {1 if lora_targets and "lm_head" in lora_targets else 0}


def test_lora_on_bf16_lm_head_with_float32_adapters():
    """peft keeps the adapters of a bf16 model in float32 (autocast_adapter_dtype): mixed terms work."""
    model = _lora(_build(dtype=torch.bfloat16), ["lm_head"])
    head = model.get_base_model().lm_head
    assert head.base_layer.weight.dtype == torch.bfloat16 and head.lora_B["default"].weight.dtype == torch.float32
    fused = _run(model, True)
    naive = _naive_model_path(model)
    assert fused[0].dtype == torch.float32
    # peft rounds base + adapter output to bf16, the fused head sums them in float32: bf16-level agreement.
    torch.testing.assert_close(fused[0].double(), naive[0], rtol=0, atol=0.01)  # measured 0.0015
    assert fused[2].keys() == naive[1].keys()
    for name in naive[1]:
        ref = naive[1][name].double()
        assert ((fused[2][name].double() - ref).norm() / ref.norm()) < 0.01, name  # measured 0.16%
