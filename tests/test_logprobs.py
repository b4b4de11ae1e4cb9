"""token_logprobs / causal_lm_token_logprobs against float64 references."""

from __future__ import annotations

import pytest
import torch

from lightning_offpolicy.logprobs import causal_lm_token_logprobs, token_logprobs

TEMPERATURES = [1.0, 0.6, 1.7]


def _ref(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """float64 log_softmax + gather and entropy, with autograd."""
    z = logits.double() / temperature
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent


def _inputs(shape, vocab, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 24, 1024])  # N = 24: non-divisors, divisors, > N
def test_values_and_entropy_match_float64(dtype, temperature, chunk_size):
    logits, targets = _inputs((4, 6), 97, dtype)
    lp, ent = token_logprobs(logits, targets, temperature, chunk_size=chunk_size, return_entropy=True)
    ref_lp, ref_ent = _ref(logits, targets, temperature)  # reference on the very same (rounded) logits
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert lp.shape == targets.shape and ent.shape == targets.shape
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=2e-6)
    # Same values with and without the entropy branch.
    lp_only = token_logprobs(logits, targets, temperature, chunk_size=chunk_size)
    torch.testing.assert_close(lp_only, lp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_size", [5, 24, 64])
def test_gradient_matches_float64(dtype, temperature, chunk_size):
    logits, targets = _inputs((4, 6), 97, dtype, seed=1)
    weight = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    (token_logprobs(x, targets, temperature, chunk_size=chunk_size).double() * weight).sum().backward()
    xr = logits.double().requires_grad_(True)
    (_ref(xr, targets, temperature)[0] * weight).sum().backward()
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    if dtype == torch.float32:
        torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    else:  # the gradient is returned in bf16: equal to the float64 gradient rounded to bf16
        torch.testing.assert_close(x.grad, xr.grad.to(dtype), rtol=1.6e-2, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [2, 5])
def test_gradcheck_double(temperature, chunk_size):
    logits, targets = _inputs((2, 3), 11, torch.float64, seed=3, scale=1.0)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, temperature, chunk_size=chunk_size), (logits,))
    out = token_logprobs(logits, targets, temperature, chunk_size=chunk_size)
    assert out.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk_size", [5, 64])
def test_entropy_gradient_matches_float64(dtype, temperature, chunk_size):
    """An entropy bonus trains through the entropy: its gradient (with the logprob's) equals autograd's."""
    logits, targets = _inputs((4, 6), 97, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    w_lp, w_ent = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, targets, temperature, chunk_size=chunk_size, return_entropy=True)
    assert lp.requires_grad and ent.requires_grad
    (lp.double() * w_lp + ent.double() * w_ent).sum().backward()
    xr = logits.double().requires_grad_(True)
    ref_lp, ref_ent = _ref(xr, targets, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    if dtype == torch.float32:
        torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(x.grad, xr.grad.to(dtype), rtol=1.6e-2, atol=1e-6)
    # The entropy alone, and the logprob alone (entropy unused: no gradient from it).
    for use_lp, use_ent in ((False, True), (True, False)):
        x.grad = xr.grad = None
        lp, ent = token_logprobs(x, targets, temperature, chunk_size=chunk_size, return_entropy=True)
        ref_lp, ref_ent = _ref(xr, targets, temperature)
        sum((t.double() * w).sum() for t, w, on in ((lp, w_lp, use_lp), (ent, w_ent, use_ent)) if on).backward()
        sum((t * w).sum() for t, w, on in ((ref_lp, w_lp, use_lp), (ref_ent, w_ent, use_ent)) if on).backward()
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), xr.grad.to(dtype).double(), **tol)


