"""Typed, validated configuration of the algorithms.

Every field says its unit and why its default is what it is. Validation happens on
construction (`__post_init__`); a message names the field, the value it got and the fix.
Names chosen by registry (estimator, policy loss, aggregation mode, KL estimator) are checked
against the registries so a typo fails when the config is built, not mid-training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tephra.algos.aggregation import AGGREGATION_MODES
from tephra.algos.config_checks import in_range, positive, registered
from tephra.algos.errors import ConfigError
from tephra.algos.kl import KL_ESTIMATORS
from tephra.algos.policy_loss_config import PolicyLossConfig
from tephra.algos.policy_losses import POLICY_LOSSES


@dataclass
class AdvantageConfig:
    """How advantages are estimated (`compute_advantages`)."""

    gamma: float = 1.0
    """Discount per response token (`gae`, `reinforce_plus_plus`). 1.0: outcome rewards of
    LLM responses are not discounted by length unless asked for."""
    lam: float = 1.0
    """GAE lambda (`gae` only); 1.0 gives Monte-Carlo returns minus the value baseline. The
    default of `lam_actor` and `lam_critic` where those are None."""
    lam_actor: float | None = None
    """`gae`: lambda of the actor's advantages (VAPO's decoupled GAE, Yue et al. 2025,
    arXiv 2504.05118); None: `lam`. Ignored where `lam_length_alpha` is set."""
    lam_critic: float | None = None
    """`gae`: lambda of the critic's returns (its regression target); None: `lam`. VAPO uses
    1.0 so the value target is the unbiased Monte-Carlo return."""
    lam_length_alpha: float | None = None
    """`gae`: VAPO's length-adaptive lambda for the actor, lambda_i = 1 - 1 / (alpha * l_i)
    with l_i the sample's response-token count (clamped to [0, 1]); None: off. VAPO uses
    alpha = 0.05, so long answers get lambda near 1 (less bias), short ones smaller lambda."""
    norm_by_std: bool = True
    """`grpo`, `gpg`, `grpo_passk`: divide the group-centred score by the group's standard
    deviation. False for `grpo` is Dr. GRPO (Liu et al. 2025), which removes this bias."""
    epsilon: float = 1e-6
    """Added to a standard deviation before dividing, so all-equal groups give 0, not NaN."""
    whiten_gae: bool = True
    """`gae`: whiten advantages over the batch's response tokens (mean 0, std 1), as PPO
    implementations for LLMs do; returns are computed before whitening."""
    passk_k: int = 4
    """`grpo_passk`: the k of pass@k (max@k for non-binary rewards); every group must hold at
    least k samples. k=1 is GRPO with the population standard deviation."""
    sppo_eta: float = 1e3
    """`sppo`: the step size eta of SPPO's target eta * (P(win) - 1/2), in nats of sequence
    log-ratio per unit of win rate; 1e3 is the paper's (long responses: large log-ratios)."""
    gdpo_reward_keys: list[str] | None = None
    """`gdpo`: names of the reward function's dict entries that are GDPO's reward components,
    in order (e.g. [format, accuracy] for a function returning {"score": ..., "format": ...,
    "accuracy": ...}; "score" names the score itself). None: the one component is the score
    (then GDPO is whitened GRPO). The reward components of samples whose scorer failed are 0."""
    gdpo_reward_weights: list[float] | None = None
    """`gdpo`: weight w_k of each reward component (the columns of `reward_components`, in
    order: `gdpo_reward_keys`'s order in the app); None: all 1 (verl's
    `gdpo_reward_weights`)."""
    handle_zero_tail: bool | None = None
    """`optimal_token_baseline`, `tir_optimal_token_baseline`: give the baseline 0 on the
    part of a group's unique longest sample beyond its second-longest (there the baseline
    would be that sample's own return, so its advantage would be 0). None: each estimator's
    verl default (False for `optimal_token_baseline`, True for `tir_optimal_token_baseline`;
    verl's `handle_zero_tail` argument)."""

    @property
    def actor_lam(self) -> float:
        """The lambda of the actor's advantages (`lam_actor`, else `lam`)."""
        return self.lam if self.lam_actor is None else self.lam_actor

    @property
    def critic_lam(self) -> float:
        """The lambda of the critic's returns (`lam_critic`, else `lam`)."""
        return self.lam if self.lam_critic is None else self.lam_critic

    def __post_init__(self) -> None:
        if self.handle_zero_tail is not None and not isinstance(self.handle_zero_tail, bool):
            raise ConfigError(
                f"advantage.handle_zero_tail={self.handle_zero_tail!r} must be true, false or "
                "null (null: the estimator's verl default)"
            )
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if keys is not None and (
            not keys
            or not all(isinstance(k, str) and k for k in keys)
            or len(set(keys)) < len(keys)
        ):
            raise ConfigError(
                f"advantage.gdpo_reward_keys={keys!r} must be a non-empty list of distinct "
                "reward dict keys (e.g. [format, accuracy]), or null for the score alone"
            )
        if keys is not None and weights is not None and len(weights) != len(keys):
            raise ConfigError(
                f"advantage.gdpo_reward_weights has {len(weights)} weights for "
                f"{len(keys)} gdpo_reward_keys {keys}; give one weight per key (or null for all 1)"
            )
        in_range("advantage", "gamma", self.gamma, 0.0, 1.0)
        in_range("advantage", "lam", self.lam, 0.0, 1.0)
        if self.lam_actor is not None:
            in_range("advantage", "lam_actor", self.lam_actor, 0.0, 1.0)
        if self.lam_critic is not None:
            in_range("advantage", "lam_critic", self.lam_critic, 0.0, 1.0)
        if self.lam_length_alpha is not None:
            positive("advantage", "lam_length_alpha", self.lam_length_alpha)
        positive("advantage", "epsilon", self.epsilon)
        positive("advantage", "sppo_eta", self.sppo_eta)
        if not isinstance(self.passk_k, int) or self.passk_k < 1:
            raise ConfigError(f"advantage.passk_k={self.passk_k!r} must be an integer >= 1")


