"""Triton implementation: fused matmul + online log-sum-exp, no [tokens, vocab] buffer at all.

Imported only when method="triton" is used: triton is an optional dependency, and it fixes
compiled vs interpreted mode (TRITON_INTERPRET=1) when a kernel is defined.

Forward, one program per block of BLOCK_N tokens, looping over vocab blocks of BLOCK_V:
    z = (h @ W[v-block].T) / T            (dot over hidden in blocks of BLOCK_H, fp32 acc)
    m' = max(m, max_v z);  a = exp(m - m')
    s  = s a + sum_v exp(z - m')           (running sum-exp)
    t  = a (t + s (m - m')) + sum_v exp(z - m') (z - m')    (sum of e (z - m), for H)
    u  = u a^2 + sum_v exp(z - m')^2       (on request, for Q = sum_v p_v^2 = u / s^2)
    lse = m + log s,  logp = z[label] - lse,  H = -sum p log p = log s - t / s
(t is kept relative to the running max: lse - sum p z would cancel two large numbers)
Backward recomputes z tile by tile (see chunked.py for dL/dz) in two kernels that each own
their output rows, so no atomics are needed and results are deterministic:
    grad_hidden: one program per token block,  grad_h[n-block] += dz @ W[v-block]
    grad_weight: one program per vocab block,  grad_W[v-block] += dz.T @ h[n-block]
Dot operands are fp32 in registers. fp32 inputs use IEEE fp32 dots (the contract is fp32
accuracy; TF32 would lose ~1e-3). bf16 inputs are upcast and use TF32 dots: a bf16 value is
exact in TF32, so the logits are as exact as an fp32 matmul of the bf16 inputs (and bf16
operands in tl.dot are wrong under TRITON_INTERPRET in triton 3.7, which this sidesteps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tephra.kernels.chunked import chunked_logprob_entropy

# Untuned defaults for GPUs (no GPU was available while writing this); tests pass smaller
# blocks so that tiny shapes still span several blocks and partial tails.
DEFAULT_BLOCKS = {"block_n": 64, "block_v": 64, "block_h": 64}


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    H,
    s_hn,
    s_hh,
    s_wv,
    s_wh,
    inv_temp,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        a = tl.load(
            h_ptr + rows[:, None] * s_hn + ks[None, :] * s_hh,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * s_wv + ks[:, None] * s_wh,
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return acc * inv_temp


@triton.jit
def _grad_logits_tile(z, cols, col_mask, labels, lse, ent, g_lp, g_ent, inv_temp):
    # dL/dz = p (-g_H (log p + H) - g_lp) + g_lp onehot, then / T (see chunked.py)
    logp = tl.where(col_mask[None, :], z - lse[:, None], 0.0)
    p = tl.where(col_mask[None, :], tl.exp(logp), 0.0)
    g = p * (-g_ent[:, None] * (logp + ent[:, None]) - g_lp[:, None])
    g = g + tl.where(cols[None, :] == labels[:, None], g_lp[:, None], 0.0)
    return g * inv_temp


@triton.jit
def _forward_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    lse_ptr,
    logp_ptr,
    ent_ptr,
    q_ptr,
    N,
    V,
    H,
    s_hn,
    s_hh,
    s_wv,
    s_wh,
    inv_temp,
    ignore_index,
    COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUM_PI_SQUARED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=ignore_index)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_N], dtype=tl.float32)
    label_z = tl.zeros([BLOCK_N], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            H,
            s_hn,
            s_hh,
            s_wv,
            s_wh,
            inv_temp,
            PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        z_masked = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z_masked - m_new[:, None])
        s_old = s
        s = s * alpha + tl.sum(e, axis=1)
        if COMPUTE_ENTROPY:
            # s_old is 0 exactly while m is -inf (first block): skip the 0 * -inf
            shift = s_old * tl.where(s_old > 0, m - m_new, 0.0)
            t = alpha * (t + shift) + tl.sum(
                e * tl.where(col_mask[None, :], z - m_new[:, None], 0.0), axis=1
            )
        if COMPUTE_SUM_PI_SQUARED:
            u = u * alpha * alpha + tl.sum(e * e, axis=1)
        label_z += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        m = m_new
    lse = m + tl.log(s)
    valid = labels != ignore_index
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    tl.store(logp_ptr + rows, tl.where(valid, label_z - lse, 0.0), mask=row_mask)
    if COMPUTE_ENTROPY:
        tl.store(ent_ptr + rows, tl.log(s) - t / s, mask=row_mask)
    if COMPUTE_SUM_PI_SQUARED:
        tl.store(q_ptr + rows, u / (s * s), mask=row_mask)


@triton.jit
def _grad_hidden_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    gh_ptr,
    N,
    V,
    H,
    s_hn,
    s_hh,
    s_wv,
    s_wh,
    inv_temp,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
    g_ent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            H,
            s_hn,
            s_hh,
            s_wv,
            s_wh,
            inv_temp,
            PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        g = _grad_logits_tile(z, cols, col_mask, labels, lse, ent, g_lp, g_ent, inv_temp)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            w = tl.load(
                w_ptr + cols[:, None] * s_wv + ks[None, :] * s_wh,
                mask=col_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            part = tl.dot(g, w.to(tl.float32), input_precision=PRECISION)
            out = gh_ptr + rows[:, None] * H + ks[None, :]
            out_mask = row_mask[:, None] & k_mask[None, :]
            tl.store(out, tl.load(out, mask=out_mask, other=0.0) + part, mask=out_mask)


@triton.jit
def _grad_weight_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    gw_ptr,
    N,
    V,
    H,
    s_hn,
    s_hh,
    s_wv,
    s_wh,
    inv_temp,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        labels = tl.load(labels_ptr + rows, mask=row_mask, other=-1)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
        g_ent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            H,
            s_hn,
            s_hh,
            s_wv,
            s_wh,
            inv_temp,
            PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        g = _grad_logits_tile(z, cols, col_mask, labels, lse, ent, g_lp, g_ent, inv_temp)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            h = tl.load(
                h_ptr + rows[:, None] * s_hn + ks[None, :] * s_hh,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            part = tl.dot(tl.trans(g), h.to(tl.float32), input_precision=PRECISION)
            out = gw_ptr + cols[:, None] * H + ks[None, :]
            out_mask = col_mask[:, None] & k_mask[None, :]
            tl.store(out, tl.load(out, mask=out_mask, other=0.0) + part, mask=out_mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonLogprobEntropy(torch.autograd.Function):
    """autograd.Function around the three kernels above."""

    @staticmethod
    def forward(
        ctx, hidden, weight, labels, temperature, ignore_index, compute_entropy, blocks, sum_sq
    ):
        n, h = hidden.shape
        v = weight.shape[0]
        labels = labels.contiguous()
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_probs = torch.empty_like(lse)
        entropy = torch.zeros_like(lse)
        sum_pi_squared = torch.zeros_like(lse)
        bn, bv, bh = blocks["block_n"], blocks["block_v"], blocks["block_h"]
        _forward_kernel[(triton.cdiv(n, bn),)](
            hidden,
            weight,
            labels,
            lse,
            log_probs,
            entropy,
            sum_pi_squared,
            n,
            v,
            h,
            hidden.stride(0),
            hidden.stride(1),
            weight.stride(0),
            weight.stride(1),
            1.0 / temperature,
            ignore_index,
            COMPUTE_ENTROPY=compute_entropy,
            COMPUTE_SUM_PI_SQUARED=sum_sq,
            PRECISION=_precision(hidden.dtype),
            BLOCK_N=bn,
            BLOCK_V=bv,
            BLOCK_H=bh,
        )
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.compute_entropy, ctx.blocks = compute_entropy, blocks
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(sum_pi_squared)
        return log_probs, entropy, sum_pi_squared

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _grad_q=None):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 8
        n, h = hidden.shape
        v = weight.shape[0]
        valid = labels != ctx.ignore_index
        g_lp = torch.where(valid, grad_log_probs.float(), 0.0).contiguous()
        if ctx.compute_entropy:
            g_ent = grad_entropy.float().contiguous()
        else:
            g_ent = torch.zeros_like(g_lp)
        # ignored rows: g_lp is 0, so their (clamped-away) label never adds a one-hot term
        bn, bv, bh = ctx.blocks["block_n"], ctx.blocks["block_v"], ctx.blocks["block_h"]
        common = dict(PRECISION=_precision(hidden.dtype), BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh)
        strides = (hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1))
        grad_h = grad_w = None
        if need_h:
            grad_h = torch.zeros((n, h), dtype=torch.float32, device=hidden.device)
            _grad_hidden_kernel[(triton.cdiv(n, bn),)](
                hidden,
                weight,
                labels,
                lse,
                entropy,
                g_lp,
                g_ent,
                grad_h,
                n,
                v,
                h,
                *strides,
                1.0 / ctx.temperature,
                **common,
            )
            grad_h = grad_h.to(hidden.dtype)
        if need_w:
            grad_w = torch.zeros((v, h), dtype=torch.float32, device=weight.device)
            _grad_weight_kernel[(triton.cdiv(v, bv),)](
                hidden,
                weight,
                labels,
                lse,
                entropy,
                g_lp,
                g_ent,
                grad_w,
                n,
                v,
                h,
                *strides,
                1.0 / ctx.temperature,
                **common,
            )
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def triton_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    blocks: dict[str, int] | None = None,
    compute_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Triton path on validated 2-D inputs. chunk_size is unused (the kernels tile by blocks);
    blocks overrides DEFAULT_BLOCKS (keys block_n, block_v, block_h; powers of two >= 16).
    With `compute_sum_pi_squared`, sum_pi_squared [tokens] fp32 is a third element."""
    if hidden.shape[0] == 0:  # an empty grid is not a valid launch; nothing to fuse anyway
        return chunked_logprob_entropy(
            hidden,
            weight,
            labels,
            temperature,
            ignore_index,
            compute_entropy=compute_entropy,
            compute_sum_pi_squared=compute_sum_pi_squared,
        )
    del chunk_size
    log_probs, entropy, sum_pi_squared = TritonLogprobEntropy.apply(
        hidden,
        weight,
        labels,
        temperature,
        ignore_index,
        compute_entropy,
        {**DEFAULT_BLOCKS, **(blocks or {})},
        compute_sum_pi_squared,
    )
    if compute_sum_pi_squared:
        return log_probs, entropy, sum_pi_squared
    return log_probs, entropy
