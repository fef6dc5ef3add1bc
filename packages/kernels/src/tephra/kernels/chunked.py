"""Chunked torch implementation: logits exist for one chunk of tokens at a time.

Forward, per chunk of C tokens (all in fp32):
    z = (h_c @ W.T) / T,   lse = logsumexp(z),   logp = z[label] - lse,
    H = -sum_v p_v log p_v    with log p = z - lse
    Q = sum_v p_v^2 = sum_v exp(2 log p_v)    (on request; no gradient: a statistic of the
                                               policy that advantage estimators read)
Only lse and H ([tokens] each) are kept for backward; backward recomputes z chunk by chunk,
except when all of log p fits in KEEP_LOGITS_BYTES: then forward keeps it and backward skips
one of the head's four [tokens, hidden] x [hidden, vocab] products.

Backward, with g_lp = dL/dlogp (0 at ignored labels) and g_H = dL/dH:
    dlogp/dz_v = onehot_v - p_v
    dH/dz_v    = -p_v (log p_v + H)
    dL/dz      = p * (-g_H (log p + H) - g_lp) + g_lp * onehot          [C, vocab]
    dL/dh_c    = (dL/dz / T) @ W          dL/dW += (dL/dz / T).T @ h_c
So the memory above inputs is the weight gradient plus about two [C, vocab] fp32 buffers,
instead of several [tokens, vocab] ones.

A `HeadTransform` (scales, soft-cap, bias, vocabulary cut; head_transform.py) is applied to
each chunk's W h before the softmax, and its derivative to dL/dz before the two products
(the soft-cap's slope read back from the recomputed or kept logits: one more [C, vocab]
buffer when a cap is set).
"""

from __future__ import annotations

from typing import Any

import torch

from tephra.kernels.cpu_linear import linear
from tephra.kernels.head_transform import (
    PLAIN,
    HeadTransform,
    apply_head_,
    grad_through_head_,
    head_rows,
    softcap_slope,
)
from tephra.kernels.reference import LogprobEntropy

# One chunk's fp32 logits take about this many bytes when chunk_size is not given: small
# enough that two such buffers stay far below the weight gradient for a 152k vocabulary,
# large enough (tens of tokens or more) that each chunk is still a full-speed matmul.
AUTO_CHUNK_BYTES = 32 * 1024 * 1024
KEEP_LOGITS_BYTES = 256 * 1024 * 1024
"""When [tokens, vocab] fp32 log-probs take at most this, forward keeps them for backward
instead of recomputing the logits (e.g. 1.3k tokens of a 49k vocabulary; 430 of 152k)."""