def test_no_double_backward():
    logits, targets = _inputs((3, 4), 13, torch.float32)
    logits.requires_grad_(True)
    lp = token_logprobs(logits, targets)
    (grad,) = torch.autograd.grad(lp.sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(grad.sum(), logits)


def test_extreme_logits_and_shapes():
    logits = torch.tensor([[0.0, -1e4, 1e4, 3.0], [-1e30, 0.0, 0.0, -1e30]])
    targets = torch.tensor([2, 1])
    lp, ent = token_logprobs(logits, targets, return_entropy=True)
    ref_lp, ref_ent = _ref(logits, targets, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp)
    torch.testing.assert_close(ent.double(), ref_ent)
    # 1-D logits ([V]) with a 0-d target, and empty batches.
    v = torch.randn(9)
    torch.testing.assert_close(token_logprobs(v, torch.tensor(4)), torch.log_softmax(v, -1)[4])
    empty = token_logprobs(torch.randn(0, 5, 9, requires_grad=True), torch.zeros(0, 5, dtype=torch.long))
    assert empty.shape == (0, 5)
    # Non-contiguous logits are accepted (copied by reshape) and give the same values.
    base, tg = _inputs((3, 5), 10, torch.float32)
    nc = base.transpose(0, 1)
    torch.testing.assert_close(token_logprobs(nc, tg.t()), _ref(nc, tg.t(), 1.0)[0].float())


def test_bad_arguments():
    logits, targets = _inputs((2, 3), 7, torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=float("inf"))
    with pytest.raises(TypeError, match="temperature"):
        token_logprobs(logits, targets, temperature="1")
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(logits, targets, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        token_logprobs(logits, targets, chunk_size=1.5)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(logits, targets[:, :2])
    with pytest.raises(TypeError, match="targets"):
        token_logprobs(logits, targets.float())
    with pytest.raises(ValueError, match="targets must lie"):
        token_logprobs(logits, torch.full_like(targets, 7))
    with pytest.raises(ValueError, match="targets must lie"):
        token_logprobs(logits, torch.full_like(targets, -1))
    with pytest.raises(TypeError, match="logits"):
        token_logprobs(torch.zeros(2, 3, 7, dtype=torch.long), targets)


# --------------------------------------------------------------------------- causal LM


@pytest.fixture(scope="module")
def tiny_llama():
    from lightning_offpolicy.demo.tiny import build_tiny_llama

    return build_tiny_llama(vocab_size=64, seed=0).eval()


def _padded_batch(prompts, responses, pad_id=0):
    """[left-padded prompt | right-padded response] layout."""
    p_len = max(len(p) for p in prompts)
    r_len = max(len(r) for r in responses)
    ids, mask = [], []
    for p, r in zip(prompts, responses, strict=True):
        ids.append([pad_id] * (p_len - len(p)) + p + r + [pad_id] * (r_len - len(r)))
        mask.append([0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_len - len(r)))
    return torch.tensor(ids), torch.tensor(mask), p_len


def _unpadded_reference(model, prompt, response, temperature):
    """Teacher-forced logprobs of ``response`` with the row run alone, no padding, full logits."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()[0]
    z = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    lp = z[pos, torch.tensor(response)]
    ent = -(z[pos].exp() * z[pos]).sum(-1)
    return lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_causal_lm_matches_unpadded_rows(tiny_llama, temperature):
    g = torch.Generator().manual_seed(5)

    def rand(n):
        return torch.randint(1, 64, (n,), generator=g).tolist()

    prompts = [rand(5), rand(2), rand(7), rand(1)]
    responses = [rand(4), rand(6), rand(1), rand(3)]
    ids, mask, p_len = _padded_batch(prompts, responses)
    with torch.no_grad():
        lp, ent = causal_lm_token_logprobs(
            tiny_llama, ids, mask, p_len, temperature=temperature, chunk_size=5, return_entropy=True
        )
    assert lp.shape == (4, ids.shape[1] - p_len) and ent.shape == lp.shape
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ref_lp, ref_ent = _unpadded_reference(tiny_llama, p, r, temperature)
        torch.testing.assert_close(lp[b, : len(r)].double(), ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent[b, : len(r)].double(), ref_ent, rtol=0, atol=1e-5)


def test_causal_lm_requests_only_needed_logits_and_grads_flow(tiny_llama):
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 6)]
    responses = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 2)]
    ids, mask, p_len = _padded_batch(prompts, responses)
    seen = {}

    def hook(module, args, output):
        seen["shape"] = tuple(output.shape)

    handle = tiny_llama.lm_head.register_forward_hook(hook)
    try:
        tiny_llama.zero_grad(set_to_none=True)
        lp = causal_lm_token_logprobs(tiny_llama, ids, mask, p_len)
        resp_mask = mask[:, p_len:].float()
        (lp * resp_mask).sum().backward()
    finally:
        handle.remove()
    # lm_head saw only L - response_start + 1 positions.
    assert seen["shape"] == (2, ids.shape[1] - p_len + 1, 64)
    grads = [p.grad for p in tiny_llama.parameters()]
    assert all(gr is not None for gr in grads)
    assert tiny_llama.lm_head.weight.grad.abs().sum() > 0
    assert tiny_llama.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    tiny_llama.zero_grad(set_to_none=True)


def test_causal_lm_bad_arguments(tiny_llama):
    ids = torch.randint(0, 64, (2, 6))
    mask = torch.ones_like(ids)
    for bad in (0, 6, 9, -1):
        with pytest.raises(ValueError, match="response_start"):
            causal_lm_token_logprobs(tiny_llama, ids, mask, bad)
    with pytest.raises(TypeError, match="response_start"):
        causal_lm_token_logprobs(tiny_llama, ids, mask, 2.0)
    with pytest.raises(ValueError, match="attention_mask"):
        causal_lm_token_logprobs(tiny_llama, ids, mask[:, :5], 2)
    with pytest.raises(ValueError, match="input_ids"):
        causal_lm_token_logprobs(tiny_llama, ids[0], mask[0], 2)
    with pytest.raises(ValueError, match="temperature"):
        causal_lm_token_logprobs(tiny_llama, ids, mask, 2, temperature=0)
    with pytest.raises(ValueError, match="chunk_size"):
        causal_lm_token_logprobs(tiny_llama, ids, mask, 2, chunk_size=-3)
