"""Routing replay for MoE layers: the router sends each token to the experts the rollout chose.

A token routed differently in training than in generation is the main source of the
train/rollout log-prob gap of MoE models ("R3": replay the rollout's routes). megatron's
top-k asks its router's `router_replay` object for the top-k; `Replay` answers with the
recorded experts where a token has them (gates: the current scores gathered at those
experts, so the router still trains) and the router's own choice elsewhere.

Layout: the batch's `routed_experts` `[b, t, moe_layers, k]` is laid out like the model's
tokens for one micro-batch (`replay_targets`): packed or padded rows, megatron's `[s, b]`
token order, this rank's context-parallel chunks and sequence-parallel slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state as ps
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.errors import BatchError
from tephra.engine_megatron.core_attention import cp_chunk_index
from tephra.engine_megatron.micro_batches import ModelInputs

if TYPE_CHECKING:
    from tephra.engine_megatron.model_builder import TephraGPT


class Replay:
    """Stands in for megatron's `RouterReplay` on one router (`router.router_replay`)."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        """`[tokens, k]` int64 experts to use, -1 rows: the router's own top-k; None: own."""
        self.chosen: torch.Tensor | None = None
        """The experts chosen in the last forward (tests compare them with the record)."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        values, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.target is None:
            self.chosen = own.detach()
            return values, own
        target = self.target.to(scores.device)
        recorded = (target >= 0).all(-1, keepdim=True)
        chosen = torch.where(recorded, target, own)
        self.chosen = chosen.detach()
        return scores.gather(1, chosen), chosen


def attach(chunks: Sequence[TephraGPT]) -> dict[int, list[tuple[int, Replay]]]:
    """Give every router of `chunks` a `Replay`; returns {id(chunk): [(global layer, replay)]}."""
    out: dict[int, list[tuple[int, Replay]]] = {}
    for chunk in chunks:
        entries = []
        for layer in chunk.gpt.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.router_replay = Replay()
                entries.append((layer.layer_number - 1, router.router_replay))
        out[id(chunk)] = entries
    return out


def check_routes(batch: TensorDict, moe_layers: int, top_k: int, num_experts: int) -> None:
    """A batch's `routed_experts` fits the model, else `BatchError` naming the field."""
    routes = batch[B.ROUTED_EXPERTS]
    want = [*batch[B.INPUT_IDS].shape, moe_layers, top_k]
    if list(routes.shape) != want:
        raise BatchError(
            f"batch['routed_experts'] has shape {list(routes.shape)}; this model needs "
            f"[batch, seq, moe_layers, top_k] = {want}"
        )
    if routes.dtype not in (torch.int64, torch.int32):
        raise BatchError(
            f"batch['routed_experts'] must hold integer expert ids, got {routes.dtype}"
        )
    if routes.numel() and (routes.min() < -1 or routes.max() >= num_experts):
        raise BatchError(
            f"batch['routed_experts'] holds ids outside [-1, {num_experts}): expert ids of "
            "this model, or -1 where nothing was recorded"
        )


def replay_targets(x: ModelInputs, routes: torch.Tensor, sp_size: int) -> torch.Tensor:
    """`routes` `[b, t, L, k]` of one micro-batch -> `[tokens, L, k]` in the order megatron's
    routers see this rank's tokens (-1 on padding positions)."""
    rows = x.input_ids.shape[0]
    s = x.seq_length
    layers, k = routes.shape[2:]
    full = torch.full((rows * s, layers, k), -1, dtype=torch.int64)
    index = x.token_index.cpu()
    valid = index >= 0
    full[index[valid]] = routes[valid].long()
    full = full.view(rows, s, layers, k)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        full = full[:, cp_chunk_index(ps.get_context_parallel_rank(), cp, s)]
    full = full.transpose(0, 1)  # megatron's hidden states are [s, b, h]
    if sp_size > 1:
        full = full.chunk(sp_size, dim=0)[ps.get_tensor_model_parallel_rank()]
    return full.reshape(-1, layers, k).contiguous()
