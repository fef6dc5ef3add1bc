"""The Triton kernels under TRITON_INTERPRET=1 against the naive reference, on tiny shapes.

TRITON_INTERPRET must be set before triton defines a kernel, so the check runs in a fresh
interpreter rather than in the pytest process (where other tests may have imported triton).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

CHECK = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
os.environ["TEPHRA_KERNEL_METHOD"] = "triton"
import torch
torch.set_num_threads(1)
from tephra.kernels import linear_logprob_entropy, naive_logprob_entropy, resolve_method
from tephra.kernels import triton_kernels
from tephra.kernels.triton_kernels import triton_logprob_entropy

triton_kernels.ROW_BLOCK = 8  # several loop steps per vocab block, and partial tails

assert resolve_method("auto", torch.device("cpu")) == "triton"
blocks = dict(block_vocab=24)  # several vocab blocks and a partial last one
gen = torch.Generator().manual_seed(0)


def run(fn, h, w, y, g1, g2):
    lp, ent = fn()
    return (lp, ent, *torch.autograd.grad((lp * g1 + ent * g2).sum(), [h, w]))


for dtype, tokens, hidden, vocab, temp in [
    (torch.float32, 16, 32, 64, 1.0),
    (torch.float32, 21, 40, 75, 0.7),
    (torch.bfloat16, 19, 32, 50, 1.3),
]:
    h = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    y[::3] = -100
    g = (h, w, y, torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen))
    ref = run(lambda: naive_logprob_entropy(h, w, y, temp), *g)
    got = run(lambda: triton_logprob_entropy(h, w, y, temp, **blocks), *g)
    if tokens == 16:  # the public entry point, sent to triton by TEPHRA_KERNEL_METHOD
        got_dispatch = run(lambda: linear_logprob_entropy(h, w, y, temp), *g)
        for a, b in zip(got_dispatch, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert torch.all(got[0][y == -100] == 0)
    for what, a, b in zip(["logp", "entropy", "grad_h", "grad_w"], got, ref):
        assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=what)
        elif what.startswith("grad"):  # bf16 gradients differ by their final rounding
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=1e-2, msg=what)
        else:  # fp32 math on bf16 inputs
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=what)

# compute_entropy=False with a frozen weight: only the hidden gradient
h32, w32 = h.detach().float().requires_grad_(), w.detach().float()
lp, _ = triton_logprob_entropy(h32, w32, y, 0.9, compute_entropy=False, **blocks)
ref_lp, _ = naive_logprob_entropy(h32, w32, y, 0.9, compute_entropy=False)
torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
torch.testing.assert_close(torch.autograd.grad(lp.sum(), h32)[0],
                           torch.autograd.grad(ref_lp.sum(), h32)[0], atol=1e-5, rtol=0)
# sum_pi_squared from the same online pass, against a float64 softmax
for temp in (1.0, 0.7):
    lp, ent, q = triton_logprob_entropy(
        h32, w32, y, temp, **blocks, compute_sum_pi_squared=True
    )
    ref_q = torch.softmax((h32.detach().double() @ w32.double().T) / temp, -1).pow(2).sum(-1)
    torch.testing.assert_close(q.double(), ref_q, atol=1e-6, rtol=1e-5)
    ref_lp, ref_ent = naive_logprob_entropy(h32, w32, y, temp)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)

# a transformed head (scales, soft-cap, bias, vocabulary cut) against transformers' way of
# writing it in plain autograd: log-probs, entropy, gradients of hidden, weight and bias
from tephra.kernels import HeadTransform
from tephra.kernels.testing import transformed_head_reference

for kwargs, scale, temp in [
    (dict(softcap=30.0), 8.0, 1.0),  # Gemma 2's cap on logits of about +-40: tanh saturates
    (dict(softcap=2.0, logit_scale=0.0625), 4.0, 0.7),
    (dict(hidden_scale=0.5, logit_scale=1.5, softcap=3.0, bias=True, vocab_size=70), 0.5, 1.2),
    (dict(bias=True, hidden_scale=0.1), 0.5, 1.0),
]:
    h = torch.randn(21, 40, generator=gen).requires_grad_()
    w = (torch.randn(75, 40, generator=gen) * scale).requires_grad_()
    b = torch.randn(75, generator=gen).requires_grad_()
    y = torch.randint(0, kwargs.get("vocab_size", 75), (21,), generator=gen)
    y[::3] = -100
    with_bias = kwargs.pop("bias", False)
    head = HeadTransform(bias=b if with_bias else None, **kwargs)
    params = [h, w, b] if with_bias else [h, w]
    g1, g2 = torch.randn(21, generator=gen), torch.randn(21, generator=gen)
    outs = []
    for lp, ent in (
        transformed_head_reference(h, w, y, temp, head),
        triton_logprob_entropy(h, w, y, temp, head=head, **blocks),
        linear_logprob_entropy(h, w, y, temp, head=head),  # through the dispatcher
    ):
        outs.append([lp, ent, *torch.autograd.grad((lp * g1 + ent * g2).sum(), params)])
    for got in outs[1:]:
        for what, a, r in zip(["logp", "entropy", "grad_h", "grad_w", "grad_b"], got, outs[0]):
            torch.testing.assert_close(a, r, atol=2e-5, rtol=1e-5, msg=f"{kwargs} {what}")
print("ok")
"""


@pytest.mark.triton
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install 'tephra-kernels[triton]')",
)
def test_triton_interpreted_matches_naive():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
