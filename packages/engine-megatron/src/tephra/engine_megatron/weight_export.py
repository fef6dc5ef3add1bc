"""Stream the full Hugging Face weights out of the shards (TP, PP, EP), one tensor at a time.

No rank ever holds the whole model. The export walks in steps: at step j every rank takes
its j-th parameter, completes it over the tensor-parallel group that splits it (TP, or
expert TP for experts) with `all_gather`, and converts it to HF names; then each rank that
keeps such a piece (data-parallel rank 0, TP rank 0 of its stage / expert-parallel rank)
sends it on, one tensor after another: `broadcast` to every rank (`dest=None`: the rollout's
`export_weights`, whose contract gives every rank full tensors) or point-to-point to one
rank (`dest=0`: `export_hf`, which only rank 0 writes). A rank therefore holds at most its
own shards, the pieces of one step and, for a mixture-of-experts layer, the experts of
one fused HF tensor until the last of them arrives (transformers 5 stores the experts of a
layer as one `[E, ...]` tensor).

Which rank sends what (names, shapes, dtypes) is exchanged once up front with
`all_gather_object` of that small table, never of tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from tephra.engine_megatron import hf_conversion as conv
from tephra.engine_megatron import lora

if TYPE_CHECKING:
    from tephra.engine_api.config import EngineConfig
    from tephra.engine_megatron.model_builder import ModelShape, TephraGPT


class ShardedModel(Protocol):
    """What the export reads of a `MegatronEngine` (which imports this module)."""

    config: EngineConfig
    shape: ModelShape
    chunks: list[TephraGPT]
    device: torch.device

    @property
    def _heads(self) -> conv.Heads: ...

    def _layer_offsets(self, chunk: TephraGPT) -> dict[int, int]: ...

    def _shard_coords(self, m: conv.Match) -> tuple[int, int, object]: ...

    def _global_expert(self, m: conv.Match) -> int | None: ...

    def exported_value(self, param: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Piece:
    """One HF tensor (or one expert's slice of a fused one) that one rank sends."""

    hf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: int | None  # the global expert index of a slice of a fused `[E, ...]` tensor


def _local_params(engine: ShardedModel) -> list[tuple[str, torch.Tensor, conv.Match]]:
    out: list[tuple[str, torch.Tensor, conv.Match]] = []
    for chunk in engine.chunks:
        offsets = engine._layer_offsets(chunk)
        for name, param in chunk.hf_weights():
            if lora.is_adapter(name):
                continue  # merged into the weight they adapt (`engine.exported_value`)
            out.append((name, param, conv.match(name, offsets, engine.shape.model_type)))
    return out


def _keeps(engine: ShardedModel, m: conv.Match) -> bool:
    """Whether this rank sends the HF pieces of `m` (one replica of each sends)."""
    if m.is_expert:
        return ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    return (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )


def _skipped(engine: ShardedModel, hf_name: str) -> bool:
    """The tied output layer's copy on the last pipeline stage: HF names it nowhere."""
    tied = engine.shape.tie_word_embeddings and engine.config.model.role == "policy"
    return tied and hf_name == "lm_head.weight"


def _pieces(
    engine: ShardedModel, param: torch.Tensor, m: conv.Match, shards: list[torch.Tensor]
) -> list[tuple[Piece, torch.Tensor]]:
    """[(Piece, tensor)] of the HF tensors of `m` from its TP `shards` (meta shards give the
    table without data)."""
    pieces = conv.from_megatron(m, shards, engine._heads)
    expert = engine._global_expert(m) if m.is_expert else None
    return [
        (Piece(n, tuple(t.shape), t.dtype, expert), t)
        for n, t in pieces.items()
        if not _skipped(engine, n)
    ]


class HFStream:
    """The full HF tensors of `engine`, streamed: `names()` lists them (name, shape, dtype)
    on every rank before any data moves; iterating yields `(hf_name, tensor)` on every rank
    (`dest=None`) or on rank `dest` alone (the others yield nothing but must iterate: the
    transfers are collective). `per_expert`: experts one by one under checkpoint names
    (`experts.{e}.gate_proj.weight`, ...) instead of transformers' fused in-memory tensors."""

    def __init__(
        self,
        engine: ShardedModel,
        dest: int | None = None,
        untie_word_embeddings: bool = False,
        per_expert: bool = False,
    ) -> None:
        self.engine, self.dest, self.per_expert = engine, dest, per_expert
        self.tie_copy = untie_word_embeddings and engine.shape.tie_word_embeddings
        self.local = _local_params(engine)
        table: list[list[Piece]] = []  # per local parameter: the pieces this rank sends
        for _, param, m in self.local:
            _, size, _ = engine._shard_coords(m)
            if not _keeps(engine, m):
                table.append([])
                continue
            n = 1 if (m.kind == "rep" or size == 1) else size
            meta = [torch.empty(param.shape, dtype=param.dtype, device="meta")] * n
            table.append([p for p, _ in _pieces(engine, param, m, meta)])
        self.tables: list[list[list[Piece]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(self.tables, table)

    def names(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Every tensor the stream yields, in its order (fused experts: `[E, ...]`)."""
        out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        experts: dict[str, int] = {}  # fused HF tensor -> how many of its experts came
        steps = max(len(t) for t in self.tables)
        for j in range(steps):
            for src_table in self.tables:
                for piece in src_table[j] if j < len(src_table) else []:
                    if piece.expert is None:
                        out.append((piece.hf_name, piece.shape, piece.dtype))
                        if self.tie_copy and piece.hf_name == "model.embed_tokens.weight":
                            out.append(("lm_head.weight", piece.shape, piece.dtype))
                        continue
                    if self.per_expert:
                        meta = torch.empty(piece.shape, dtype=piece.dtype, device="meta")
                        split = conv.expert_checkpoint_split(piece.hf_name, piece.expert, meta)
                        out += [(n, tuple(t.shape), t.dtype) for n, t in split.items()]
                        continue
                    seen = experts.setdefault(piece.hf_name, 0) + 1
                    experts[piece.hf_name] = seen
                    if seen == self.engine.shape.num_experts:
                        out.append((piece.hf_name, (seen, *piece.shape), piece.dtype))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        engine, dest = self.engine, self.dest
        me = dist.get_rank()
        experts: dict[str, dict[int, torch.Tensor]] = {}
        steps = max(len(t) for t in self.tables)
        with torch.no_grad():
            for j in range(steps):
                mine: list[torch.Tensor] = []
                if j < len(self.local):
                    _, param, m = self.local[j]
                    _, size, group = engine._shard_coords(m)
                    value = engine.exported_value(param)
                    if m.kind == "rep" or size == 1:
                        shards = [value]
                    else:
                        shards = [torch.empty_like(value) for _ in range(size)]
                        dist.all_gather(shards, value.contiguous(), group=group)
                    del value
                    if _keeps(engine, m):
                        # a copy: what is yielded must not alias the live parameter
                        mine = [
                            t.clone(memory_format=torch.contiguous_format)
                            for _, t in _pieces(engine, param, m, shards)
                        ]
                    del shards
                for src, src_table in enumerate(self.tables):
                    if j >= len(src_table):
                        continue
                    for k, piece in enumerate(src_table[j]):
                        tensor = _move(piece, mine[k] if src == me else None, src, me, dest, engine)
                        if tensor is None:  # not received on this rank
                            continue
                        if piece.expert is None:
                            yield piece.hf_name, tensor
                            if self.tie_copy and piece.hf_name == "model.embed_tokens.weight":
                                yield "lm_head.weight", tensor
                            continue
                        if self.per_expert:
                            split = conv.expert_checkpoint_split(
                                piece.hf_name, piece.expert, tensor
                            )
                            yield from split.items()
                            continue
                        by_expert = experts.setdefault(piece.hf_name, {})
                        by_expert[piece.expert] = tensor
                        if len(by_expert) == engine.shape.num_experts:
                            del experts[piece.hf_name]
                            stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
                            yield piece.hf_name, stacked
                del mine


def _move(
    piece: Piece,
    tensor: torch.Tensor | None,
    src: int,
    me: int,
    dest: int | None,
    engine: ShardedModel,
) -> torch.Tensor | None:
    """The piece's tensor from rank `src`: broadcast to all (`dest=None`) or sent to `dest`.
    Returns it where it arrives (and on `src`), None elsewhere."""
    if dest is None:
        if src != me:
            tensor = torch.empty(piece.shape, dtype=piece.dtype, device=engine.device)
        assert tensor is not None  # the sender passes its tensor
        dist.broadcast(tensor, src=src)
        return tensor
    if src == dest:
        return tensor if me == src else None
    if me == src:
        assert tensor is not None  # the sender passes its tensor
        dist.send(tensor, dst=dest)
        return None
    if me == dest:
        tensor = torch.empty(piece.shape, dtype=piece.dtype, device=engine.device)
        dist.recv(tensor, src=src)
        return tensor
    return None


def gather_hf_weights(
    engine: ShardedModel, untie_word_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """Every full HF tensor on every rank, as a dict in HF order (tests and small models)."""
    full = dict(HFStream(engine, None, untie_word_embeddings))
    return dict(sorted(full.items(), key=lambda kv: hf_order(kv[0])))


def hf_order(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)
