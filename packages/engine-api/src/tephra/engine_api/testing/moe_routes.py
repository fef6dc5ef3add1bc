"""Routing-replay references on a plain transformers MoE model (Qwen2-MoE / Qwen3-MoE).

`record_routes` is what a rollout records (each token's experts per MoE layer);
`forced_routes` makes the model's routers answer with given experts (gates from their own
logits), the reference a replaying engine must equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict

from tephra.engine_api import batch as B


def routers(model: Any) -> list[Any]:
    """The top-k routers (`mlp.gate`) of a transformers MoE causal LM, in layer order."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def log_probs(model: Any, batch: TensorDict) -> torch.Tensor:
    """`[b, t]` log-prob of each token under `model` (temperature 1), 0 off the response."""
    with torch.no_grad():
        logits: torch.Tensor = model(
            input_ids=batch[B.INPUT_IDS],
            attention_mask=batch[B.ATTENTION_MASK],
            position_ids=batch[B.POSITION_IDS],
        ).logits.float()
    logp = torch.log_softmax(logits, -1)
    ids = batch[B.INPUT_IDS]
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask: torch.Tensor = batch[B.RESPONSE_MASK]
    return lp * mask


def record_routes(model: Any, batch: TensorDict) -> torch.Tensor:
    """The model's own routes `[b, t, moe_layers, k]` on `batch`, -1 on padding."""
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in routers(model)]
    try:
        log_probs(model, batch)
    finally:
        for h in hooks:
            h.remove()
    b, t = batch[B.INPUT_IDS].shape
    routes = torch.stack([s.reshape(b, t, -1) for s in seen], dim=2)
    real = batch[B.ATTENTION_MASK].bool()[..., None, None]
    return torch.where(real, routes, torch.full_like(routes, -1))


@contextmanager
def forced_routes(model: Any, routes: torch.Tensor) -> Iterator[None]:
    """Inside, every router answers with `routes` `[b, t, moe_layers, k]` (a batch's whole
    `[b, t]`), gates the softmax of its own logits at them (renormalised with
    `norm_topk_prob`)."""
    hooks = []
    for j, router in enumerate(routers(model)):

        def hook(module: Any, args: Any, out: Any, j: int = j) -> Any:
            logits = out[0]
            idx = routes[:, :, j].reshape(-1, routes.shape[-1]).clamp(min=0)
            probs = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            if module.norm_topk_prob:
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(logits.dtype), idx

        hooks.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
