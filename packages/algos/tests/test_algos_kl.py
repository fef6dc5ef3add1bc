"""KL estimators vs naive formulas, straight-through gradients, penalty and controllers."""

from __future__ import annotations

import math

import pytest
import torch

from tephra.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    InputError,
    RegistryError,
    apply_kl_penalty,
    kl_penalty,
)
from tephra.algos.testing import random_mask, response_positions

TOL = dict(atol=1e-6, rtol=1e-6)

NAIVE = {
    "k1": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: abs(lp - ref),
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1,
}
ALIASES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "low_var_kl+": "k3+",
    "kl+": "k1+",
    "mse+": "k2+",
}
PER_TOKEN = [n for n in KL_ESTIMATORS.names() if not n.startswith("full")]


def pair(seed, shape=(5, 7)):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(*shape, generator=gen, dtype=torch.float64) * 2
    ref = lp + torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5
    return lp, ref


def test_registered_names():
    assert set(KL_ESTIMATORS.names()) == {
        "k1",
        "abs",
        "k2",
        "k3",
        "full",
        "k1+",
        "abs+",
        "k2+",
        "k3+",
        *ALIASES,
    }


@pytest.mark.parametrize("name", PER_TOKEN)
def test_values_match_naive(name):
    lp, ref = pair(0)
    base = ALIASES.get(name, name).rstrip("+")
    got = kl_penalty(lp, ref, name)
    want = torch.tensor(
        [[NAIVE[base](float(a), float(b)) for a, b in zip(ra, rb)] for ra, rb in zip(lp, ref)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want, **TOL)


def test_hand_values():
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    d = math.log(2.0)
    assert float(kl_penalty(lp, ref, "k1")) == pytest.approx(d)
    assert float(kl_penalty(ref, lp, "abs")) == pytest.approx(d)
    assert float(kl_penalty(lp, ref, "k2")) == pytest.approx(d * d / 2)
    assert float(kl_penalty(lp, ref, "k3")) == pytest.approx(0.5 - 1 + d)  # .25/.5 - 1 + ln 2
    # full: KL([.5, .5] || [.25, .75]) = .5 ln 2 + .5 ln(2/3)
    p = torch.tensor([[[0.5, 0.5]]], dtype=torch.float64).log()
    q = torch.tensor([[[0.25, 0.75]]], dtype=torch.float64).log()
    want = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert float(kl_penalty(p, q, "full")) == pytest.approx(want)


def test_full_matches_naive_and_gradcheck():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(2, 3, 5, generator=gen, dtype=torch.float64), -1)
    got = kl_penalty(torch.log_softmax(logits, -1), ref, "full").detach()
    p = torch.softmax(logits.detach(), -1)
    for b in range(2):
        for t in range(3):
            want = sum(
                float(p[b, t, v]) * (math.log(float(p[b, t, v])) - float(ref[b, t, v]))
                for v in range(5)
            )
            assert float(got[b, t]) == pytest.approx(want, abs=1e-9)
    assert torch.autograd.gradcheck(
        lambda z: kl_penalty(torch.log_softmax(z, -1), ref, "full"), (logits,)
    )


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3"])
def test_base_gradients_by_finite_differences(name):
    lp, ref = pair(2, (3, 4))
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, name), (lp,))


@pytest.mark.parametrize("name", ["k1+", "abs+", "k2+", "k3+"])
def test_straight_through_value_and_gradient(name):
    """Value of the named estimator, gradient of k2: d/d lp = lp - ref, d/d ref = ref - lp."""
    lp, ref = pair(3)
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    out = kl_penalty(lp, ref, name)
    torch.testing.assert_close(
        out.detach(), kl_penalty(lp.detach(), ref.detach(), name.rstrip("+")), **TOL
    )
    w = torch.rand(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g_lp, g_ref = torch.autograd.grad((out * w).sum(), (lp, ref))
    torch.testing.assert_close(g_lp, w * (lp - ref).detach(), **TOL)
    torch.testing.assert_close(g_ref, w * (ref - lp).detach(), **TOL)


def _expected_gradient(name, logits, ref_logp):
    """E_{x ~ pi}[grad_theta k(x)], exactly: sum over the vocabulary weighted by pi."""
    logp = torch.log_softmax(logits, -1)
    k = kl_penalty(logp.unsqueeze(0), ref_logp.unsqueeze(0).expand_as(logp.unsqueeze(0)), name)
    (g,) = torch.autograd.grad((logp.exp().detach() * k[0]).sum(), logits)
    return g


def test_straight_through_gradient_is_unbiased_for_reverse_kl():
    """For a categorical pi_theta, the expected gradient of k1+/k2/k3+/abs+ samples is
    grad KL(pi || pi_ref); plain k3's is grad KL(pi_ref || pi) instead (the pitfall the `+`
    variants fix). Exact, by summing over the vocabulary."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)
    logp = torch.log_softmax(logits, -1)
    (g_reverse,) = torch.autograd.grad(
        (logp.exp() * (logp - ref_logp)).sum(), logits, retain_graph=True
    )
    (g_forward,) = torch.autograd.grad((ref_logp.exp() * (ref_logp - logp)).sum(), logits)
    for name in ["k1+", "abs+", "k2+", "k3+", "k2"]:
        torch.testing.assert_close(_expected_gradient(name, logits, ref_logp), g_reverse, **TOL)
    torch.testing.assert_close(_expected_gradient("k3", logits, ref_logp), g_forward, **TOL)
    assert not torch.allclose(g_forward, g_reverse, atol=1e-3)
    # and the values of k1 and k3 are unbiased: E_pi[k] = KL(pi || pi_ref)
    kl = float((logp.exp() * (logp - ref_logp)).sum().detach())
    for name in ["k1", "k3"]:
        k = kl_penalty(logp.detach()[None], ref_logp[None], name)[0]
        assert float((logp.exp().detach() * k).sum()) == pytest.approx(kl, abs=1e-9)


def test_apply_kl_penalty_matches_naive():
    gen = torch.Generator().manual_seed(6)
    mask = random_mask(gen, 6, 8)
    rewards = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    kl = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    new, metrics = apply_kl_penalty(rewards, mask, kl, 0.1)
    seq_means = []
    for b in range(6):
        pos = response_positions(mask[b])
        for t in range(8):
            want = float(rewards[b, t]) - (0.1 * float(kl[b, t]) if t in pos else 0.0)
            assert float(new[b, t]) == pytest.approx(want)
        seq_means.append(sum(float(kl[b, t]) for t in pos) / len(pos))
    assert metrics["kl_penalty/kl"] == pytest.approx(sum(seq_means) / 6)
    assert metrics["kl_penalty/coef"] == 0.1


def test_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctl.update(current_kl=1.5, n_steps=10)  # error clipped to .2: x (1 + .2 * 10/100)
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=0.9, n_steps=50)  # error -.1: x (1 - .1 * .5)
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.95)
    with pytest.raises(InputError, match="target_kl=0"):
        AdaptiveKLController(0.1, 0, 10)


def test_errors():
    lp, ref = pair(0)
    with pytest.raises(RegistryError, match="did you mean 'low_var_kl'.*registered: "):
        kl_penalty(lp, ref, "low_var")
    with pytest.raises(InputError, match=r"needs \[batch, seq, vocab\]"):
        kl_penalty(lp, ref, "full")
    with pytest.raises(InputError, match="ref_log_probs has shape"):
        kl_penalty(lp, ref[:, :2], "k3")
