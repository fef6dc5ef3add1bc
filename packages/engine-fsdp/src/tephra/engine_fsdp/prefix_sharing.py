"""Shared prefixes in padded micro-batches: a prompt's n samples run the prompt once.

In RL batches the n samples of a prompt begin with the same prompt tokens, and no position
there is scored (hidden state t is scored only where token t + 1 is a response token). So a
micro-batch is laid out as one row per distinct prefix: the prefix's real tokens, then the
rest of each row that shares it, one segment after the other, with its own position ids. A
4D attention mask lets a segment see the prefix and itself (causally), never another
segment, so every scored hidden state sees exactly the keys and values at the same
positions as in its own row: the outputs and gradients are those of running the rows whole,
up to float rounding, and the n - 1 repeated prompts cost nothing. One forward per
micro-batch (FSDP gathers each layer once). With 45-token prompts and 32-token responses in
groups of 8 this removes about half of the tokens.

With `tree_attention` (`flat=True`) no dense mask is needed: the tree rows are laid end to
end in one row `[1, T]` without padding, and the attention blocks say who sees whom.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tephra.engine_fsdp.tree_attention import Blocks, tree_blocks

MAX_AREA_RATIO = 4
"""With a dense mask (`flat=False`) a tree row attends over its whole length: when the tree
rows' attention area (rows x length^2) exceeds this many times the plain rows', the
micro-batch runs whole (long responses: little prompt to share, and the mask would dominate
memory). The flat layout's blocks never attend over more than the plain rows do."""


@dataclass
class SharedPrefix:
    """Where a padded micro-batch `[b, t]` is cut and who shares what."""

    cut: int
    """Columns `[0, cut)` hold no scored position; they run once per distinct row."""
    first: torch.Tensor
    """`[u]` index of the row whose prefix each distinct prefix is."""
    owner: torch.Tensor
    """`[b]` which distinct prefix (index into `first`) each row uses."""


@dataclass
class TreeLayout:
    """The micro-batch as one row per distinct prefix (what the model runs)."""

    input_ids: torch.Tensor
    """`[u, L]` prefix tokens, then each sharing row's tokens from the cut on; 0-padded.
    Flat: `[1, T]`, the tree rows end to end, no padding."""
    position_ids: torch.Tensor
    """Like `input_ids`: every token's position id in its own row."""
    attention_mask: torch.Tensor | None
    """`[u, 1, L, L]` bool: query i sees key j (prefix or own segment, causal, real). Flat:
    None (only `blocks` describe the attention)."""
    scored: torch.Tensor
    """`[n]` flat indices into `input_ids.flatten()` of the scored positions, in the
    row-major order of the original `[b, t]` label mask."""
    blocks: tuple[Blocks, ...]
    """Flat: the attention per prefix and per segment, for `tree_attention`. Empty with a
    dense mask."""

    def to(self, device: torch.device) -> TreeLayout:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return TreeLayout(
            self.input_ids.to(device),
            self.position_ids.to(device),
            mask,
            self.scored.to(device),
            tuple(b.to(device) for b in self.blocks),
        )


def find(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, label_mask: torch.Tensor
) -> SharedPrefix | None:
    """The cut and the sharing of a padded micro-batch; None when no two rows share their
    prefix (or nothing is scored): the rows then run as they are."""
    b = input_ids.shape[0]
    scored_columns = label_mask.bool().any(0).nonzero()
    if b < 2 or len(scored_columns) == 0:
        return None
    cut = int(scored_columns[0])
    if cut < 1:
        return None
    key = torch.cat([input_ids[:, :cut], attention_mask[:, :cut].to(input_ids.dtype)], dim=1)
    _, owner = torch.unique(key, dim=0, return_inverse=True)
    u = int(owner.max()) + 1
    if u == b:
        return None
    rows = torch.arange(b)
    first = torch.full((u,), b, dtype=torch.long).scatter_reduce(0, owner, rows, reduce="amin")
    # number the distinct prefixes in row order (torch.unique sorts by content)
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u)
    return SharedPrefix(cut, first[order], rank[owner])


def layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    label_mask: torch.Tensor,
    flat: bool = False,
) -> TreeLayout | None:
    """The tree layout of a padded micro-batch, or None when nothing is shared. `flat`: one
    unpadded row and no dense mask, for `tree_attention`."""
    shared = find(input_ids, attention_mask, label_mask)
    if shared is None:
        return None
    real, cut = attention_mask.bool(), shared.cut
    rows_ids: list[torch.Tensor] = []
    rows_pos: list[torch.Tensor] = []
    rows_seg: list[torch.Tensor] = []
    where: dict[int, tuple[int, int]] = {}  # original row -> (tree row, start of its segment)
    for u, first in enumerate(shared.first.tolist()):
        keep = real[first, :cut]
        row_ids, row_pos = [input_ids[first, :cut][keep]], [position_ids[first, :cut][keep]]
        row_seg, length = [torch.full((int(keep.sum()),), -1)], int(keep.sum())
        for r in (shared.owner == u).nonzero()[:, 0].tolist():
            tail = real[r, cut:]
            where[r] = (u, length - cut)  # tree index of column c of row r: c + this
            # left-aligned segments: a row's real tokens after the cut are contiguous
            # (prompts are left-padded, responses right-padded), so columns map by offset
            count = int(tail.sum())
            if count and not bool(tail[:count].all()):
                return None  # padding inside the tail: keep the plain layout
            row_ids.append(input_ids[r, cut : cut + count])
            row_pos.append(position_ids[r, cut : cut + count])
            row_seg.append(torch.full((count,), r))
            length += count
        rows_ids.append(torch.cat(row_ids))
        rows_pos.append(torch.cat(row_pos))
        rows_seg.append(torch.cat(row_seg))

    def scored(starts: list[int]) -> torch.Tensor:  # tree row u begins at starts[u]
        return torch.tensor(
            [
                starts[where[r][0]] + c + where[r][1]
                for r, c in label_mask.bool().nonzero().tolist()
            ],
            dtype=torch.long,
        )

    if flat:
        starts = torch.tensor([0] + [len(x) for x in rows_ids]).cumsum(0).tolist()
        return TreeLayout(
            torch.cat(rows_ids)[None],
            torch.cat(rows_pos)[None],
            None,
            scored(starts),
            tree_blocks(rows_seg, starts),
        )
    width = max(len(x) for x in rows_ids)
    n_rows = len(rows_ids)
    b, t = input_ids.shape
    if n_rows * width * width > MAX_AREA_RATIO * b * t * t:
        return None  # long segments: the dense mask would outgrow the rows' causal attention
    ids = torch.zeros(n_rows, width, dtype=input_ids.dtype)
    pos = torch.zeros(n_rows, width, dtype=position_ids.dtype)
    seg = torch.full((n_rows, width), -2)  # -2: padding, -1: prefix, r: row r's segment
    for u in range(n_rows):
        n = len(rows_ids[u])
        ids[u, :n], pos[u, :n], seg[u, :n] = rows_ids[u], rows_pos[u], rows_seg[u]
    q, k = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & (k != -2) & ((k == -1) | (k == q))
    # padding queries see themselves only: never scored, and no NaN from an empty softmax
    mask |= torch.eye(width, dtype=torch.bool) & (q == -2)
    return TreeLayout(ids, pos, mask[:, None], scored([u * width for u in range(n_rows)]), ())
