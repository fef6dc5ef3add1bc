"""tephra.algos: the mathematics of RL post-training as pure functions over torch tensors.

Advantage estimators, policy losses, loss aggregation with global normalisers, KL
estimators and controllers, value loss, entropy, DAPO dynamic sampling and overlong
shaping, truncated importance sampling, rollout correction (off-policy rollouts), on-policy
distillation, PRIME's implicit process reward, SPIN and SPPO self-play losses. Depends on torch only; never on an engine.
"""

from tephra.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from tephra.algos.aggregation import AGGREGATION_MODES, aggregate_loss, global_normalisers
from tephra.algos.config import (
    ActorObjectiveConfig,
    AdvantageConfig,
    CriticObjectiveConfig,
)
from tephra.algos.dapo import filter_groups, overlong_penalty
from tephra.algos.distillation import add_distillation_advantages, distillation_advantages
from tephra.algos.entropy import entropy_from_logits
from tephra.algos.errors import ConfigError, InputError, RegistryError
from tephra.algos.groups import group_index
from tephra.algos.importance_sampling import mismatch_metrics, truncated_importance_weights
from tephra.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    straight_through,
)
from tephra.algos.masked import masked_mean, masked_sum, masked_whiten
from tephra.algos.objectives import ActorObjective, CriticObjective
from tephra.algos.policy_loss_config import PolicyLossConfig
from tephra.algos.policy_losses import POLICY_LOSSES, compute_policy_loss
from tephra.algos.prime import (
    PrimeRMObjective,
    implicit_process_rewards,
    prime_advantages,
    prime_rm_loss,
    prime_step,
)
from tephra.algos.registry import Registry
from tephra.algos.rollout_correction import (
    REJECTION_OPTIONS,
    ROLLOUT_CORRECTIONS,
    RolloutCorrection,
    RolloutCorrectionConfig,
    apply_rollout_correction,
    rejection_mask,
    rollout_mismatch_metrics,
)
from tephra.algos.self_play import (
    SPIN_CHOSEN,
    SpinObjective,
    sequence_log_probs,
    spin_loss,
    spin_pair_columns,
    sppo_loss,
    win_rates,
)
from tephra.algos.value_loss import clipped_value_loss

__all__ = [
    "PrimeRMObjective",
    "SPIN_CHOSEN",
    "SpinObjective",
    "win_rates",
    "sppo_loss",
    "spin_loss",
    "sequence_log_probs",
    "prime_rm_loss",
    "prime_advantages",
    "implicit_process_rewards",
    "distillation_advantages",
    "add_distillation_advantages",
    "prime_step",
    "spin_pair_columns",
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REJECTION_OPTIONS",
    "ROLLOUT_CORRECTIONS",
    "RolloutCorrection",
    "RolloutCorrectionConfig",
    "apply_rollout_correction",
    "rejection_mask",
    "rollout_mismatch_metrics",
    "ActorObjective",
    "ActorObjectiveConfig",
    "AdaptiveKLController",
    "AdvantageConfig",
    "ConfigError",
    "CriticObjective",
    "CriticObjectiveConfig",
    "FixedKLController",
    "InputError",
    "PolicyLossConfig",
    "Registry",
    "RegistryError",
    "aggregate_loss",
    "apply_kl_penalty",
    "clipped_value_loss",
    "compute_advantages",
    "compute_policy_loss",
    "entropy_from_logits",
    "filter_groups",
    "global_normalisers",
    "group_index",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mismatch_metrics",
    "overlong_penalty",
    "straight_through",
    "truncated_importance_weights",
]
