"""The chunked torch path and the dispatcher against the naive full-logits reference."""

import math

import pytest
import torch

from tephra.kernels import (
    METHOD_ENV_VAR,
    KernelInputError,
    chunked_logprob_entropy,
    linear_logprob_entropy,
    naive_logprob_entropy,
    resolve_method,
)


def make_problem(tokens=37, hidden=24, vocab=101, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::4] = -100  # ignored positions
    g_lp = torch.randn(tokens, generator=gen)
    g_ent = torch.randn(tokens, generator=gen)
    return h, w, labels, g_lp, g_ent


def outputs_and_grads(fn, h, w, labels, g_lp, g_ent, **kwargs):
    lp, ent = fn(h, w, labels, **kwargs)
    gh, gw = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), [h, w])
    return lp, ent, gh, gw


@pytest.mark.parametrize("chunk_size", [None, 5, 37, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_chunked_equals_naive_fp32(chunk_size, temperature):
    h, w, labels, g_lp, g_ent = make_problem()
    got = outputs_and_grads(
        chunked_logprob_entropy,
        h,
        w,
        labels,
        g_lp,
        g_ent,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    ref = outputs_and_grads(
        naive_logprob_entropy, h, w, labels, g_lp, g_ent, temperature=temperature
    )
    for name, a, b in zip(["logprob", "entropy", "grad_hidden", "grad_weight"], got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    ignored = labels == -100
    assert torch.all(got[0][ignored] == 0)
    assert torch.all(got[1][ignored] > 0)  # entropy is computed at ignored positions too


@pytest.mark.parametrize("entropy", [True, False])
def test_kept_log_probs_give_the_recomputed_gradients(entropy):
    """Keeping log p from forward to backward (the default for small problems) gives the
    gradients of recomputing them (keep_logits_bytes=0) to float rounding, also across a
    second backward of a retained graph, which recomputes."""
    h, w, labels, g_lp, g_ent = make_problem()
    g_ent = g_ent if entropy else torch.zeros_like(g_ent)
    kw = dict(temperature=0.7, chunk_size=8, compute_entropy=entropy)
    ref = outputs_and_grads(
        chunked_logprob_entropy, h, w, labels, g_lp, g_ent, keep_logits_bytes=0, **kw
    )
    lp, ent = chunked_logprob_entropy(h, w, labels, **kw)
    loss = (lp * g_lp + ent * g_ent).sum()
    first = torch.autograd.grad(loss, [h, w], retain_graph=True)
    second = torch.autograd.grad(loss, [h, w])
    for got in (first, second):
        torch.testing.assert_close(got[0], ref[2], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], ref[3], atol=1e-6, rtol=0)
    torch.testing.assert_close(lp, ref[0], atol=0, rtol=0)


def test_ignored_positions_get_no_logprob_gradient():
    h, w, labels, _, _ = make_problem()
    lp, _ = linear_logprob_entropy(h, w, labels, 0.8, chunk_size=8)
    (gh,) = torch.autograd.grad(lp.sum(), [h])
    ignored = labels == -100
    assert torch.all(gh[ignored] == 0) and gh[~ignored].abs().sum() > 0


def test_bf16_close_to_naive_on_same_inputs():
    h, w, labels, g_lp, g_ent = make_problem(dtype=torch.bfloat16)
    got = outputs_and_grads(
        linear_logprob_entropy, h, w, labels, g_lp, g_ent, temperature=0.7, chunk_size=8
    )
    ref = outputs_and_grads(naive_logprob_entropy, h, w, labels, g_lp, g_ent, temperature=0.7)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=0)  # fp32 math on bf16 inputs
    torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=0)
    # gradients differ only by the final rounding to bf16 (8 bits of mantissa)
    torch.testing.assert_close(got[2].float(), ref[2].float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got[3].float(), ref[3].float(), atol=2e-2, rtol=1e-2)


def test_leading_dims_no_entropy_and_frozen_weight():
    h, w, labels, g_lp, _ = make_problem(tokens=24)
    w = w.detach()  # a frozen lm head: only hidden needs a gradient
    lp, ent = linear_logprob_entropy(
        h.view(4, 6, -1), w, labels.view(4, 6), 1.3, compute_entropy=False, chunk_size=7
    )
    assert ent is None and lp.shape == (4, 6)
    (gh,) = torch.autograd.grad((lp.reshape(-1) * g_lp).sum(), [h])
    ref_lp, _ = naive_logprob_entropy(h, w, labels, 1.3, compute_entropy=False)
    (ref_gh,) = torch.autograd.grad((ref_lp * g_lp).sum(), [h])
    torch.testing.assert_close(lp.reshape(-1), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5, rtol=0)


def test_dispatcher_choice_env_override_and_errors(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(METHOD_ENV_VAR, raising=False)
    assert resolve_method("auto", cpu) == "chunked"
    monkeypatch.setenv(METHOD_ENV_VAR, "naive")
    assert resolve_method("auto", cpu) == "naive"
    assert resolve_method("chunked", cpu) == "chunked"  # an explicit argument wins
    monkeypatch.setenv(METHOD_ENV_VAR, "fused")
    with pytest.raises(KernelInputError, match=f"{METHOD_ENV_VAR}='fused'.*chunked"):
        resolve_method("auto", cpu)
    monkeypatch.delenv(METHOD_ENV_VAR)
    with pytest.raises(KernelInputError, match="method='fast'"):
        resolve_method("fast", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelInputError, match="CUDA tensors.*TRITON_INTERPRET"):
        resolve_method("triton", cpu)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda h, w, y: (h, w.T, y), "weight has hidden size"),
        (lambda h, w, y: (h, w.double(), y), "weight dtype torch.float64 differs"),
        (lambda h, w, y: (h, w, y[:-1]), "labels has shape"),
        (lambda h, w, y: (h, w, y.float()), "labels has dtype"),
        (lambda h, w, y: (h, w, torch.where(y == -100, 101, y)), "labels holds 101"),
        (lambda h, w, y: (h, w[0], y), r"weight has shape \(24,\)"),
    ],
)
def test_bad_inputs_name_the_argument(change, match):
    h, w, labels, _, _ = make_problem()
    with pytest.raises(KernelInputError, match=match):
        linear_logprob_entropy(*change(h.detach(), w.detach(), labels))


