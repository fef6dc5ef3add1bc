"""Critic loss: clipped value regression (PPO, Schulman et al. 2017; as in OpenAI baselines).

    V_clip_t = V_old_t + clip(V_t - V_old_t, -eps_v, eps_v)
    L_t = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)
with R the returns from `compute_advantages` and eps_v = `cliprange_value` (None: no clip,
L_t = 0.5 (V_t - R_t)^2). The max makes clipping pessimistic: it never lowers the loss.
"""

from __future__ import annotations

import torch

from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(per-token loss [batch, seq], metrics `vf_clipfrac`, `vpred_mean`, `vf_explained_var`)."""
    check_same_shape(
        values=values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    unclipped = (values - returns).square()
    if cliprange_value is None:
        loss = 0.5 * unclipped
        clipfrac = 0.0
    else:
        v_clip = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        clipped = (v_clip - returns).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = float(masked_mean((clipped > unclipped).to(values.dtype), response_mask))
    v = values.detach()
    resid_var = masked_mean(
        (returns - v - masked_mean(returns - v, response_mask)).square(), response_mask
    )
    ret_var = masked_mean((returns - masked_mean(returns, response_mask)).square(), response_mask)
    metrics = {
        "vf_clipfrac": clipfrac,
        "vpred_mean": float(masked_mean(v, response_mask)),
        "vf_explained_var": float(1.0 - resid_var / ret_var.clamp(min=1e-8)),
    }
    return loss, metrics
