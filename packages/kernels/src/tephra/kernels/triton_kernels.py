"""Triton method: cuBLAS does the three big products, Triton fuses what lies between them.

Imported only when method="triton" is used: triton is an optional dependency, and it fixes
compiled vs interpreted mode (TRITON_INTERPRET=1) when a kernel is defined.

The vocabulary is walked in blocks of `block_vocab` columns, each block for all tokens at once
(no [tokens, vocab] tensor ever; one [tokens, block] fp32 buffer at a time, about
BLOCK_BYTES). With z = (h @ W[block].T) / T from a tensor-core product (bf16 inputs give fp32
logits: cuBLAS accumulates and writes fp32, `torch.mm(..., out_dtype=float32)`):

Forward, one Triton program per token row, online over the blocks (state in [tokens] fp32):
    m' = max(m, max_v z);  a = exp(m - m')
    s  = s a + sum_v exp(z - m')                          running sum-exp
    t  = a (t + s (m - m')) + sum_v exp(z - m') (z - m')  for H, relative to the running max
    u  = u a^2 + sum_v exp(z - m')^2                      on request, Q = u / s^2
    lse = m + log s,  logp = z[label] - lse,  H = log s - t / s
Backward, per block: the logits are recomputed by the same product, one Triton pass turns
them into dL/dz (see chunked.py for the formula) in the input dtype, then
    grad_W[block]  = dz.T @ h       written once per block, in the weight's dtype
    grad_h        += dz @ W[block]  an fp32 [tokens, hidden] accumulator
So the memory above the inputs is the weight gradient, grad_h in fp32 and two block buffers,
and four products run (one more than the unfused head, which keeps its logits instead).
For bf16 inputs the gradient products take dz rounded to bf16, as the unfused bf16 head does.

A `HeadTransform` is applied in both kernels to each loaded W h (`_head`: scale, bias,
soft-cap, temperature; masked columns stay -inf after the cap), and its derivative in the
gradient kernel (the soft-cap's slope 1 - tanh^2 from the recomputed tanh), so dz is
dL/d(W h); the bias gradient is logit_scale / scale * sum_tokens dz, summed in fp32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from tephra.kernels.chunked import chunked_logprob_entropy
from tephra.kernels.head_transform import PLAIN, HeadTransform, head_rows
from tephra.kernels.reference import LogprobEntropy

BLOCK_BYTES = 64 * 1024 * 1024
"""One [tokens, block_vocab] fp32 logits buffer takes about this much when block_vocab is not
given: a few percent of the unfused head's peak at a 152k vocabulary, and wide enough (2k
columns and more up to 8k tokens) that each block's product runs at full tensor-core speed."""
ROW_BLOCK = 1024
"""Columns one Triton program reads per step of its loop (a power of two)."""


