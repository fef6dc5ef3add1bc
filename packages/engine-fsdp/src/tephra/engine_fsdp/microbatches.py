"""Cutting a rank's share into micro-batches that every rank agrees on in number.

FSDP runs collectives in every forward and backward, so all data-parallel ranks must run
the same number of micro-batches. Each rank first splits by token budget; ranks with fewer
micro-batches then split their largest ones (by rows, keeping order) and, when they run out
of rows, add *filler* micro-batches: a real row whose outputs are multiplied by 0, so the
collectives happen but nothing is learned from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tephra.engine_api import batch as B


@dataclass
class MicroBatch:
    data: TensorDict
    """Padded micro-batch `[b, t]`."""
    filler: bool = False
    """True for the padding micro-batches that only keep ranks in step."""


def _max_over_ranks(n: int, group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0])


def plan(
    batch: TensorDict,
    max_tokens: int,
    packed: bool,
    field_name: str,
    group: dist.ProcessGroup | None = None,
) -> list[MicroBatch]:
    """Micro-batches of `batch` within `max_tokens`, as many on every rank of `group`."""
    parts = B.split_by_token_budget(batch, max_tokens, packed, field_name)
    target = _max_over_ranks(len(parts), group)
    while len(parts) < target:
        # the micro-batch with the most units of rows that may be cut apart (`KEEP_TOGETHER`)
        counts = [len(B.units(p)) for p in parts]
        i = max(range(len(parts)), key=lambda j: counts[j])
        halves = B.halve(parts[i])
        if halves is None:
            break
        parts[i : i + 1] = list(halves)
    out = [MicroBatch(p) for p in parts]
    while len(out) < target:
        filler = B.trim_padding(batch[:1]).clone()
        out.append(MicroBatch(filler, filler=True))
    return out


def leading_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[b]` the number of padding columns before each row's first token (`[b, t]` mask;
    an empty row counts 0)."""
    seen = attention_mask.bool().cumsum(-1) > 0
    first = seen.int().argmax(-1)
    return torch.where(seen[:, -1], first, torch.zeros_like(first))


def roll_rows(values: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`[b, t]` `values` with row i rolled right by `shift[i]` columns (left when
    negative): `out[i, (j + shift[i]) % t] = values[i, j]`."""
    t = values.shape[-1]
    cols = torch.arange(t, device=values.device)
    source = (cols[None, :] - shift[:, None].to(values.device)) % t
    return values.gather(-1, source)
