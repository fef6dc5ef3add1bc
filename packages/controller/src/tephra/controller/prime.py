"""PRIME in the RL loop: its config section and the step's implicit process rewards and
advantages (the reward model itself is an engine of the actor's workers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tephra.algos import implicit_process_rewards, masked_mean, prime_advantages
from tephra.engine_api.errors import ConfigError


@dataclass
class PrimeSection:
    """PRIME (Cui et al. 2025): an implicit process reward model, initialised from the
    policy and trained online on outcome labels, gives every response token the reward
    beta * log(pi_rm / pi_ref); with the outcome reward it forms an RLOO advantage
    (tephra.algos.prime_advantages) that replaces `algorithm.adv_estimator`'s."""

    enabled: bool = False
    """Turn PRIME on (builds the reward model beside the actor, and the reference)."""
    beta: float = 0.05
    """beta of the implicit reward beta * (log pi_rm - log pi_ref) (PRIME's 0.05)."""
    process_coef: float = 5.0
    """Weight of the implicit process rewards in the advantage (verl's reward_dpo_coef)."""
    outcome_coef: float = 5.0
    """Weight of the outcome reward in the advantage (verl's reward_gt_coef)."""
    label_threshold: float = 1.0
    """A sample's outcome label for the reward model's cross-entropy is 1 when its score is
    at least this, else 0 (the default: a verifier's 1.0 means correct)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ConfigError(f"algorithm.prime.beta={self.beta} must be > 0 (PRIME uses 0.05)")
        for name in ("process_coef", "outcome_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"algorithm.prime.{name}={value} must be a finite number >= 0")
        if self.enabled and self.process_coef == 0 and self.outcome_coef == 0:
            raise ConfigError(
                "algorithm.prime: process_coef and outcome_coef are both 0, so every "
                "advantage is 0; set one > 0 (PRIME's recipe uses 5 and 5)"
            )


def prime_step(
    prm_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    section: PrimeSection,
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
