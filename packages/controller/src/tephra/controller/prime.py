"""PRIME in the RL loop: the step's implicit process rewards, outcome labels and advantages
(the reward model itself is an engine of the actor's workers)."""

from __future__ import annotations

import torch

from tephra.algos import implicit_process_rewards, masked_mean, prime_advantages
from tephra.algos.recipe_config import PrimeConfig


def prime_step(
    prm_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    section: PrimeConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages [batch, seq], outcome labels [batch], metrics) of one step: implicit
    process rewards from the reward model's and the reference's log-probs of the sampled
    tokens, labels from the scores, and PRIME's RLOO advantage of both."""
    process = implicit_process_rewards(prm_log_probs, ref_log_probs, response_mask, section.beta)
    labels = (scores >= section.label_threshold).to(torch.float32)
    adv = prime_advantages(
        process,
        scores,
        response_mask,
        group_ids,
        process_coef=section.process_coef,
        outcome_coef=section.outcome_coef,
    )
    sequence = process.sum(-1)
    metrics = {
        "prime/implicit_reward_token_mean": float(masked_mean(process, response_mask)),
        "prime/implicit_reward_seq_mean": float(sequence.mean()),
        "prime/label_mean": float(labels.mean()),
        # before this step's update: how well the reward model's sign predicts the label
        "prime/rm_acc_before": float(((sequence > 0) == (labels > 0.5)).float().mean()),
    }
    return adv, labels, metrics
