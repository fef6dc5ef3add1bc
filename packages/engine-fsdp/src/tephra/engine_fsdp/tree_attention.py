"""Attention of a prefix-sharing tree row (`prefix_sharing`) in blocks, not over the dense mask.

A tree row holds a prefix, then n segments that each see the prefix and themselves. SDPA
with the row's dense `[L, L]` mask computes every pair and throws most away: with a 45-token
prompt and 8 segments of 30 tokens, 8 x 30 x 75 of the 285 x 285 products are wanted (a
quarter), and the backward pays the same again. Here each prefix and each segment is one
block: its queries gathered with exactly the keys they see (the prefix's, then its own,
causally), one batched SDPA over the blocks of each kind, the outputs scattered back. The
same keys and values meet the same queries, so outputs and gradients are those of the dense
mask up to float summation order.

The function is registered with transformers as `ATTENTION_NAME`; a forward without
`tree_blocks` (rows run whole) takes transformers' own SDPA path, whose masks it also uses.
The blocks ride on the placeholder mask (`placeholder_mask`) as well as in the forward's
keyword arguments: some families' decoder layers (StableLM, Nemotron) call their attention
without the keyword arguments the model was given, and the mask is the one argument every
layer hands on. A placeholder that arrives without its blocks raises instead of attending
over the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "tephra_tree_sdpa"


@dataclass
class Blocks:
    """Blocks of one shape (`nb` blocks of `q` queries over `k` keys), as indices into the
    flattened tree positions (`TreeLayout.input_ids.flatten()`)."""

    query: torch.Tensor
    """`[nb, q]` each block's query positions; padding repeats a real one (see `valid`)."""
    key: torch.Tensor
    """`[nb, k]` the key positions each block's queries may see; padding repeats a real one."""
    mask: torch.Tensor
    """`[nb, 1, q, k]` bool: query i sees key j. Every query row sees at least one key."""
    valid: torch.Tensor
    """`[m]` indices into the `[nb * q]` block queries of the real ones."""
    target: torch.Tensor
    """`[m]` the tree position each real block query writes."""

    def to(self, device: torch.device) -> Blocks:
        return Blocks(*(x.to(device) for x in vars(self).values()))


def _pad(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of indices padded to `width` by repeating their first, and which are real."""
    out = torch.stack([torch.cat([r, r[:1].expand(width - len(r))]) for r in rows])
    real = torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]
    return out, real


def _blocks(queries: list[torch.Tensor], keys: list[torch.Tensor], prefix: list[int]) -> Blocks:
    """Blocks whose queries are `queries[i]` and keys `keys[i]`, where the first `prefix[i]`
    keys are seen by every query and the rest (the queries themselves) causally."""
    q_idx, q_real = _pad(queries, max(len(q) for q in queries))
    k_idx, k_real = _pad(keys, max(len(k) for k in keys))
    lead = torch.tensor(prefix)[:, None, None]
    i = torch.arange(q_idx.shape[1])[None, :, None]
    j = torch.arange(k_idx.shape[1])[None, None, :]
    mask = k_real[:, None, :] & ((j < lead) | (j - lead <= i))
    mask[:, :, 0] |= ~q_real  # padding queries see one key: no empty softmax, output unused
    valid = q_real.flatten().nonzero()[:, 0]
    return Blocks(q_idx, k_idx, mask[:, None], valid, q_idx.flatten()[valid])


def tree_blocks(rows: list[torch.Tensor], starts: list[int]) -> tuple[Blocks, ...]:
    """The blocks of tree rows whose tokens are labelled -1 (prefix) or r (row r's segment),
    row u starting at flat position `starts[u]`: one block per prefix (causal over itself)
    and one per segment (the prefix, then itself causally). Positions after a row's last
    token (padding) belong to no block."""
    pre_q, pre_k, pre_n, seg_q, seg_k, seg_n = [], [], [], [], [], []
    for labels, start in zip(rows, starts):
        prefix = (labels == -1).nonzero()[:, 0] + start
        if len(prefix):
            pre_q.append(prefix)
            pre_k.append(prefix)
            pre_n.append(0)
        for r in labels[labels >= 0].unique().tolist():
            own = (labels == r).nonzero()[:, 0] + start
            seg_q.append(own)
            seg_k.append(torch.cat([prefix, own]))
            seg_n.append(len(prefix))
    return tuple(
        _blocks(q, k, n) for q, k, n in ((pre_q, pre_k, pre_n), (seg_q, seg_k, seg_n)) if q
    )


BLOCKS_ATTRIBUTE = "tephra_tree_blocks"
"""The attribute of the placeholder mask that holds the tree's blocks."""


def placeholder_mask(input_ids: torch.Tensor, blocks: tuple[Blocks, ...]) -> torch.Tensor:
    """A `[1, 1, T, T]` view of one True (no memory) carrying `blocks`: a 4D mask makes
    transformers pass it through (the same object) instead of building a `[T, T]` mask
    that `tree_attention` would not read."""
    t = input_ids.shape[-1]
    mask = torch.ones((), dtype=torch.bool, device=input_ids.device).expand(1, 1, t, t)
    setattr(mask, BLOCKS_ATTRIBUTE, blocks)
    return mask


def _is_placeholder(mask: torch.Tensor | None) -> bool:
    """Whether `mask` is (a copy of) a `placeholder_mask`: a bool view of one element."""
    return mask is not None and mask.dtype == torch.bool and not any(mask.stride())


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_blocks: tuple[Blocks, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface: `query [b, h, L, d]`, `key`/`value [b, kv, L, d]`
    -> `[b, L, h, d]`. Without `tree_blocks` (in the keyword arguments or on the mask):
    transformers' SDPA."""
    if tree_blocks is None:
        tree_blocks = getattr(attention_mask, BLOCKS_ATTRIBUTE, None)
    if tree_blocks is None and _is_placeholder(attention_mask):
        raise RuntimeError(
            f"{type(module).__name__}: a shared-prefix tree row reached attention without "
            "its blocks (the model changed the placeholder mask on the way); set "
            "micro_batch.share_prefix=false for this model"
        )
    if tree_blocks is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    b, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(b * length, heads, dim)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(b * length, key.shape[1], dim)
    out = q.new_zeros(b * length, heads, dim)  # padding positions: never scored nor seen
    for blk in tree_blocks:
        # index_select, not indexing: its backward is index_add (indexing's accumulating
        # index_put ran 10x slower on a CPU)
        qb, kb, vb = (
            x.index_select(0, idx.flatten()).unflatten(0, idx.shape).transpose(1, 2)
            for x, idx in ((q, blk.query), (k, blk.key), (v, blk.key))
        )
        o = F.scaled_dot_product_attention(
            qb,
            kb,
            vb,
            attn_mask=blk.mask,
            scale=scaling,
            enable_gqa=query.shape[1] > key.shape[1],
            dropout_p=dropout if module.training else 0.0,
        )
        out = out.index_copy(0, blk.target, o.transpose(1, 2).flatten(0, 1)[blk.valid])
    return out.view(b, length, heads, dim), None


AttentionInterface.register(ATTENTION_NAME, tree_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
