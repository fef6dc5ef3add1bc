"""Per-segment causal attention for megatron's `SelfAttention` (no dense mask), with kernels.

The model is told which positions attend to which by an attention *plan*, never by a
`[b, 1, S, S]` mask: an int64 tensor `[n, 5]` of blocks `(row, q0, q1, k0, k1)`. Block j says
that local query positions `q0 .. q1-1` of row `row` (a contiguous run inside one sequence)
attend causally to key positions `k0 .. k1-1` of the full sequence, bottom-right aligned (the
last query sees key `k1-1`). Without context parallelism a block is one whole sequence
(`q0 = k0`, `q1 = k1`): plain causal attention over that sequence. Padding positions form
blocks of their own (their outputs are never read). The plan is a tensor, not an object, so
that megatron's activation recomputation can save it like any other argument.

Kernels (chosen once per engine, see `choose_kernel`), all with grouped-query attention
through the kernel's own grouped heads (no `repeat_interleave` of keys/values):
- `torch`: one `scaled_dot_product_attention(..., enable_gqa=True)` per block. On CPU it runs
  torch's flash kernel (no `[L, L]` scores; logsumexp kept for backward), on CUDA torch's own
  flash/memory-efficient kernels. Runs everywhere and is the only one with context parallel.
- `flash_attn`: `flash_attn_varlen_func` over the THD layout with `cu_seqlens` (CUDA, bf16/fp16).
- `transformer_engine`: TransformerEngine's `DotProductAttention` in `thd` format (CUDA).

Context parallel (cp > 1, torch kernel): the sequence is laid out as in megatron (load
balanced): cut into 2*cp chunks, CP rank r holds chunks r and 2*cp-1-r. Attention runs as a
ring: each rank's keys and values pass from rank to rank (cp - 1 shifts, gradients flowing
back the same way), each rank attends its queries to every chunk as it passes (only the
keys each plan block may see: its own sequence, causally) and merges the partial results by
their log-sum-exp. No rank holds the full K/V.

Math per block: out = softmax(q k^T * scale + causal) v, the heads of one query group sharing
one key/value head.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from tephra.engine_api.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

KERNELS = ("torch", "flash_attn", "transformer_engine")


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


def attention_plan(segments: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks `[n, 5]` = (row, q0, q1, k0, k1) for `segments` `[rows, S]` (a sequence id
    per position, -1 for padding; each sequence contiguous within its row). `local`: the
    natural positions this rank holds, in local order (context parallel); None = all."""
    rows, s = segments.shape
    idx = torch.arange(s)
    nat = idx if local is None else local
    blocks = []
    for r in range(rows):
        seg = segments[r]
        new_run = torch.ones(s, dtype=torch.bool)
        new_run[1:] = seg[1:] != seg[:-1]
        run_start = torch.cummax(torch.where(new_run, idx, 0), 0).values
        # a local run breaks where the natural position jumps or a new sequence starts
        brk = torch.ones(len(nat), dtype=torch.bool)
        brk[1:] = (nat[1:] != nat[:-1] + 1) | (run_start[nat[1:]] != run_start[nat[:-1]])
        q0 = brk.nonzero().flatten()
        q1 = torch.cat([q0[1:], torch.tensor([len(nat)])])
        k0 = run_start[nat[q0]]
        k1 = nat[q1 - 1] + 1
        blocks.append(torch.stack([torch.full_like(q0, r), q0, q1, k0, k1], dim=1))
    return torch.cat(blocks)