@dataclass
class ActorObjectiveConfig:
    """The actor's loss: policy loss + aggregation - entropy bonus + KL loss, with optional
    truncated importance sampling against the rollout engine's log-probs."""

    policy_loss: str = "vanilla"
    """Name in `POLICY_LOSSES`."""
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Parameters of the policy loss."""
    loss_agg_mode: str = "token-mean"
    """Name in `AGGREGATION_MODES`; how per-token losses become one number."""
    loss_agg_norm_constant: float | None = None
    """`seq-mean-token-sum-norm` only: the constant dividing each sequence's token sum, in
    tokens (Dr. GRPO uses the maximum response length). Required by that mode."""
    entropy_coeff: float = 0.0
    """Coefficient of the entropy bonus (subtracted from the loss); 0 disables it. Needs the
    engine to return `entropy`."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(pi || pi_ref) to the loss (GRPO style) instead of, or besides, a
    KL reward penalty. Needs `ref_log_probs` in the batch."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "k3+"
    """Name in `KL_ESTIMATORS`. Default `k3+`: the low-variance k3 value with the k2
    gradient, which is unbiased for grad KL(pi || pi_ref) (plain k3's gradient is not)."""
    distill_loss_coef: float = 0.0
    """On-policy distillation as a loss term: add this * agg(KL(pi || teacher)) estimated on
    the sampled tokens with `distill_loss_type` (reads batch["teacher_log_probs"]); 0: off."""
    distill_loss_type: str = "k3+"
    """Name in `KL_ESTIMATORS` for the distillation term. `k3+` (k2's gradient
    (log pi - log q) grad log pi) is the per-token REINFORCE gradient of the reverse KL."""
    tis_level: str | None = None
    """Truncated importance sampling against `rollout_log_probs`: `token`, `sequence`, or None
    (off). Corrects the rollout-engine / training-engine probability mismatch."""
    tis_threshold: float = 2.0
    """Truncation C of the importance weight min(pi_old / pi_rollout, C)."""

    def __post_init__(self) -> None:
        if isinstance(self.policy, dict):  # YAML gives dicts
            self.policy = PolicyLossConfig(**self.policy)
        registered("actor", "policy_loss", self.policy_loss, POLICY_LOSSES)
        registered("actor", "loss_agg_mode", self.loss_agg_mode, AGGREGATION_MODES)
        registered("actor", "kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)
        if self.kl_loss_type.startswith("full"):
            raise ConfigError(
                f"actor.kl_loss_type={self.kl_loss_type!r} needs full-vocabulary log-probs, "
                f"which engines do not return; use 'k3+' or 'k1'"
            )
        registered("actor", "distill_loss_type", self.distill_loss_type, KL_ESTIMATORS)
        positive("actor", "distill_loss_coef", self.distill_loss_coef, zero_ok=True)
        if self.distill_loss_type.startswith("full"):
            raise ConfigError(
                f"actor.distill_loss_type={self.distill_loss_type!r} needs full-vocabulary "
                f"log-probs, which engines do not return; use 'k3+' or 'k1'"
            )
        _check_norm_constant("actor", self.loss_agg_mode, self.loss_agg_norm_constant)
        positive("actor", "entropy_coeff", self.entropy_coeff, zero_ok=True)
        positive("actor", "kl_loss_coef", self.kl_loss_coef, zero_ok=True)
        if self.tis_level not in (None, "token", "sequence"):
            raise ConfigError(
                f"actor.tis_level={self.tis_level!r} is not allowed; choose 'token', "
                f"'sequence' or None"
            )
        if self.tis_threshold <= 1.0:
            raise ConfigError(f"actor.tis_threshold={self.tis_threshold!r} must be > 1")


@dataclass
class CriticObjectiveConfig:
    """The critic's loss: clipped value regression to the returns."""

    cliprange_value: float | None = 0.5
    """New values are kept within old +- this (in reward units) in the clipped branch of
    the loss; None disables clipping."""
    loss_agg_mode: str = "token-mean"
    """Name in `AGGREGATION_MODES`."""
    loss_agg_norm_constant: float | None = None
    """`seq-mean-token-sum-norm` only: the constant dividing each sequence's token sum."""

    def __post_init__(self) -> None:
        if self.cliprange_value is not None:
            positive("critic", "cliprange_value", self.cliprange_value)
        registered("critic", "loss_agg_mode", self.loss_agg_mode, AGGREGATION_MODES)
        _check_norm_constant("critic", self.loss_agg_mode, self.loss_agg_norm_constant)


def _check_norm_constant(section: str, mode: str, constant: float | None) -> None:
    if mode == "seq-mean-token-sum-norm":
        if constant is None or constant <= 0:
            raise ConfigError(
                f"{section}.loss_agg_norm_constant={constant!r}: loss_agg_mode "
                f"'seq-mean-token-sum-norm' needs a positive constant, e.g. the maximum "
                f"response length in tokens"
            )
