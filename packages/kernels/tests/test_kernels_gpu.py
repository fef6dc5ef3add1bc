"""The Triton kernels compiled on a CUDA device (not interpreted) against a float64 reference.

Selected with `pytest -m gpu`; skipped where no CUDA device is visible (CI, this CPU).
"""

import importlib.util

import pytest
import torch

from tephra.kernels import linear_logprob_entropy, naive_logprob_entropy, resolve_method
from tephra.kernels.logprob_entropy import triton_is_faster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def _outputs(fn, h, w, g_lp, g_ent):
    lp, ent = fn(h, w)
    grads = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), [h, w])
    return (lp, ent, *grads)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach()).norm() / want.detach().norm())


@pytest.mark.parametrize(
    "dtype, tokens, hidden, vocab, temperature, bound",
    [
        # fp32 inputs use IEEE dots: fp32 accuracy. bf16 inputs: the result is compared with the
        # float64 math on the same bf16 values, so only the final roundings remain.
        (torch.float32, 300, 256, 151936, 0.7, 1e-5),
        (torch.float32, 257, 96, 5003, 1.0, 1e-5),
        (torch.bfloat16, 300, 256, 151936, 1.3, 1e-2),
    ],
)
def test_compiled_triton_matches_float64(dtype, tokens, hidden, vocab, temperature, bound):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(tokens)
    h = torch.randn(tokens, hidden, device=dev, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, generator=gen) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=dev, generator=gen)
    y[::5] = -100
    g_lp = torch.randn(tokens, device=dev, generator=gen)
    g_ent = torch.randn(tokens, device=dev, generator=gen)
    triton = lambda a, b: linear_logprob_entropy(a, b, y, temperature, method="triton")  # noqa: E731
    got = _outputs(triton, h, w, g_lp, g_ent)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = _outputs(lambda a, b: _naive64(a, b, y, temperature), h64, w64, g_lp, g_ent)
    assert torch.all(got[0][y == -100] == 0)
    for what, a, b in zip(["logp", "entropy", "grad_h", "grad_w"], got, want):
        assert a.device.type == "cuda" and torch.isfinite(a).all(), what
        assert _rel_err(a, b) < bound, (what, _rel_err(a, b))


def _naive64(h, w, y, temperature):
    logits = (h @ w.T) / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    valid = y != -100
    picked = log_p.gather(-1, torch.where(valid, y, 0)[:, None])[:, 0]
    return torch.where(valid, picked, 0.0), -(log_p.exp() * log_p).sum(-1)


def test_compiled_triton_matches_naive_in_fp32_and_frozen_weight():
    """fp32, element by element against the fp32 naive path, and compute_entropy=False with a
    frozen weight (only the hidden gradient runs)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(129, 64, device=dev, generator=gen, requires_grad=True)
    w = torch.randn(1000, 64, device=dev, generator=gen) * 0.5
    y = torch.randint(0, 1000, (129,), device=dev, generator=gen)
    lp, _ = linear_logprob_entropy(h, w, y, 0.9, compute_entropy=False, method="triton")
    ref_lp, _ = naive_logprob_entropy(h, w, y, 0.9, compute_entropy=False)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        torch.autograd.grad(lp.sum(), h)[0],
        torch.autograd.grad(ref_lp.sum(), h)[0],
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("method", ["triton", "chunked"])
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
def test_sum_pi_squared_on_cuda_matches_float64(method, dtype, bound):
    """sum_v p_v^2 from the compiled kernels' online pass (and the chunked path on CUDA) at a
    152k vocabulary, against the float64 softmax of the same (possibly bf16) inputs."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    h = torch.randn(300, 256, device=dev, generator=gen).to(dtype)
    w = (torch.randn(151936, 256, device=dev, generator=gen) * 0.3).to(dtype)
    y = torch.randint(0, 151936, (300,), device=dev, generator=gen)
    _, _, q = linear_logprob_entropy(h, w, y, 0.8, method=method, compute_sum_pi_squared=True)
    want = torch.softmax((h.double() @ w.double().T) / 0.8, -1).pow(2).sum(-1)
    assert _rel_err(q, want) < bound, _rel_err(q, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_takes_the_choice_timed_once_on_this_device(dtype):
    """auto picks triton exactly where the recorded timing says it beat chunked; the answer is
    the same on a second asking (recorded, not re-timed)."""
    dev = torch.device("cuda")
    choice = triton_is_faster(dev, dtype)
    assert isinstance(choice, bool)
    triton_is_faster.cache_clear()  # the next answer comes from the record on disk
    assert triton_is_faster(dev, dtype) == choice
    assert resolve_method("auto", dev, dtype) == ("triton" if choice else "chunked")
    assert resolve_method("auto", dev) == "chunked"  # no dtype: the untimed default
    print(f"auto on {torch.cuda.get_device_name(dev)} {dtype}: {'triton' if choice else 'chunked'}")


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_compiled_triton_applies_a_head_transform(dtype, bound):
    """Gemma 2's cap (on logits of about +-40), Cohere-like scales, a bias and a vocabulary
    cut, compiled, against transformers' way of writing the head in float64 autograd."""
    from tephra.kernels import HeadTransform
    from tephra.kernels.testing import transformed_head_reference

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    tokens, hidden, vocab = 300, 256, 50000
    h = torch.randn(tokens, hidden, device=dev, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, generator=gen) * 2.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, device=dev, generator=gen).to(dtype).requires_grad_()
    y = torch.randint(0, 49000, (tokens,), device=dev, generator=gen)
    y[::5] = -100
    g_lp = torch.randn(tokens, device=dev, generator=gen)
    g_ent = torch.randn(tokens, device=dev, generator=gen)
    kw = dict(hidden_scale=0.5, logit_scale=1.5, softcap=30.0, vocab_size=49000)
    lp, ent = linear_logprob_entropy(
        h, w, y, 0.9, method="triton", head=HeadTransform(bias=b, **kw)
    )
    got = (lp, ent, *torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), [h, w, b]))
    p64 = [t.detach().double().requires_grad_() for t in (h, w, b)]
    rlp, rent = transformed_head_reference(p64[0], p64[1], y, 0.9, HeadTransform(bias=p64[2], **kw))
    want = (rlp, rent, *torch.autograd.grad((rlp * g_lp + rent * g_ent).sum(), p64))
    for what, a, r in zip(["logp", "entropy", "grad_h", "grad_w", "grad_b"], got, want):
        assert a.device.type == "cuda" and torch.isfinite(a).all(), what
        assert _rel_err(a, r) < bound, (what, _rel_err(a, r))
