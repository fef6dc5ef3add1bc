"""Vocab-parallel log-prob and entropy: the lm_head weight is split along the vocabulary over
a torch.distributed process group (tensor parallelism), as in Megatron's output layer.

Rank r holds W_r = W[vocab_start : vocab_start + V_r] and computes its slice of the logits
chunk by chunk (never the whole [tokens, V_r] at once). Per token it keeps
    m_r = max_v z_v,   s_r = sum_v exp(z_v - m_r),   t_r = sum_v exp(z_v - m_r) (z_v - m_r),
    l_r = z_label if the label is in this shard else 0
and two collectives over the whole batch combine them (a_r = e^(m_r - M)):
    M = all_reduce_max(m_r);   S, T, L = all_reduce_sum(s_r a_r, (t_r + s_r (m_r - M)) a_r, l_r)
    lse = M + log S,   logp = L - lse,   H = -sum p log p = log S - T / S
On request, also u_r = sum_v exp(2 (z_v - m_r)) and U = all_reduce_sum(u_r a_r^2) in the same
all-reduce, for Q = sum_v p_v^2 = U / S^2 (no gradient).
Backward recomputes the shard's logits and uses the same dL/dz as chunked.py (the one-hot
term only where the label lives in this shard):
    grad W_r = dz_r.T @ h    (local)       grad h = all_reduce_sum(dz_r @ W_r)
so the hidden gradient returned on every rank is already the full one: do not all-reduce it
again (for example through Megatron's copy_to_tensor_model_parallel_region).
A `HeadTransform` (scales, soft-cap, the shard's bias) is applied to each shard's logits and
its derivative to dz as in chunked.py; its bias is the shard's rows of the head's bias and
gets the shard's gradient (no collective). A vocabulary cut is not supported here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tephra.kernels.chunked import auto_chunk_tokens, chunk_logits, grad_logits_
from tephra.kernels.errors import KernelInputError
from tephra.kernels.head_transform import (
    PLAIN,
    HeadTransform,
    check_head,
    grad_through_head_,
    softcap_slope,
)
from tephra.kernels.logprob_entropy import check_inputs
from tephra.kernels.reference import LogprobEntropy


class VocabParallelLogprobEntropy(torch.autograd.Function):
    """autograd.Function for one rank's vocabulary shard; every rank of `group` must call it."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight_shard: torch.Tensor,
        bias: torch.Tensor | None,
        head: HeadTransform,
        labels: torch.Tensor,
        group: dist.ProcessGroup | None,
        temperature: float,
        ignore_index: int,
        vocab_start: int,
        compute_entropy: bool,
        chunk_size: int,
        compute_sum_pi_squared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        v_shard = weight_shard.shape[0]
        inv_temp = 1.0 / temperature
        weight32 = weight_shard.float()
        bias32 = bias.float() if bias is not None else None
        valid = labels != ignore_index
        local = labels - vocab_start
        in_shard = valid & (local >= 0) & (local < v_shard)
        local = torch.where(in_shard, local, 0)
        stats = torch.zeros(5, n, dtype=torch.float32, device=hidden.device)  # m, s, t, l, u
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            z = chunk_logits(hidden[sl], weight32, inv_temp, head, bias32)
            m = z.amax(dim=-1)
            picked = z.gather(1, local[sl].unsqueeze(-1)).squeeze(-1)
            stats[3, sl] = torch.where(in_shard[sl], picked, 0.0)
            shifted = z.sub_(m.unsqueeze(-1))
            e = shifted.exp()
            stats[0, sl] = m
            stats[1, sl] = e.sum(-1)
            if compute_sum_pi_squared:
                stats[4, sl] = (e * e).sum(-1)
            if compute_entropy:
                stats[2, sl] = e.mul_(shifted).sum(-1)
            del e
            del z
        big_m = stats[0].clone()
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(stats[0] - big_m)
        shifted_t = (stats[2] + stats[1] * (stats[0] - big_m)) * scale
        sums = torch.stack([stats[1] * scale, shifted_t, stats[3], stats[4] * scale * scale])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = big_m + torch.log(sums[0])
        log_probs = torch.where(valid, sums[2] - lse, 0.0)
        entropy = (
            torch.log(sums[0]) - sums[1] / sums[0] if compute_entropy else torch.zeros_like(lse)
        )
        sum_pi_squared = sums[3] / (sums[0] * sums[0])
        ctx.save_for_backward(hidden, weight_shard, bias, labels, lse, entropy)
        ctx.head = head
        ctx.group, ctx.temperature, ctx.ignore_index = group, temperature, ignore_index
        ctx.vocab_start, ctx.compute_entropy, ctx.chunk_size = (
            vocab_start,
            compute_entropy,
            chunk_size,
        )
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
        hidden, weight_shard, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        head: HeadTransform = ctx.head
        n = hidden.shape[0]
        v_shard = weight_shard.shape[0]
        inv_temp = 1.0 / ctx.temperature
        weight32 = weight_shard.float()
        bias32 = bias.float() if bias is not None else None
        grad_b = torch.zeros(v_shard, dtype=torch.float32, device=weight_shard.device)
        valid = labels != ctx.ignore_index
        local = labels - ctx.vocab_start
        in_shard = valid & (local >= 0) & (local < v_shard)
        local = torch.where(in_shard, local, 0)
        g_lp = torch.where(valid, grad_log_probs.float(), 0.0)
        onehot_weight = torch.where(in_shard, g_lp, 0.0)
        g_ent = grad_entropy.float() if ctx.compute_entropy else None
        # Every rank computes and all-reduces grad_h even when only the weight needs a
        # gradient, so that all ranks issue the same collectives.
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = (
            torch.zeros(weight_shard.shape, dtype=torch.float32, device=weight_shard.device)
            if need_w
            else None
        )
        for start in range(0, n, ctx.chunk_size):
            sl = slice(start, min(start + ctx.chunk_size, n))
            z = chunk_logits(hidden[sl], weight32, inv_temp, head, bias32)
            slope = softcap_slope(z, head, inv_temp) if head.softcap is not None else None
            dz = grad_logits_(
                z.sub_(lse[sl].unsqueeze(-1)),
                entropy[sl] if g_ent is not None else None,
                g_lp[sl],
                g_ent[sl] if g_ent is not None else None,
                local[sl],
                onehot_weight[sl],
                inv_temp,
            )
            grad_through_head_(dz, slope, head, grad_b if need_b else None)
            del slope
            torch.mm(dz, weight32, out=grad_h[sl])
            if grad_w is not None:  # need_w
                grad_w.addmm_(dz.T, hidden[sl].float())
            del z, dz
        dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=ctx.group)
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight_shard.dtype) if grad_w is not None else None,
            grad_b.to(weight_shard.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def vocab_parallel_logprob_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    vocab_start: int | None = None,
    compute_entropy: bool = True,
    chunk_size: int | None = None,
    compute_sum_pi_squared: bool = False,
    head: HeadTransform | None = None,
) -> LogprobEntropy:
    """linear_logprob_entropy with the weight split along the vocabulary over `group`.

    hidden [..., hidden_size] (the same on every rank of `group`), weight_shard
    [vocab_shard, hidden_size] = rows vocab_start .. vocab_start + vocab_shard of the full
    lm_head weight, labels [...] global token ids (or ignore_index) -> log_probs and entropy
    [...] fp32, identical on every rank and equal to the unsharded result. group=None is the
    default group. vocab_start=None assumes equal shards in rank order:
    rank_in_group * vocab_shard. Collective: every rank of `group` must call it, and call
    backward. The returned hidden gradient is already summed over the group.
    With `compute_sum_pi_squared`, a third element sum_pi_squared [...] fp32 (sum_v p_v^2 of
    the full softmax, no gradient) rides on the forward's all-reduce.
    `head` applies a HeadTransform (the same scales and cap on every rank; head.bias is this
    rank's shard of the bias, [vocab_shard]); head.vocab_size must be None here.
    """
    check_inputs(hidden, weight_shard, labels, temperature, chunk_size, weight_name="weight_shard")
    head = head or PLAIN
    check_head(head, weight_shard, weight_name="weight_shard")
    if head.vocab_size is not None:
        raise KernelInputError(
            f"HeadTransform.vocab_size={head.vocab_size} is not supported by "
            "vocab_parallel_logprob_entropy; pass only the logit rows as weight_shard "
            "(vocab_size=None)"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise KernelInputError(
            "vocab_parallel_logprob_entropy needs torch.distributed initialised "
            "(dist.init_process_group); without tensor parallelism call linear_logprob_entropy"
        )
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * weight_shard.shape[0]
    if not isinstance(vocab_start, int) or vocab_start < 0:
        raise KernelInputError(f"vocab_start={vocab_start!r}; expected an int >= 0")
    bad = (labels != ignore_index) & (labels < 0)
    if bool(bad.any()):
        raise KernelInputError(
            f"labels holds {labels[bad].flatten()[0].item()}, negative and not "
            f"ignore_index={ignore_index}; labels must be global token ids or ignore_index"
        )
    n_hidden = hidden.shape[-1]
    flat = hidden.reshape(-1, n_hidden)
    if chunk_size is None:
        chunk_size = auto_chunk_tokens(weight_shard.shape[0], flat.shape[0])
    log_probs, entropy, sum_pi_squared = VocabParallelLogprobEntropy.apply(
        flat,
        weight_shard,
        head.bias,
        head,
        labels.reshape(-1).long(),
        group,
        float(temperature),
        ignore_index,
        vocab_start,
        compute_entropy,
        chunk_size,
        compute_sum_pi_squared,
    )
    lead = labels.shape
    log_probs, entropy = log_probs.reshape(lead), entropy.reshape(lead) if compute_entropy else None
    if compute_sum_pi_squared:
        return log_probs, entropy, sum_pi_squared.reshape(lead)
    return log_probs, entropy
