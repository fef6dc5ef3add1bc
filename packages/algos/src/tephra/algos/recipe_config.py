"""Typed, validated configuration of the recipes beside the advantage estimators: on-policy
distillation's teacher, PRIME's implicit process reward and SPIN's self-play (sections of the
trainer's `algorithm`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tephra.algos.errors import ConfigError


@dataclass
class DistillationConfig:
    """A teacher model scores the student's sampled tokens (on-policy distillation); its
    per-token reverse KL enters the advantage (`advantage_coef`) or the actor's loss
    (`actor.objective.distill_loss_coef`), beside or instead of the RL reward."""

    teacher_path: str | None = None
    """The teacher: a local Hugging Face folder (or `smollm2`, `tiny`) whose tokenizer is the
    student's (checked before Ray starts). Built forward-only beside the reference policy;
    None (default): no teacher."""
    advantage_coef: float = 0.0
    """Add coef * (log q(y_t) - log pi_old(y_t)) to each response token's advantage (q the
    teacher, pi_old the student that sampled y; tephra.algos.distillation_advantages).
    0 (default): the teacher enters only through `actor.objective.distill_loss_coef`."""
    rl_advantage: bool = True
    """Keep the estimator's advantages (from the reward) beside the distillation term; false:
    the distillation term is the whole advantage (pure on-policy distillation; the reward is
    still scored and logged)."""

    @property
    def enabled(self) -> bool:
        return self.teacher_path is not None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.advantage_coef) and self.advantage_coef >= 0):
            raise ConfigError(
                f"algorithm.distillation.advantage_coef={self.advantage_coef} must be a "
                "finite number >= 0"
            )
        if self.advantage_coef > 0 and not self.enabled:
            raise ConfigError(
                f"algorithm.distillation.advantage_coef={self.advantage_coef} needs a teacher: "
                "set algorithm.distillation.teacher_path"
            )
        if not self.rl_advantage and self.advantage_coef == 0:
            raise ConfigError(
                "algorithm.distillation.rl_advantage=false leaves no advantage: set "
                "algorithm.distillation.advantage_coef > 0 (e.g. 1.0), or keep rl_advantage"
            )


@dataclass
class PrimeConfig:
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


@dataclass
class SpinConfig:
    """SPIN (Chen et al. 2024): each prompt's reference answer (the data's ground truth) is
    the chosen response and the policy's own sample the rejected one; the actor minimises
    the DPO-style `tephra.algos.spin_loss` against the previous iteration (the reference
    policy, refreshed from the actor every `refresh_every` steps). Replaces the reward-based
    policy loss: the reward is still scored and logged."""

    enabled: bool = False
    """Turn SPIN on (the reference policy is built; the batch holds chosen / rejected pairs)."""
    beta: float = 0.1
    """beta of the margin beta * (log-ratio of chosen - log-ratio of rejected) (SPIN's 0.1)."""
    refresh_every: int = 8
    """Steps per SPIN iteration: after every this many steps the reference (the opponent)
    becomes a copy of the actor. SPIN trains each iteration to convergence (an epoch of its
    data); 8 suits the demo's 32-prompt task at 4 prompts per step."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ConfigError(f"algorithm.spin.beta={self.beta} must be > 0 (SPIN uses 0.1)")
        if self.refresh_every < 1:
            raise ConfigError(
                f"algorithm.spin.refresh_every={self.refresh_every} must be >= 1 (steps "
                "between copies of the actor into the reference)"
            )
