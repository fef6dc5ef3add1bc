"""Gather the full Hugging Face weights from every shard (TP, PP, EP), on every rank.

Each weight is first completed over the tensor-parallel group that splits it (TP, or expert
TP for experts) with `all_gather`, converted to HF names, then the pieces owned by different
pipeline stages and expert-parallel ranks are exchanged with one `all_gather_object`.
Experts are stacked into transformers' fused `[E, ...]` tensors at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from tephra.engine_megatron import hf_conversion as conv


def gather_hf_weights(engine, untie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    owned: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], torch.Tensor] = {}
    keep_local = (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )
    keep_expert = (
        ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    )
    with torch.no_grad():
        for chunk in engine.chunks:
            offsets = engine._layer_offsets(chunk)
            for name, param in chunk.named_parameters():
                m = conv.match(name, offsets)
                _, size, group = engine._shard_coords(m)
                if m.kind == "rep" or size == 1:
                    shards = [param.detach()]
                else:
                    shards = [torch.empty_like(param) for _ in range(size)]
                    dist.all_gather(shards, param.detach().contiguous(), group=group)
                pieces = conv.from_megatron(m, [s.clone() for s in shards], engine._heads)
                if m.is_expert:
                    if keep_expert:
                        for hf_name, t in pieces.items():
                            experts[(hf_name, engine._global_expert(m))] = t
                elif keep_local:
                    owned.update(pieces)
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (owned, experts))
    full: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for rank_owned, rank_experts in everything:
        full.update(rank_owned)
        for (hf_name, e), t in rank_experts.items():
            stacked.setdefault(hf_name, {})[e] = t
    for hf_name, by_expert in stacked.items():
        full[hf_name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if engine.shape.tie_word_embeddings and engine.config.model.role == "policy":
        full.pop("lm_head.weight", None)
        if untie_word_embeddings:
            full["lm_head.weight"] = full["model.embed_tokens.weight"]
    return dict(sorted(full.items(), key=lambda kv: _hf_order(kv[0])))


def _hf_order(name: str):
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)
