"""Routing replay for transformers' MoE routers: each token goes to the experts the rollout chose.

A token routed differently in training than in generation is the main source of the
train/rollout log-prob gap of MoE models ("R3": replay the rollout's routes). transformers'
Qwen2-MoE / Qwen3-MoE routers (`mlp.gate`, a `...TopKRouter`) return (logits, gates,
experts); a forward hook replaces gates and experts where a token has recorded experts:
the experts are the recorded ones, the gates the current softmax gathered at them
(renormalised over the k with `norm_topk_prob`), so the router still trains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from tephra.engine_api import batch as B
from tephra.engine_api.errors import BatchError


class RouterReplay:
    """The MoE routers of one transformers model (model order) and the routes they replay."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = [
            m
            for name, m in model.named_modules()
            if name.endswith("mlp.gate") and type(m).__name__.endswith("TopKRouter")
        ]
        self.targets: torch.Tensor | None = None
        """`[tokens, moe_layers, k]` int64 for the next forward, -1: the router's own."""
        self.chosen: list[torch.Tensor] = []
        """The experts each router chose in the last forward (tests compare them)."""
        for j, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(j))

    def _hook(self, j: int) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, args: Any, out: Any) -> Any:
            logits, gates, experts = out
            if self.targets is not None:
                target = self.targets[:, j].to(experts.device)
                recorded = (target >= 0).all(-1, keepdim=True)
                experts = torch.where(recorded, target, experts)
                probs = torch.softmax(logits.float(), dim=-1).gather(1, experts)
                if module.norm_topk_prob:
                    probs = probs / probs.sum(-1, keepdim=True)
                gates = torch.where(recorded, probs.to(gates.dtype), gates)
            if j == 0:
                self.chosen = []
            self.chosen.append(experts.detach())
            return logits, gates, experts

        return hook

    def check(self, batch: TensorDict) -> None:
        """A batch's `routed_experts` fits the model, else `BatchError` naming the field."""
        routes = batch[B.ROUTED_EXPERTS]
        if not self.routers:
            raise BatchError(
                "batch['routed_experts'] is for mixture-of-experts models; this model has no "
                "transformers top-k router (Qwen2-MoE / Qwen3-MoE): leave the field out"
            )
        top_k, experts = self.routers[0].top_k, self.routers[0].num_experts
        want = [*batch[B.INPUT_IDS].shape, len(self.routers), top_k]
        if list(routes.shape) != want:
            raise BatchError(
                f"batch['routed_experts'] has shape {list(routes.shape)}; this model needs "
                f"[batch, seq, moe_layers, top_k] = {want}"
            )
        if routes.numel() and (routes.min() < -1 or routes.max() >= experts):
            raise BatchError(
                f"batch['routed_experts'] holds ids outside [-1, {experts}): expert ids of "
                "this model, or -1 where nothing was recorded"
            )

    def set_micro_batch(self, mb: TensorDict, packed: bool) -> None:
        """Routes of micro-batch `mb` in the order the routers see its tokens (packed: the
        real tokens row by row; padded: every position of `[b, t]`); none without the field."""
        if B.ROUTED_EXPERTS not in mb.keys():
            self.targets = None
            return
        routes = mb[B.ROUTED_EXPERTS].long()
        attn = mb[B.ATTENTION_MASK].bool()
        if packed:
            self.targets = routes[attn]
        else:
            routes = torch.where(attn[..., None, None], routes, -1)
            self.targets = routes.reshape(-1, *routes.shape[2:])
