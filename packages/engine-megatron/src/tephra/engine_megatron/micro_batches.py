"""A padded micro-batch `[b, t]` laid out for the model, and the model's per-position
outputs laid back onto tokens.

Layouts the model sees (S = sequence length after padding for CP/SP divisibility):
- padded: one row per sequence, `[b, S]`; a query attends to earlier real tokens of its row;
- packed (THD): the real tokens of every sequence in one row `[1, S]`, position ids
  restarting at 0 per sequence, so no compute is spent on padding.
Who attends to whom is an attention plan (`core_attention.attention_plan`: one causal block
per sequence), never a dense `[S, S]` mask. Runs of padding are blocks of their own, so they
have a defined (unused) output.
With context parallel size cp, positions are cut into 2*cp chunks and this rank keeps chunks
r and 2*cp-1-r (megatron's load-balanced layout); the plan's keys index all S positions.
Labels: the next token of the same sequence, or -100 (no label) at a sequence's end.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.errors import BatchError
from tephra.engine_megatron.core_attention import attention_plan, cp_chunk_index, cp_full_order

IGNORE = -100


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [rows, s_local]
    position_ids: torch.Tensor  # [rows, s_local]
    labels: torch.Tensor  # [rows, s_local], IGNORE where no next token
    attention_plan: torch.Tensor  # int64 [n, 5] blocks (row, q0, q1, k0, k1), on the CPU
    token_index: torch.Tensor  # [b, t]: flat index into [rows * S] of each token, -1 off
    response_mask: torch.Tensor  # [b, t]
    seq_length: int  # S, the full sequence length (all context-parallel ranks together)

    def to(self, device: torch.device) -> ModelInputs:
        """The same inputs on `device` (the model's); the plan stays on the CPU (kernels read
        it as Python numbers)."""
        keep = ("attention_plan", "seq_length")
        return ModelInputs(
            **{
                f.name: getattr(self, f.name)
                if f.name in keep
                else getattr(self, f.name).to(device)
                for f in fields(self)
            }
        )

    def to_tokens(self, per_position: torch.Tensor) -> torch.Tensor:
        """`[rows, S, k]` outputs at hidden positions -> `[b, t, k]` about tokens: the output
        at position p (which predicts token p+1) moves to token p+1; 0 off the response."""
        rows, s, k = per_position.shape
        flat = per_position.reshape(rows * s, k)
        b, t = self.token_index.shape
        prev = torch.full_like(self.token_index, -1)
        prev[:, 1:] = self.token_index[:, :-1]
        take = self.response_mask.bool() & (prev >= 0)
        gathered = flat[prev.clamp(min=0).reshape(-1)].reshape(b, t, k)
        return gathered * take[..., None].to(gathered.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_length(s_real: int, sp_size: int) -> int:
    """Sequence length the model runs: a multiple of 2*cp*sp when CP or SP split it."""
    cp = ps.get_context_parallel_world_size()
    return _round_up(s_real, 2 * cp * sp_size) if (cp > 1 or sp_size > 1) else s_real


def natural_shape(mb: TensorDict, packed: bool, sp_size: int) -> tuple[int, int]:
    """(rows, S) that `prepare` gives this micro-batch without a target shape."""
    attn = mb[B.ATTENTION_MASK]
    if packed:
        return 1, padded_length(int(attn.sum()), sp_size)
    return attn.shape[0], padded_length(attn.shape[1], sp_size)


def prepare(  # noqa: PLR0915 (older than the limit; to split)
    mb: TensorDict, packed: bool, sp_size: int, shape: tuple[int, int] | None = None
) -> ModelInputs:
    """Lay out `mb` for the model; `shape` = (rows, S) pads it to a fixed shape (pipeline
    stages exchange fixed shapes: gloo mismatched megatron's variable-shape handshake)."""
    cp = ps.get_context_parallel_world_size()
    attn = mb[B.ATTENTION_MASK].bool()
    ids = mb[B.INPUT_IDS]
    pos = mb[B.POSITION_IDS] if B.POSITION_IDS in mb.keys() else B.positions_from_mask(attn)
    b, t = ids.shape
    if packed:
        lengths = attn.sum(-1)
        n = int(lengths.sum())
        seq_of = torch.repeat_interleave(torch.arange(b), lengths)
        flat_ids = ids[attn]
        starts = torch.cumsum(lengths, 0) - lengths
        flat_pos = torch.arange(n) - torch.repeat_interleave(starts, lengths)
        rows_ids, rows_pos, rows_seg = flat_ids[None], flat_pos[None], seq_of[None]
        token_index = torch.full((b, t), -1, dtype=torch.int64)
        token_index[attn] = torch.arange(n)
        s_real = n
    else:
        first, last = attn.long().argmax(-1), t - 1 - attn.flip(-1).long().argmax(-1)
        holes = (last - first + 1) != attn.sum(-1)
        if holes.any():
            row = int(holes.nonzero()[0])
            raise BatchError(
                f"row {row}: attention_mask has a 0 between real tokens; engine-megatron "
                "needs each sequence contiguous (padding only on the left or right)"
            )
        rows_ids, rows_pos = ids, pos
        rows_seg = torch.where(attn, torch.arange(b)[:, None].expand(b, t), -1)
        s_real = t
        token_index = torch.where(attn, torch.arange(b * t).reshape(b, t), -1)
    rows = rows_ids.shape[0]
    s = padded_length(s_real, sp_size)
    if shape is not None:
        extra_rows, s = shape[0] - rows, shape[1]
        if extra_rows:
            rows_ids = torch.cat([rows_ids, rows_ids.new_zeros(extra_rows, rows_ids.shape[1])])
            rows_pos = torch.cat([rows_pos, rows_pos.new_zeros(extra_rows, rows_pos.shape[1])])
            rows_seg = torch.cat([rows_seg, rows_seg.new_full((extra_rows, rows_seg.shape[1]), -1)])
            rows = shape[0]
    pad = s - s_real
    if pad:
        rows_ids = torch.cat([rows_ids, rows_ids.new_zeros(rows, pad)], 1)
        rows_pos = torch.cat([rows_pos, rows_pos.new_zeros(rows, pad)], 1)
        rows_seg = torch.cat([rows_seg, rows_seg.new_full((rows, pad), -1)], 1)
        if not packed:
            # token_index counts positions of rows of length t; re-base to rows of length s
            token_index = torch.where(token_index >= 0, token_index // t * s + token_index % t, -1)
    labels = torch.full_like(rows_ids, IGNORE)
    has_next = (rows_seg[:, :-1] == rows_seg[:, 1:]) & (rows_seg[:, :-1] >= 0)
    labels[:, :-1] = torch.where(has_next, rows_ids[:, 1:], IGNORE)
    keep = None
    if cp > 1:
        keep = cp_chunk_index(ps.get_context_parallel_rank(), cp, s)
        rows_ids, rows_pos, labels = rows_ids[:, keep], rows_pos[:, keep], labels[:, keep]
    plan = attention_plan(rows_seg, keep)
    return ModelInputs(rows_ids, rows_pos, labels, plan, token_index, mb[B.RESPONSE_MASK], s)


class _CPGather(torch.autograd.Function):
    """All-gather `[rows, s_local, k]` over the CP group into natural order `[rows, S, k]`.
    Every CP rank then computes the same loss, so the backward keeps this rank's slice of
    the gradient without communicating."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:
        cp = ps.get_context_parallel_world_size()
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_context_parallel_group())
        stacked = torch.cat(parts, dim=1)
        s = stacked.shape[1]
        order = torch.argsort(cp_full_order(cp, s))
        ctx.keep = cp_chunk_index(ps.get_context_parallel_rank(), cp, s)
        return stacked.index_select(1, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.index_select(1, ctx.keep)


def cp_gather(local: torch.Tensor) -> torch.Tensor:
    if ps.get_context_parallel_world_size() == 1:
        return local
    return _CPGather.apply(local)
