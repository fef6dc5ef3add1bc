"""Typed, validated configuration of the algorithms.

Every field says its unit and why its default is what it is. Validation happens on
construction (`__post_init__`); a message names the field, the value it got and the fix.
Names chosen by registry (estimator, policy loss, aggregation mode, KL estimator) are checked
against the registries so a typo fails when the config is built, not mid-training.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from tephra.algos.aggregation import AGGREGATION_MODES
from tephra.algos.errors import ConfigError
from tephra.algos.kl import KL_ESTIMATORS


def _in_range(section: str, name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"{section}.{name}={value!r} must be in [{lo}, {hi}]")


def _positive(section: str, name: str, value: float, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{section}.{name}={value!r} must be {bound}")


def _registered(section: str, name: str, value: str, registry: Any) -> None:
    if value not in registry:
        close = difflib.get_close_matches(str(value), registry.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{section}.{name}={value!r} is not registered{hint}; choose one of {registry.names()}"
        )


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
        _in_range("advantage", "gamma", self.gamma, 0.0, 1.0)
        _in_range("advantage", "lam", self.lam, 0.0, 1.0)
        if self.lam_actor is not None:
            _in_range("advantage", "lam_actor", self.lam_actor, 0.0, 1.0)
        if self.lam_critic is not None:
            _in_range("advantage", "lam_critic", self.lam_critic, 0.0, 1.0)
        if self.lam_length_alpha is not None:
            _positive("advantage", "lam_length_alpha", self.lam_length_alpha)
        _positive("advantage", "epsilon", self.epsilon)
        _positive("advantage", "sppo_eta", self.sppo_eta)
        if not isinstance(self.passk_k, int) or self.passk_k < 1:
            raise ConfigError(f"advantage.passk_k={self.passk_k!r} must be an integer >= 1")


@dataclass
class PolicyLossConfig:
    """Parameters of the policy losses (`POLICY_LOSSES`); each loss reads the fields it names."""

    clip_ratio: float = 0.2
    """PPO epsilon: the ratio is clipped to [1 - low, 1 + high] with both defaulting to this."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon (None: `clip_ratio`). `vanilla`, `gspo`, `cispo`, `clip_cov`."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon (None: `clip_ratio`); DAPO's clip-higher uses e.g. 0.28. GSPO uses
    sequence-level ratios, with epsilons around 3e-4 / 4e-4."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip constant c > 1 (Ye et al. 2020): for negative advantages the loss is at most
    -A * c. None disables dual-clip. `vanilla` only."""
    log_ratio_clamp: float = 20.0
    """log(pi / pi_old) is clamped to [-this, this] before exp, so one wild token cannot
    overflow the ratio; 20 is far beyond any clip range."""
    clip_cov_ratio: float = 2e-4
    """`clip_cov`: fraction of the micro-batch's response tokens whose gradient is detached."""
    clip_cov_lb: float = 1.0
    """`clip_cov`: only tokens with covariance above this are candidates."""
    clip_cov_ub: float = 5.0
    """`clip_cov`: only tokens with covariance below this are candidates."""
    clip_cov_seed: int | None = None
    """`clip_cov`: seed of the random choice among candidates (None: torch's global RNG)."""
    kl_cov_ratio: float = 2e-3
    """`kl_cov`: fraction of response tokens (highest covariance) that get the KL penalty."""
    kl_cov_coef: float = 1.0
    """`kl_cov`: coefficient of |log pi - log pi_old| on the selected tokens."""
    sapo_tau_pos: float = 1.0
    """`sapo`: gate temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """`sapo`: gate temperature for negative advantages (larger: negative updates decay faster
    off-policy, as the paper recommends)."""
    dro_beta: float = 0.1
    """`dro`: weight beta of the quadratic proximity penalty (beta / 2)(log pi - log pi_old)^2;
    must be > 0 (verl's `dro_beta`)."""
    dppo_ratio_cap: float | None = None
    """`dppo_tv`, `dppo_kl`: truncation C of the importance weight min(r, C) (DPPO's truncated
    IS). None (default): `clip_ratio_c`, as verl reads it (3.0 by default; 20 where
    `clip_ratio_c` is None, verl's fallback), so a ported verl config computes the same.
    Set it to truncate DPPO's weight apart from the dual clip."""

    @property
    def eps_low(self) -> float:
        """The lower clip epsilon: `clip_ratio_low`, or `clip_ratio` where that is None."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        """The upper clip epsilon: `clip_ratio_high`, or `clip_ratio` where that is None."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    def __post_init__(self) -> None:
        _positive("policy_loss", "clip_ratio", self.clip_ratio)
        if self.clip_ratio_low is None:
            self.clip_ratio_low = self.clip_ratio
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio
        _positive("policy_loss", "clip_ratio_low", self.clip_ratio_low)
        _positive("policy_loss", "clip_ratio_high", self.clip_ratio_high)
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(
                f"policy_loss.clip_ratio_c={self.clip_ratio_c!r} must be > 1 (dual-clip bound); "
                f"use None to disable dual-clip"
            )
        _positive("policy_loss", "log_ratio_clamp", self.log_ratio_clamp)
        _in_range("policy_loss", "clip_cov_ratio", self.clip_cov_ratio, 0.0, 1.0)
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(
                f"policy_loss.clip_cov_lb={self.clip_cov_lb!r} must be < "
                f"policy_loss.clip_cov_ub={self.clip_cov_ub!r}"
            )
        _in_range("policy_loss", "kl_cov_ratio", self.kl_cov_ratio, 0.0, 1.0)
        _positive("policy_loss", "kl_cov_coef", self.kl_cov_coef, zero_ok=True)
        _positive("policy_loss", "sapo_tau_pos", self.sapo_tau_pos)
        _positive("policy_loss", "sapo_tau_neg", self.sapo_tau_neg)
        _positive("policy_loss", "dro_beta", self.dro_beta)
        if self.dppo_ratio_cap is not None:
            _positive("policy_loss", "dppo_ratio_cap", self.dppo_ratio_cap)


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
        # not at the top: policy_losses imports this module (PolicyLossConfig), a cycle
        from tephra.algos.policy_losses import POLICY_LOSSES

        if isinstance(self.policy, dict):  # YAML gives dicts
            self.policy = PolicyLossConfig(**self.policy)
        _registered("actor", "policy_loss", self.policy_loss, POLICY_LOSSES)
        _registered("actor", "loss_agg_mode", self.loss_agg_mode, AGGREGATION_MODES)
        _registered("actor", "kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)
        if self.kl_loss_type.startswith("full"):
            raise ConfigError(
                f"actor.kl_loss_type={self.kl_loss_type!r} needs full-vocabulary log-probs, "
                f"which engines do not return; use 'k3+' or 'k1'"
            )
        _registered("actor", "distill_loss_type", self.distill_loss_type, KL_ESTIMATORS)
        _positive("actor", "distill_loss_coef", self.distill_loss_coef, zero_ok=True)
        if self.distill_loss_type.startswith("full"):
            raise ConfigError(
                f"actor.distill_loss_type={self.distill_loss_type!r} needs full-vocabulary "
                f"log-probs, which engines do not return; use 'k3+' or 'k1'"
            )
        _check_norm_constant("actor", self.loss_agg_mode, self.loss_agg_norm_constant)
        _positive("actor", "entropy_coeff", self.entropy_coeff, zero_ok=True)
        _positive("actor", "kl_loss_coef", self.kl_loss_coef, zero_ok=True)
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
            _positive("critic", "cliprange_value", self.cliprange_value)
        _registered("critic", "loss_agg_mode", self.loss_agg_mode, AGGREGATION_MODES)
        _check_norm_constant("critic", self.loss_agg_mode, self.loss_agg_norm_constant)


def _check_norm_constant(section: str, mode: str, constant: float | None) -> None:
    if mode == "seq-mean-token-sum-norm":
        if constant is None or constant <= 0:
            raise ConfigError(
                f"{section}.loss_agg_norm_constant={constant!r}: loss_agg_mode "
                f"'seq-mean-token-sum-norm' needs a positive constant, e.g. the maximum "
                f"response length in tokens"
            )