def auto_chunk_tokens(vocab: int, tokens: int) -> int:
    """Tokens per chunk so that one [chunk, vocab] fp32 buffer is about AUTO_CHUNK_BYTES."""
    return max(1, min(tokens, max(16, AUTO_CHUNK_BYTES // (4 * max(vocab, 1)))))


def chunk_logits(
    hidden_c: torch.Tensor,
    weight32: torch.Tensor,
    inv_temp: float,
    head: HeadTransform = PLAIN,
    bias32: torch.Tensor | None = None,
) -> torch.Tensor:
    """[C, hidden] x fp32 [vocab, hidden] -> fp32 logits [C, vocab]: `head` applied (with
    `bias32`, its bias in fp32), divided by temperature."""
    return apply_head_(linear(hidden_c.float(), weight32), head, bias32, inv_temp)


def grad_logits_(
    log_p: torch.Tensor,
    entropy: torch.Tensor | None,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    onehot_index: torch.Tensor,
    onehot_weight: torch.Tensor,
    inv_temp: float,
) -> torch.Tensor:
    """Turn log-probs log p [C, V] (logits minus their lse) in place into dL/d(h @ W.T)
    [C, V] (the temperature included).

    g_lp [C] is dL/dlogp already zeroed at ignored labels; onehot_weight [C] is g_lp where the
    label falls in this vocabulary (a vocab-parallel shard may not hold it) and 0 elsewhere;
    onehot_index [C] is the label's column in z (any valid column where onehot_weight is 0).
    """
    z = log_p
    p = z.exp()
    if g_ent is not None and entropy is not None:
        z.add_(entropy.unsqueeze(-1)).mul_(-g_ent.unsqueeze(-1))
    else:
        z.zero_()
    z.sub_(g_lp.unsqueeze(-1)).mul_(p)
    del p
    z.scatter_add_(1, onehot_index.unsqueeze(-1), onehot_weight.unsqueeze(-1).to(z.dtype))
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


class ChunkedLogprobEntropy(torch.autograd.Function):
    """autograd.Function over token chunks; see the module docstring for the math."""

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
        chunk_size: int,
        keep_logits_bytes: int,
        compute_sum_pi_squared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        inv_temp = 1.0 / temperature
        weight32 = weight.float()  # no copy for fp32 weights
        bias32 = bias.float() if bias is not None else None
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, 0)
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.zeros_like(log_probs)
        sum_pi_squared = torch.zeros_like(log_probs)
        # backward gets each chunk's log p from here instead of recomputing it, when they fit
        keep = any(ctx.needs_input_grad[:3]) and 4 * n * weight.shape[0] <= keep_logits_bytes
        kept: list[torch.Tensor] = []
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            z = chunk_logits(hidden[sl], weight32, inv_temp, head, bias32)
            lse_c = torch.logsumexp(z, dim=-1)
            log_p = z.sub_(lse_c.unsqueeze(-1))
            picked = log_p.gather(1, safe_labels[sl].unsqueeze(-1)).squeeze(-1)
            log_probs[sl] = torch.where(valid[sl], picked, 0.0)
            lse[sl] = lse_c
            if compute_entropy:
                # -sum p log p, not lse - sum p z: the latter cancels two large numbers
                entropy[sl] = log_p.exp().mul_(log_p).sum(-1).neg_()
            if compute_sum_pi_squared:
                sum_pi_squared[sl] = log_p.mul(2.0).exp_().sum(-1)
            if keep:
                kept.append(log_p)
            del z, log_p
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.head = head
        ctx.kept_log_p = kept  # not saved tensors: backward consumes them in place, once
        ctx.temperature = temperature
        ctx.ignore_index = ignore_index
        ctx.compute_entropy = compute_entropy
        ctx.chunk_size = chunk_size
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
            return (None,) * 11
        head: HeadTransform = ctx.head
        n = hidden.shape[0]
        inv_temp = 1.0 / ctx.temperature
        weight32 = weight.float()
        bias32 = bias.float() if bias is not None else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        valid = labels != ctx.ignore_index
        safe_labels = torch.where(valid, labels, 0)
        g_lp = torch.where(valid, grad_log_probs.float(), 0.0)
        g_ent = grad_entropy.float() if ctx.compute_entropy else None
        grad_h = (
            torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        )
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        # a second backward (retain_graph) recomputes: the first consumed the kept log p
        kept, ctx.kept_log_p = ctx.kept_log_p, []
        for i, start in enumerate(range(0, n, ctx.chunk_size)):
            sl = slice(start, min(start + ctx.chunk_size, n))
            if kept:
                log_p = kept[i]
                kept[i] = None
            else:
                log_p = chunk_logits(hidden[sl], weight32, inv_temp, head, bias32)
                log_p.sub_(lse[sl].unsqueeze(-1))
            slope = None
            if head.softcap is not None:  # from z = log p + lse, before dz overwrites it
                slope = softcap_slope(log_p + lse[sl].unsqueeze(-1), head, inv_temp)
            dz = grad_logits_(
                log_p,
                entropy[sl] if g_ent is not None else None,
                g_lp[sl],
                g_ent[sl] if g_ent is not None else None,
                safe_labels[sl],
                g_lp[sl],
                inv_temp,
            )
            grad_through_head_(dz, slope, head, grad_b if need_b else None)
            del slope
            if grad_h is not None:  # need_h
                torch.mm(dz, weight32, out=grad_h[sl])
            if grad_w is not None:  # need_w
                grad_w.addmm_(dz.T, hidden[sl].float())
            del log_p, dz
        del weight32  # before the bf16 casts below, so the fp32 copy and they never coexist
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    keep_logits_bytes: int = KEEP_LOGITS_BYTES,
    compute_sum_pi_squared: bool = False,
    head: HeadTransform | None = None,
) -> LogprobEntropy:
    """Chunked path on validated 2-D inputs; returns (log_probs, entropy), both fp32 [tokens],
    and sum_pi_squared [tokens] fp32 as a third element when `compute_sum_pi_squared`.
    Forward keeps the log-probs for backward when [tokens, vocab] fp32 is at most
    `keep_logits_bytes` (0: always recompute, the least memory). `head` (None: the plain
    head) is applied to W h; its bias gets a gradient."""
    head = head or PLAIN
    weight, bias = head_rows(weight, head)
    if chunk_size is None:
        chunk_size = auto_chunk_tokens(weight.shape[0], hidden.shape[0])
    log_probs, entropy, sum_pi_squared = ChunkedLogprobEntropy.apply(
        hidden,
        weight,
        bias,
        head,
        labels,
        temperature,
        ignore_index,
        compute_entropy,
        chunk_size,
        keep_logits_bytes,
        compute_sum_pi_squared,
    )
    if compute_sum_pi_squared:
        return log_probs, entropy, sum_pi_squared
    return log_probs, entropy