def _torch_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: list[list[int]],
    scale: float,
    dropout_p: float,
    window: int | None = None,
) -> torch.Tensor:
    """q `[sq, b, np, hn]`, k/v `[sk, b, ng, hn]` -> `[sq, b, np, hn]`, one SDPA per block.
    `window` (sliding-window layers): a query sees itself and the `window - 1` keys before
    it; a block longer than the window runs in query tiles of `window` rows against the
    `2 * window - 1` keys they can see (masks of tile size, never of the block's)."""
    per_row: dict[int, list[torch.Tensor]] = {}
    for row, q0, q1, k0, k1 in plan:
        if window is not None and k1 - k0 > window:
            per_row.setdefault(row, []).append(
                _windowed_block(
                    q[q0:q1, row], k[k0:k1, row], v[k0:k1, row], window, scale, dropout_p
                )
            )
            continue
        qb = q[q0:q1, row].transpose(0, 1)[None]  # [1, np, lq, hn]
        kb = k[k0:k1, row].transpose(0, 1)[None]
        vb = v[k0:k1, row].transpose(0, 1)[None]
        lq, lk = q1 - q0, k1 - k0
        mask = None
        if lq != lk:  # bottom-right causal: a query run that starts inside its sequence
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        out = F.scaled_dot_product_attention(
            qb,
            kb,
            vb,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=True,
        )
        per_row.setdefault(row, []).append(out[0].transpose(0, 1))  # [lq, np, hn]
    return torch.stack([torch.cat(per_row[r]) for r in range(q.shape[1])], dim=1)


def _windowed_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, dropout_p: float
) -> torch.Tensor:
    """One bottom-right-causal block (q `[lq, np, hn]`, k/v `[lk, ng, hn]`, query i at key
    position lk - lq + i) with a sliding window: key j is seen by query position p when
    p - window < j <= p (transformers' `kv_idx > q_idx - sliding_window`)."""
    lq, lk = q.shape[0], k.shape[0]
    off = lk - lq
    outs = []
    for a in range(0, lq, window):
        b = min(a + window, lq)
        k_lo, k_hi = max(0, off + a - window + 1), off + b  # keys any query of the tile sees
        pos = torch.arange(off + a, off + b, device=q.device)[:, None]
        keys = torch.arange(k_lo, k_hi, device=q.device)[None, :]
        mask = (keys <= pos) & (keys > pos - window)  # [tile, <= 2 * window - 1]
        out = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None],
            k[k_lo:k_hi].transpose(0, 1)[None],
            v[k_lo:k_hi].transpose(0, 1)[None],
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=True,
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


