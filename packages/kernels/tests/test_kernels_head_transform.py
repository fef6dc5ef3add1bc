"""A transformed output head (scales, soft-cap, bias, vocabulary cut) in the naive and chunked
methods against transformers' way of writing it in plain autograd (`transformed_head_reference`):
log-probs, entropy and the gradients of hidden, weight and bias. The Triton method's check is
in test_kernels_triton.py, the vocab-parallel one in test_kernels_vocab_parallel.py."""

import pytest
import torch

from tephra.kernels import HeadTransform, KernelInputError, linear_logprob_entropy
from tephra.kernels.testing import transformed_head_reference

TOKENS, HIDDEN, VOCAB = 29, 24, 83

HEADS = {
    # Gemma 2: cap 30 on logits of about +-40 here, so tanh saturates and its slope matters
    "softcap": dict(softcap=30.0),
    "tight_softcap": dict(softcap=2.0),
    "cohere_logit_scale": dict(logit_scale=0.0625),
    "granite_logits_scaling": dict(logit_scale=1 / 16),
    "minicpm3_hidden_scale": dict(hidden_scale=0.1),
    "bias": dict(bias=True),
    "inkling_mup_and_cut": dict(hidden_scale=1 / 24, vocab_size=77),
    "everything": dict(hidden_scale=0.5, logit_scale=1.5, softcap=3.0, bias=True, vocab_size=80),
}


def problem(head_kwargs, seed=0, weight_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, HIDDEN, generator=gen).requires_grad_()
    w = (torch.randn(VOCAB, HIDDEN, generator=gen) * weight_scale).requires_grad_()
    b = torch.randn(VOCAB, generator=gen).requires_grad_()
    labels = torch.randint(0, head_kwargs.get("vocab_size", VOCAB), (TOKENS,), generator=gen)
    labels[::4] = -100
    g_lp, g_ent = torch.randn(TOKENS, generator=gen), torch.randn(TOKENS, generator=gen)
    kwargs = dict(head_kwargs)
    with_bias = kwargs.pop("bias", False)
    head = HeadTransform(bias=b if with_bias else None, **kwargs)
    params = [h, w, b] if with_bias else [h, w]
    return h, w, labels, g_lp, g_ent, head, params


def results(lp, ent, g_lp, g_ent, params):
    return [lp, ent, *torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), params)]


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("naive", {}),
        ("chunked", {"chunk_size": 7, "keep_logits_bytes": 0}),  # logits recomputed
        ("chunked", {"chunk_size": 29}),  # forward's log-probs kept for backward
    ],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_transformed_head_matches_autograd_reference(name, method, extra, temperature):
    weight_scale = 8.0 if name == "softcap" else 0.5
    h, w, labels, g_lp, g_ent, head, params = problem(HEADS[name], weight_scale=weight_scale)
    ref = results(*transformed_head_reference(h, w, labels, temperature, head), g_lp, g_ent, params)
    lp, ent = linear_logprob_entropy(h, w, labels, temperature, method=method, head=head, **extra)
    got = results(lp, ent, g_lp, g_ent, params)
    names = ["log_probs", "entropy", "grad_hidden", "grad_weight", "grad_bias"]
    for what, a, b in zip(names, got, ref):
        # relative to the size: the soft-cap case's logits are about 40
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"{name} {what}")
    if head.vocab_size is not None:  # rows past the cut are no logits: no gradient
        assert torch.all(got[3][head.vocab_size :] == 0)


def test_softcap_bounds_the_logits_by_hand():
    # one token, two words: W h = (100, 0) with cap 1 -> z = (tanh 100, 0) = (1, 0), so
    # log p(word 0) = 1 - log(e + 1) and its gradient by hand is (1 - p0) (1 - tanh^2(100)) = 0
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[100.0], [0.0]], requires_grad=True)
    y = torch.tensor([0])
    for method in ("naive", "chunked"):
        lp, _ = linear_logprob_entropy(h, w, y, method=method, head=HeadTransform(softcap=1.0))
        assert lp.item() == pytest.approx(1 - torch.log1p(torch.tensor(1.0).exp()).item(), 1e-6)
        (gh,) = torch.autograd.grad(lp.sum(), [h])
        assert abs(gh.item()) < 1e-6
        # without the cap the same head gives log p(word 0) = -log(1 + e^-100) ~ 0, gradient
        # (1 - p0) * 100 ~ 0 too, but at W h = (1, 0) the cap's slope shows: tanh'(1) = 0.42
        w2 = torch.tensor([[1.0], [0.0]], requires_grad=True)
        lp2, _ = linear_logprob_entropy(h, w2, y, method=method, head=HeadTransform(softcap=1.0))
        (gh2,) = torch.autograd.grad(lp2.sum(), [h])
        t = torch.tanh(torch.tensor(1.0))
        p0 = t.exp() / (t.exp() + 1)
        assert gh2.item() == pytest.approx(((1 - p0) * (1 - t * t)).item(), rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(softcap=0.0), r"HeadTransform.softcap=0.0"),
        (dict(softcap=float("inf")), r"HeadTransform.softcap=inf"),
        (dict(logit_scale=-1.0), r"HeadTransform.logit_scale=-1.0"),
        (dict(hidden_scale=0), r"HeadTransform.hidden_scale=0"),
        (dict(vocab_size=0), r"HeadTransform.vocab_size=0"),
        (dict(bias=torch.zeros(2, 2)), r"HeadTransform.bias must be a 1-D tensor"),
    ],
)
def test_bad_head_values_name_the_field(kwargs, match):
    with pytest.raises(KernelInputError, match=match):
        HeadTransform(**kwargs)


def test_head_that_does_not_fit_the_weight():
    h, w, labels, *_ = problem({})
    with pytest.raises(KernelInputError, match="bias has 5 entries but weight has 83 rows"):
        linear_logprob_entropy(h, w, labels, head=HeadTransform(bias=torch.zeros(5)))
    with pytest.raises(KernelInputError, match="bias is torch.float64"):
        bias = torch.zeros(VOCAB, dtype=torch.float64)
        linear_logprob_entropy(h, w, labels, head=HeadTransform(bias=bias))
    with pytest.raises(KernelInputError, match="vocab_size=90 exceeds the 83 rows"):
        linear_logprob_entropy(h, w, labels, head=HeadTransform(vocab_size=90))
    with pytest.raises(KernelInputError, match="labels holds 80, outside"):
        y = torch.full_like(labels, 80)
        linear_logprob_entropy(h, w, y, head=HeadTransform(vocab_size=80))
    with pytest.raises(KernelInputError, match="expected a tephra.kernels.HeadTransform"):
        linear_logprob_entropy(h, w, labels, head=30.0)  # type: ignore[arg-type]
