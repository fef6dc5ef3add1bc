"""Rollout-training mismatch: truncated importance sampling (TIS) and mismatch metrics.

The rollout engine (vLLM, SGLang) and the training engine compute slightly different
probabilities for the same tokens (kernels, precision, batching), so rollouts are
off-policy for the trainer. Truncated importance sampling (Yao et al. 2025, "Your Efficient
RL Framework Secretly Brings You Off-Policy RL Training"; Ionides 2008 for truncation)
reweights each token's policy loss by
    token:    w_t = min(pi_old(y_t) / pi_rollout(y_t), C)
    sequence: w_t = min(prod_{t' in response} pi_old(y_t') / pi_rollout(y_t'), C)   (every t)
with pi_old the training engine's log-probs before the update (`old_log_probs`) and
pi_rollout the rollout engine's (`rollout_log_probs`). Weights carry no gradient.
"""

from __future__ import annotations

import math

import torch

from tephra.algos.errors import InputError
from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_max, masked_mean, masked_sum


def mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's probabilities are from the trainer's ([batch, seq]):
    `mismatch/k1` and `mismatch/k3`: estimates of KL(pi_rollout || pi_old) from the rollout
    samples (k1 = mean(log pi_rollout - log pi_old), k3 = mean(rho - 1 - log rho) with
    rho = pi_old / pi_rollout); `mismatch/max_abs_log_ratio`; `mismatch/seq_log_ratio_mean`
    (mean over sequences of sum_t log rho_t); `mismatch/ppl_ratio` (trainer perplexity /
    rollout perplexity over all response tokens)."""
    check_same_shape(
        old_log_probs=old_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    log_rho = (old_log_probs - rollout_log_probs).detach()
    has = (response_mask > 0).any(-1)
    seq = masked_sum(log_rho, response_mask, dim=-1)
    return {
        "mismatch/k1": float(masked_mean(-log_rho, response_mask)),
        "mismatch/k3": float(
            masked_mean(torch.expm1(log_rho.clamp(max=20.0)) - log_rho, response_mask)
        ),
        "mismatch/max_abs_log_ratio": float(masked_max(log_rho.abs(), response_mask)),
        "mismatch/seq_log_ratio_mean": float(seq[has].sum() / has.sum().clamp(min=1)),
        "mismatch/ppl_ratio": float(torch.exp(-masked_mean(log_rho, response_mask))),
    }


def truncated_importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights [batch, seq], metrics): truncated importance weights at `level` (`token` or
    `sequence`), 0 where the mask is 0, plus `mismatch_metrics` and `tis/weight_mean`,
    `tis/frac_truncated` (share of tokens, or of sequences, whose weight hit `threshold`)."""
    if level not in ("token", "sequence"):
        raise InputError(f"level={level!r} is not allowed; choose 'token' or 'sequence'")
    if not threshold > 1.0:
        raise InputError(f"threshold={threshold!r} must be > 1 (the truncation C)")
    metrics = mismatch_metrics(old_log_probs, rollout_log_probs, response_mask)
    log_rho = torch.where(
        response_mask > 0,
        (old_log_probs - rollout_log_probs).detach(),
        torch.zeros_like(old_log_probs),
    )
    log_c = math.log(threshold)
    if level == "token":
        truncated = log_rho > log_c
        weights = torch.exp(log_rho.clamp(max=log_c))
        metrics["tis/frac_truncated"] = float(
            masked_mean(truncated.to(weights.dtype), response_mask)
        )
    else:
        seq = log_rho.sum(-1)
        has = (response_mask > 0).any(-1)
        weights = torch.exp(seq.clamp(max=log_c)).unsqueeze(-1).expand_as(log_rho)
        truncated = (seq > log_c) & has
        metrics["tis/frac_truncated"] = float(truncated.sum() / has.sum().clamp(min=1))
    weights = torch.where(response_mask > 0, weights, torch.zeros_like(weights))
    metrics["tis/weight_mean"] = float(masked_mean(weights, response_mask))
    return weights, metrics
