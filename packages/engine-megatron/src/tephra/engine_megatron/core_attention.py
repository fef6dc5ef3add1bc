"""A plain-torch core attention for megatron's `SelfAttention`, with context parallelism.

megatron-core only offers context parallelism through TransformerEngine's attention, which
needs CUDA. This module takes the same place in the layer spec (`core_attention`) and:
- attends with an explicit boolean mask (True = may attend) `[b, 1, S, S]` over the FULL
  sequence, which is how padded rows and packed sequences (block-diagonal causal) are told
  apart;
- with context parallel size cp > 1, all-gathers K and V over the CP group. The sequence is
  laid out as in megatron (load balanced): cut into 2*cp chunks, CP rank r holds chunks r and
  2*cp-1-r. Queries are this rank's two chunks; keys are the whole sequence.

Math: out = softmax(q k^T * scale + log(mask)) v, heads of a query group share k and v (GQA).
"""

from __future__ import annotations

import math

import torch
import torch.distributed.nn.functional as dist_fn
from megatron.core.transformer.module import MegatronModule


def cp_chunk_index(cp_rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    """Positions (of a sequence of `seq_len`, divisible by 2*cp_size) held by `cp_rank`."""
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


def cp_full_order(cp_size: int, seq_len: int) -> torch.Tensor:
    """Concatenating every rank's local positions in rank order gives this permutation of
    the full sequence; `argsort` of it restores the natural order."""
    return torch.cat([cp_chunk_index(r, cp_size, seq_len) for r in range(cp_size)])


class TorchCoreAttention(MegatronModule):
    """Drop-in `core_attention` (same constructor and forward as megatron's
    `DotProductAttention`). `attention_mask`: bool `[b, 1, S, S]`, True = may attend."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        **_,
    ):
        super().__init__(config=config)
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        # query [sq, b, np, hn]; key/value [sk, b, ng, hn]
        if packed_seq_params is not None:
            raise NotImplementedError("TorchCoreAttention takes packed sequences as a mask")
        sq = query.shape[0]
        if self.cp_size > 1:
            key, value = self._gather_kv(key), self._gather_kv(value)
            full = key.shape[0]
            rows = cp_chunk_index(self.cp_rank, self.cp_size, full)
            mask = attention_mask[:, :, rows, :]
        else:
            mask = attention_mask
        rep = self.heads // self.groups
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.scale,
        )
        b = out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _gather_kv(self, local: torch.Tensor) -> torch.Tensor:
        """[s_local, ...] on each CP rank -> [S, ...] in natural order. Backward sums the
        gradients of every rank's queries into each rank's own chunk."""
        parts = dist_fn.all_gather(local.contiguous(), group=self.cp_group)
        stacked = torch.cat(parts, dim=0)
        order = torch.argsort(cp_full_order(self.cp_size, stacked.shape[0]))
        return stacked.index_select(0, order)