def test_bad_scalars():
    h, w, labels, _, _ = make_problem()
    with pytest.raises(KernelInputError, match="temperature=0"):
        linear_logprob_entropy(h, w, labels, 0)
    with pytest.raises(KernelInputError, match="chunk_size=0"):
        linear_logprob_entropy(h, w, labels, chunk_size=0)


def test_empty_batch():
    h, w, labels, _, _ = make_problem()
    lp, ent = linear_logprob_entropy(h[:0], w, labels[:0], 0.9)
    assert lp.shape == ent.shape == (0,)
    gh, gw = torch.autograd.grad((lp.sum() + ent.sum()), [h, w])
    assert torch.all(gh == 0) and torch.all(gw == 0)


def naive_sum_pi_squared_f64(h, w, temperature):
    """sum_v softmax(z)_v^2 written out in float64, row by row (the independent reference)."""
    z = (h.detach().double() @ w.detach().double().T) / temperature
    out = []
    for row in z:
        e = [float(x) for x in (row - row.max()).exp()]
        total = sum(e)
        out.append(sum((x / total) ** 2 for x in e))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("method", ["naive", "chunked"])
@pytest.mark.parametrize("chunk_size", [None, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sum_pi_squared_matches_float64_softmax(method, chunk_size, temperature):
    """sum_pi_squared comes from the same pass, changes no other output or gradient, has no
    gradient itself, and is computed at ignored positions too."""
    h, w, labels, g_lp, g_ent = make_problem()
    lp, ent, q = linear_logprob_entropy(
        h,
        w,
        labels,
        temperature,
        method=method,
        chunk_size=chunk_size,
        compute_sum_pi_squared=True,
    )
    assert q.dtype == torch.float32 and q.shape == labels.shape and not q.requires_grad
    ref_q = naive_sum_pi_squared_f64(h, w, temperature)
    torch.testing.assert_close(q.double(), ref_q, atol=1e-6, rtol=1e-5)
    lp0, ent0 = linear_logprob_entropy(
        h, w, labels, temperature, method=method, chunk_size=chunk_size
    )
    torch.testing.assert_close(lp, lp0, atol=0, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=0, rtol=0)
    got = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), [h, w])
    ref = torch.autograd.grad((lp0 * g_lp + ent0 * g_ent).sum(), [h, w])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # without entropy, and over leading dims: [3, 4] tokens
    _, none, q2 = linear_logprob_entropy(
        h[:12].reshape(3, 4, -1),
        w,
        labels[:12].reshape(3, 4),
        temperature,
        method=method,
        compute_entropy=False,
        compute_sum_pi_squared=True,
    )
    assert none is None and q2.shape == (3, 4)
    torch.testing.assert_close(q2.reshape(-1).double(), ref_q[:12], atol=1e-6, rtol=1e-5)


def test_sum_pi_squared_by_hand():
    """Two logits [0, log 3] -> p = (1/4, 3/4), sum p^2 = 1/16 + 9/16 = 0.625."""
    h = torch.tensor([[1.0]])
    w = torch.tensor([[0.0], [math.log(3.0)]])
    _, _, q = chunked_logprob_entropy(h, w, torch.tensor([1]), compute_sum_pi_squared=True)
    assert abs(q.item() - 0.625) < 1e-6