class _RingShift(torch.autograd.Function):
    """Send `x` to the next CP rank and receive the previous rank's; the backward sends
    the gradient the other way round."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranks: list[int], me: int) -> torch.Tensor:
        ctx.ranks, ctx.me = ranks, me
        return _shift(x.contiguous(), ranks, me, +1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _shift(grad.contiguous(), ctx.ranks, ctx.me, -1), None, None


def _shift(x: torch.Tensor, ranks: list[int], me: int, step: int) -> torch.Tensor:
    cp = len(ranks)
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, ranks[(me + step) % cp]),
        dist.P2POp(dist.irecv, out, ranks[(me - step) % cp]),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def _ring_blocks(
    q: torch.Tensor,
    kv_chunks: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    plan: list[list[int]],
    local: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Ring attention: `kv_chunks` yields `(src, k, v)`, CP rank src's keys/values
    `[s_local, b, ng, hn]` (its positions `cp_chunk_index(src, ...)`), one rank after the
    other. Each plan block's queries attend to the part of every chunk they may see; the
    partial results merge by their log-sum-exp:
        lse = log(exp(lse_a) + exp(lse_b)),  out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)
    so the result equals softmax over all keys at once. Returns `[sq, b, np, hn]`."""
    np_, hn = q.shape[2], q.shape[3]
    cp = seq_len // len(local)
    acc: dict[
        int, tuple[torch.Tensor, torch.Tensor]
    ] = {}  # per block: (out [ng, rep, lq, hn], lse [ng, rep, lq])
    # every chunk joins the graph, seen or not: the ring's backward is a collective, and a
    # rank whose queries see nothing of a chunk would otherwise skip its shift's backward
    touch = q.new_zeros(())
    for src, k, v in kv_chunks:
        touch = touch + (k.sum() + v.sum()) * 0.0
        ng = k.shape[2]
        rep = np_ // ng
        nat = cp_chunk_index(src, cp, seq_len)
        half = len(nat) // 2
        for j, (row, q0, q1, k0, k1) in enumerate(plan):
            p0, lq = int(local[q0]), q1 - q0
            if j not in acc:
                acc[j] = (
                    q.new_zeros(ng, rep, lq, hn),
                    q.new_full((ng, rep, lq), float("-inf")),
                )
            for off in (0, half):  # the chunk's two contiguous runs of positions
                a0 = int(nat[off])
                a, b = max(k0, a0), min(k1, a0 + half)
                qs = max(0, a - p0)  # queries before key a see nothing of this run
                if a >= b or qs >= lq:
                    continue
                qb = q[q0 + qs : q1, row].transpose(0, 1).reshape(ng, rep, lq - qs, hn)
                kb = k[off + a - a0 : off + b - a0, row].transpose(0, 1)[:, None]
                vb = v[off + a - a0 : off + b - a0, row].transpose(0, 1)[:, None]
                scores = (qb @ kb.transpose(-1, -2)) * scale  # [ng, rep, lq', lk']
                qpos = torch.arange(p0 + qs, p0 + lq, device=q.device)
                kpos = torch.arange(a, b, device=q.device)
                scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
                lse_part = torch.logsumexp(scores, -1)
                out_part = torch.softmax(scores, -1) @ vb
                out_acc, lse_acc = acc[j]
                new = torch.logaddexp(lse_acc[..., qs:], lse_part)
                merged = out_acc[..., qs:, :] * (lse_acc[..., qs:] - new).exp()[..., None]
                merged = merged + out_part * (lse_part - new).exp()[..., None]
                acc[j] = (
                    torch.cat([out_acc[..., :qs, :], merged], dim=2),
                    torch.cat([lse_acc[..., :qs], new], dim=2),
                )
    per_row: dict[int, list[torch.Tensor]] = {}
    for j, (row, *_) in enumerate(plan):
        out, _ = acc[j]
        per_row.setdefault(row, []).append(out.reshape(np_, -1, hn).transpose(0, 1))
    return torch.stack([torch.cat(per_row[r]) for r in range(q.shape[1])], dim=1) + touch