def auto_block_vocab(tokens: int, vocab: int) -> int:
    """Columns per vocab block: about BLOCK_BYTES of fp32 logits, a multiple of 128."""
    cols = BLOCK_BYTES // (4 * max(tokens, 1))
    return max(128, min(vocab, cols // 128 * 128))


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]  # triton reads its own annotations
    # tanh from exp(-2|x|) <= 1: no overflow, and no cancellation near 0 of 1 - 2 / (e^2x + 1)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit  # type: ignore[untyped-decorator]  # triton has no types
def _head(  # type: ignore[no-untyped-def]  # triton reads its own annotations
    x,
    bias_ptr,
    offs,
    mask,
    scale,
    bias_scale,
    cap,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # x = W h -> z = softcap(logit_scale (hidden_scale x + b)) / T (head_transform.py)
    x = x * scale
    if HAS_BIAS:
        x = x + bias_scale * tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SOFTCAP:
        x = cap * _tanh(x / cap)
    return x * inv_temp


@triton.jit  # type: ignore[untyped-decorator]  # triton has no types
def _stats_kernel(  # type: ignore[no-untyped-def]  # triton reads its own annotations
    z_ptr,
    stride_z,
    width,
    v0,
    labels_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    u_ptr,
    label_z_ptr,
    bias_ptr,
    scale,
    bias_scale,
    cap,
    inv_temp,
    COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUM_PI_SQUARED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    t = tl.load(t_ptr + row)
    u = tl.load(u_ptr + row)
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(z_row + cols, mask=mask, other=0.0)
        x = _head(x, bias_ptr, v0 + cols, mask, scale, bias_scale, cap, inv_temp, HAS_BIAS, SOFTCAP)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(x - m_new)  # 0 at masked columns
        if COMPUTE_ENTROPY:
            # s is 0 exactly while m is -inf (first block): skip the 0 * -inf
            shift = tl.where(s > 0, s * (m - m_new), 0.0)
            t = alpha * (t + shift) + tl.sum(tl.where(mask, e * (x - m_new), 0.0), axis=0)
        if COMPUTE_SUM_PI_SQUARED:
            u = u * alpha * alpha + tl.sum(e * e, axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)
    tl.store(u_ptr + row, u)
    local = tl.load(labels_ptr + row) - v0
    inside = (local >= 0) & (local < width)
    col = tl.where(inside, local, 0)
    picked = _head(
        tl.load(z_row + col),
        bias_ptr,
        v0 + col,
        inside,
        scale,
        bias_scale,
        cap,
        inv_temp,
        HAS_BIAS,
        SOFTCAP,
    )
    tl.store(label_z_ptr + row, tl.where(inside, picked, tl.load(label_z_ptr + row)))


@triton.jit  # type: ignore[untyped-decorator]  # triton has no types
def _grad_kernel(  # type: ignore[no-untyped-def]  # triton reads its own annotations
    z_ptr,
    stride_z,
    dz_ptr,
    stride_dz,
    width,
    v0,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    bias_ptr,
    scale,
    bias_scale,
    cap,
    inv_temp,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # dL/dz = (p (-g_H (log p + H) - g_lp) + g_lp onehot) / T, then through the head:
    # times (1 - tanh^2) with a cap, times scale: dz = dL/d(W h); dz may alias z
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    raw = tl.load(z_ptr + row.to(tl.int64) * stride_z + cols, mask=mask, other=0.0)
    x = _head(raw, bias_ptr, v0 + cols, mask, scale, bias_scale, cap, inv_temp, HAS_BIAS, SOFTCAP)
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    g_lp = tl.load(glp_ptr + row)
    g_ent = tl.load(gent_ptr + row)
    label = tl.load(labels_ptr + row)
    logp = x - lse
    g = tl.exp(logp) * (-g_ent * (logp + ent) - g_lp)
    g = tl.where(cols + v0 == label, g + g_lp, g) * inv_temp
    if SOFTCAP:
        t = x / (inv_temp * cap)  # tanh(u / cap), read back from z
        g = g * (1.0 - t * t)
    g = g * scale
    out = dz_ptr + row.to(tl.int64) * stride_dz + cols
    tl.store(out, g.to(dz_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _mm_writes_fp32(device_type: str) -> bool:
    """Whether torch.mm takes out_dtype=float32 for bf16/fp16 inputs on this device (CUDA in
    torch >= 2.8): the product then accumulates and writes fp32 in one cuBLAS call."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32 with fp32 accumulation, whatever the (equal) input dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if _mm_writes_fp32(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # CPU: a bf16 value is exact in fp32


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b in out's dtype (equal to the inputs'), accumulated in fp32."""
    if a.is_cuda or a.dtype == torch.float32:
        torch.mm(a, b, out=out)  # cuBLAS accumulates bf16 products in fp32
    else:
        out.copy_(torch.mm(a.float(), b.float()))


def _head_args(head: HeadTransform) -> tuple[float, float, float]:
    """The kernels' scale, bias_scale and cap arguments for `head` (cap 1.0 when unused)."""
    return head.scale, float(head.logit_scale), float(head.softcap or 1.0)


class TritonLogprobEntropy(torch.autograd.Function):
    """autograd.Function over vocab blocks; see the module docstring for the math."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head: HeadTransform,
        labels: torch.Tensor,
        temperature: float,
        ignore_index: int,
        compute_entropy: bool,
        block: int,
        sum_sq: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, v = hidden.shape[0], weight.shape[0]
        inv_temp = 1.0 / temperature
        labels = labels.contiguous()
        bias_c = bias.contiguous() if bias is not None else labels  # labels: a dummy pointer
        head_args = _head_args(head)
        state = torch.zeros(5, n, dtype=torch.float32, device=hidden.device)
        m, s, t, u, label_z = state
        m.fill_(float("-inf"))
        for v0 in range(0, v, block):
            w_blk = weight[v0 : v0 + block]
            z = _mm_fp32(hidden, w_blk.T)
            _stats_kernel[(n,)](
                z,
                z.stride(0),
                w_blk.shape[0],
                v0,
                labels,
                m,
                s,
                t,
                u,
                label_z,
                bias_c,
                *head_args,
                inv_temp,
                COMPUTE_ENTROPY=compute_entropy,
                COMPUTE_SUM_PI_SQUARED=sum_sq,
                HAS_BIAS=bias is not None,
                SOFTCAP=head.softcap is not None,
                BLOCK=ROW_BLOCK,
            )
            del z
        log_s = s.log()
        lse = m + log_s
        valid = labels != ignore_index
        log_probs = torch.where(valid, label_z - lse, 0.0)
        entropy = log_s - t / s if compute_entropy else torch.zeros_like(lse)
        sum_pi_squared = u / (s * s) if sum_sq else torch.zeros_like(lse)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.ignore_index, ctx.head = temperature, ignore_index, head
        ctx.compute_entropy, ctx.block = compute_entropy, block
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(sum_pi_squared)
        return log_probs, entropy, sum_pi_squared

    @staticmethod
    def backward(
        ctx: Any,
        grad_log_probs: torch.Tensor,
        grad_entropy: torch.Tensor,
        _grad_q: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if not (need_h or need_w or need_b):
            return (None,) * 10
        head: HeadTransform = ctx.head
        bias_c = bias.contiguous() if bias is not None else labels  # labels: a dummy pointer
        head_args = _head_args(head)
        n, v = hidden.shape[0], weight.shape[0]
        inv_temp = 1.0 / ctx.temperature
        valid = labels != ctx.ignore_index
        # ignored rows: g_lp is 0, so their label never adds a one-hot term
        g_lp = torch.where(valid, grad_log_probs.float(), 0.0).contiguous()
        if ctx.compute_entropy:
            g_ent = grad_entropy.float().contiguous()
        else:
            g_ent = torch.zeros_like(g_lp)
        grad_h = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        )
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty(v, dtype=torch.float32, device=weight.device) if need_b else None
        for v0 in range(0, v, ctx.block):
            w_blk = weight[v0 : v0 + ctx.block]
            width = w_blk.shape[0]
            z = _mm_fp32(hidden, w_blk.T)
            # fp32 inputs: dz overwrites z; bf16: dz in bf16, the gradient products' dtype
            dz = z if hidden.dtype == torch.float32 else torch.empty_like(z, dtype=hidden.dtype)
            _grad_kernel[(n, triton.cdiv(width, ROW_BLOCK))](
                z,
                z.stride(0),
                dz,
                dz.stride(0),
                width,
                v0,
                labels,
                lse,
                entropy,
                g_lp,
                g_ent,
                bias_c,
                *head_args,
                inv_temp,
                HAS_BIAS=bias is not None,
                SOFTCAP=head.softcap is not None,
                BLOCK=ROW_BLOCK,
            )
            del z
            if grad_b is not None:  # dL/db = logit_scale dL/du = dz / hidden_scale
                torch.sum(dz, 0, dtype=torch.float32, out=grad_b[v0 : v0 + width])
            if grad_w is not None:  # need_w
                _mm_into(dz.T, hidden, grad_w[v0 : v0 + width])
            if grad_h is not None:
                grad_h += _mm_fp32(dz, w_blk)
            del dz
        if grad_b is not None:
            grad_b.div_(head.hidden_scale)
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w,
            grad_b.to(bias.dtype) if grad_b is not None and bias is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def triton_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    block_vocab: int | None = None,
    compute_sum_pi_squared: bool = False,
    head: HeadTransform | None = None,
) -> LogprobEntropy:
    """Triton path on validated 2-D inputs. chunk_size is unused (the vocabulary is walked in
    blocks, all tokens at once); block_vocab is the columns per block (None: about
    BLOCK_BYTES of fp32 logits). With `compute_sum_pi_squared`, sum_pi_squared [tokens] fp32
    is a third element. `head` (None: the plain head) is applied to W h."""
    del chunk_size
    if hidden.shape[0] == 0:  # an empty grid is not a valid launch; nothing to fuse anyway
        return chunked_logprob_entropy(
            hidden,
            weight,
            labels,
            temperature,
            ignore_index,
            compute_entropy=compute_entropy,
            compute_sum_pi_squared=compute_sum_pi_squared,
            head=head,
        )
    head = head or PLAIN
    weight, bias = head_rows(weight, head)
    block = block_vocab or auto_block_vocab(hidden.shape[0], weight.shape[0])
    log_probs, entropy, sum_pi_squared = TritonLogprobEntropy.apply(
        hidden,
        weight,
        bias,
        head,
        labels,
        temperature,
        ignore_index,
        compute_entropy,
        block,
        compute_sum_pi_squared,
    )
    if compute_sum_pi_squared:
        return log_probs, entropy, sum_pi_squared
    return log_probs, entropy
