"""DeepSpeed-Ulysses sequence parallelism (`parallel.context > 1` on engine=fsdp).

The `sp = parallel.context` consecutive ranks of one sequence-parallel group receive the same
rows. A micro-batch is packed into one token stream `[1, N]`, padded to `T = sp * t`
tokens and cut into `sp` contiguous shards of `t` tokens; rank `r` of the group runs the
embeddings, MLPs, norms and RoPE on tokens `[r t, (r + 1) t)` only. Attention needs every
token, so around it the heads are exchanged with an all-to-all:

    q, k, v  [1, heads, t, d]  --all-to-all-->  [1, heads / sp, T, d]
    attention over all T tokens, causal within each global packed segment
    out      [1, heads / sp, T, d]  --all-to-all-->  [1, heads, t, d]

so activations outside attention are `1 / sp` of the unsharded ones. With fewer key/value
heads than `sp` (or a count `sp` does not divide), the key/value heads are repeated up to
the query heads first (grouped-query attention computed as multi-head), as verl does.

The all-to-all is `torch.distributed.all_to_all_single`, which gloo (CPU) and NCCL (GPU)
both implement; its backward is the inverse all-to-all.

The segments are found here, not by transformers: the registered attention function
(`ATTENTION_NAME`) has no mask function, so transformers passes `attention_mask=None`, and
the segments come from the global position ids that `sequence_context` publishes (a
segment starts where the position id is 0); attention runs as one causal SDPA per segment.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "tephra_ulysses"


@dataclass
class _State:
    group: dist.ProcessGroup | None = None
    sp: int = 1
    bounds: tuple[tuple[int, int], ...] = ()  # [start, end) of every global packed segment


_STATE = _State()


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()  # before empty_like, which would copy a permuted layout
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHead(torch.autograd.Function):
    """[b, h, t, d] sequence shard -> [b, h / sp, sp * t, d] head shard (inverse: backward)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sp: int
    ) -> torch.Tensor:
        ctx.group, ctx.sp = group, sp
        return seq_to_head(x, group, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return head_to_seq(grad, ctx.group, ctx.sp), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sp: int
    ) -> torch.Tensor:
        ctx.group, ctx.sp = group, sp
        return head_to_seq(x, group, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return seq_to_head(grad, ctx.group, ctx.sp), None, None


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None, sp: int) -> torch.Tensor:
    b, h, t, d = x.shape
    # chunk j of the heads goes to rank j; rank j receives every rank's tokens for it
    send = x.reshape(b, sp, h // sp, t, d).permute(1, 0, 2, 3, 4)
    recv = _all_to_all(send, group)  # [sp (source = token shard), b, h / sp, t, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None, sp: int) -> torch.Tensor:
    b, hs, n, d = x.shape
    t = n // sp
    send = x.reshape(b, hs, sp, t, d).permute(2, 0, 1, 3, 4)  # token shard j goes to rank j
    recv = _all_to_all(send, group)  # [sp (source = head chunk), b, h / sp, t, d]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, sp * hs, t, d)


def _ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as `ATTENTION_NAME` (transformers' interface:
    query `[b, heads, t, d]`, key/value `[b, kv_heads, t, d]`; returns `[b, t, heads, d]`).
    A sliding window `w` (the layer's `sliding_window` argument, else its attribute; None on
    a hybrid model's full layers) lets a query at position `i` of its sequence see the keys at
    `i - w < j <= i`, as transformers' `sliding_window_overlay`."""
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("Ulysses attention does not implement attention sinks")
    if attention_mask is not None:  # a layer's own mask (Doge's dynamic one): not ignored
        raise NotImplementedError("Ulysses attention takes no attention mask")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    group, sp = _STATE.group, _STATE.sp
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp:
        raise ValueError(f"{heads} attention heads are not divisible by parallel.context={sp}")
    if kv_heads % sp:
        rep = heads // kv_heads
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
        kv_heads = heads
    q = _SeqToHead.apply(query, group, sp)
    k = _SeqToHead.apply(key, group, sp)
    v = _SeqToHead.apply(value, group, sp)
    groups = heads // kv_heads
    if groups > 1:  # each rank holds kv_heads / sp heads serving heads / sp query heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    # varlen attention as one causal SDPA per packed segment: no [T, T] mask is built, so
    # the fused (flash / memory-efficient) SDPA kernels apply
    drop = dropout if module.training else 0.0
    out = torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, a:b],
                k[:, :, a:b],
                v[:, :, a:b],
                attn_mask=_window_mask(b - a, window, q.device),
                is_causal=not window or b - a <= window,
                dropout_p=drop,
                scale=scaling,
            )
            for a, b in _STATE.bounds
        ],
        dim=2,
    )
    out = _HeadToSeq.apply(out, group, sp)  # [b, heads, t, d]
    return out.transpose(1, 2).contiguous(), None


def _window_mask(n: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """`[n, n]` boolean mask of a causal sliding window over a segment of `n` tokens (True:
    attend), or None where the window covers the whole segment (plain causal attention)."""
    if not window or n <= window:
        return None
    i = torch.arange(n, device=device)
    gap = i[:, None] - i[None, :]  # query position - key position
    return (gap >= 0) & (gap < window)


AttentionInterface.register(ATTENTION_NAME, _ulysses_attention)


def groups(sp: int, device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(sequence-parallel group, data-parallel group) of this rank. The sequence group has
    the default backend (it moves activations); the data-parallel group reduces CPU
    counts and metrics, so it is gloo.

    Rank `r` is in sequence group `r // sp` (consecutive ranks) and data-parallel group
    `r % sp`. Every rank must call this (group creation is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    for g in range(world // sp):
        ranks = list(range(g * sp, (g + 1) * sp))
        made = dist.new_group(ranks)
        if rank in ranks:
            sp_group = made
    for j in range(sp):
        ranks = list(range(j, world, sp))
        made = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            dp_group = made
    assert sp_group is not None and dp_group is not None  # every rank is in one of each
    return sp_group, dp_group


def padded_length(n: int, sp: int) -> int:
    """Smallest multiple of `sp` that is >= n (and >= sp)."""
    return max(sp, -(-n // sp) * sp)


def segment_bounds(position_ids: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """`[start, end)` of every packed segment of `position_ids [T]`; a segment starts where
    the position id is 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], position_ids.shape[0]]
    return tuple(zip(starts, ends, strict=True))


@contextmanager
def sequence_context(
    group: dist.ProcessGroup | None, sp: int, position_ids: torch.Tensor
) -> Iterator[None]:
    """Publish the group and the global packed position ids `[T]` to the attention function
    for the forward pass inside. They stay published after it: gradient checkpointing
    re-runs the attention during the backward, which comes before the next micro-batch's
    forward publishes its own."""
    _STATE.group, _STATE.sp, _STATE.bounds = group, sp, segment_bounds(position_ids)
    yield


class GatherShards(torch.autograd.Function):
    """All-gather `[t]` per-token floats of the sp shards into `[sp * t]`; backward keeps
    this rank's slice of the gradient (every rank computes the same loss on the gathered
    values, so the slice is exactly d loss / d local outputs)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sp: int, rank: int
    ) -> torch.Tensor:
        ctx.rank, ctx.t = rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad[ctx.rank * ctx.t : (ctx.rank + 1) * ctx.t], None, None, None