def _thd(x: torch.Tensor) -> torch.Tensor:
    """`[s, b, h, d]` -> `[b * s, h, d]` (rows one after the other)."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def _cu_seqlens(plan: torch.Tensor, s: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """THD boundaries of the blocks (each a whole sequence without context parallel)."""
    starts = plan[:, 0] * s + plan[:, 1]
    total = torch.tensor([int(plan[:, 0].max() + 1) * s])
    cu = torch.cat([starts, total]).to(device=device, dtype=torch.int32)
    return cu, int((plan[:, 2] - plan[:, 1]).max())


def choose_kernel(requested: str, dtype: torch.dtype, on_cuda: bool, cp_size: int) -> str:
    """The kernel for `model.attn_implementation` = `requested`: `sdpa` picks the best one
    installed (flash-attn, then TransformerEngine, on CUDA in bf16/fp16 without context
    parallel; torch otherwise); `flash_attention_2` insists on flash-attn and is refused
    clearly where it cannot run."""
    half = dtype in (torch.bfloat16, torch.float16)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if requested == "flash_attention_2":
        why = (
            "flash-attn is not installed"
            if not has_flash
            else "there is no CUDA device"
            if not on_cuda
            else "flash-attn needs bf16 or fp16 (set precision.param_dtype=bfloat16)"
            if not half
            else "context parallel runs the torch kernel (set parallel.context=1)"
            if cp_size > 1
            else None
        )
        if why:
            raise ConfigError(
                f"model.attn_implementation='flash_attention_2' cannot run here: {why}; "
                "or set model.attn_implementation=sdpa (picks the best installed kernel)"
            )
        return "flash_attn"
    if requested != "sdpa":
        raise ConfigError(
            f"model.attn_implementation={requested!r}: engine-megatron runs 'sdpa' (the best "
            "installed kernel) or 'flash_attention_2' (flash-attn only)"
        )
    if on_cuda and half and cp_size == 1:
        if has_flash:
            return "flash_attn"
        if has_te:
            return "transformer_engine"
    return "torch"


class SegmentAttention(MegatronModule):
    """Drop-in `core_attention` (same constructor and forward as megatron's
    `DotProductAttention`); `attention_mask` is the plan `[n, 5]` (see the module doc)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object = None,
        kernel: str = "torch",
        window: int | None = None,
        v_channels: int | None = None,
        **_: object,
    ) -> None:
        super().__init__(config=config)
        if kernel not in KERNELS:
            raise ConfigError(f"attention kernel {kernel!r}: expected one of {list(KERNELS)}")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.kernel = kernel
        # sliding-window layer (Mistral, Gemma-3's local layers): the torch kernel without
        # context parallel applies it; elsewhere the engine refuses sequences past it
        self.window = window
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        # the value head's size: MLA's query/key heads are larger (nope + RoPE parts), and
        # megatron's MLA passes its own softmax scale
        self.head_dim = v_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self._te: Any = None
        if kernel == "transformer_engine":
            # optional heavy dependency, only where installed (CUDA machines)
            import transformer_engine.pytorch as te

            self._te = te.DotProductAttention(
                self.heads,
                self.head_dim,
                num_gqa_groups=self.groups,
                attention_dropout=self.dropout_p,
                qkv_format="thd",
                attn_mask_type="padding_causal",
                softmax_scale=self.scale,
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        # query [sq, b, np, hn]; key/value [sk, b, ng, hn]; attention_mask: the plan [n, 5]
        if packed_seq_params is not None:
            raise NotImplementedError("SegmentAttention takes packed sequences as its plan")
        sq, b = query.shape[:2]
        dropout_p = self.dropout_p if self.training else 0.0
        if self.kernel == "torch" and self.cp_size > 1:
            # no dropout here: `transformer_config` always builds with attention_dropout=0
            out = _ring_blocks(
                query,
                self._ring(key, value),
                attention_mask.tolist(),
                cp_chunk_index(self.cp_rank, self.cp_size, sq * self.cp_size),
                sq * self.cp_size,
                self.scale,
            )
        elif self.kernel == "torch":
            out = _torch_blocks(
                query, key, value, attention_mask.tolist(), self.scale, dropout_p, self.window
            )
        else:
            cu, max_len = _cu_seqlens(attention_mask, sq, query.device)
            q, k, v = _thd(query), _thd(key), _thd(value)
            if self.kernel == "flash_attn":
                # optional heavy dependency, only where installed (CUDA machines)
                from flash_attn import flash_attn_varlen_func

                out = flash_attn_varlen_func(
                    q, k, v, cu, cu, max_len, max_len, dropout_p, self.scale, causal=True
                )
            else:
                out = self._te(
                    q,
                    k,
                    v,
                    cu_seqlens_q=cu,
                    cu_seqlens_kv=cu,
                    max_seqlen_q=max_len,
                    max_seqlen_kv=max_len,
                )
            out = out.reshape(b, sq, self.heads, self.head_dim).transpose(0, 1)
        return out.reshape(sq, b, self.heads * self.head_dim)

    def _ring(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """This rank's keys/values, then each other CP rank's in turn, passed around the ring
        (one message of K and V together per step: gloo may swap two sends to one peer)."""
        ranks = parallel_state.get_context_parallel_global_ranks()
        kv = torch.cat([key, value], dim=-1)
        hn = key.shape[-1]
        for step in range(self.cp_size):
            if step:
                kv = _RingShift.apply(kv, ranks, self.cp_rank)
            yield (self.cp_rank - step) % self.cp_size, kv[..., :hn], kv[..., hn:]
