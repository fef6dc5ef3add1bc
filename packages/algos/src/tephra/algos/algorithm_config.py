"""The trainer's `algorithm` section: the advantage estimator by name and its settings, KL in
the reward, DAPO's sampling rules, and what the loss does about off-policy rollouts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tephra.algos.advantages import ADVANTAGE_ESTIMATORS
from tephra.algos.config import AdvantageConfig
from tephra.algos.errors import ConfigError
from tephra.algos.kl import KL_ESTIMATORS
from tephra.algos.recipe_config import DistillationConfig, PrimeConfig, SpinConfig
from tephra.algos.rollout_correction import LEVELS, ROLLOUT_CORRECTIONS, RolloutCorrectionConfig
from tephra.core.registry import check_registered


@dataclass
class KLInRewardConfig:
    """KL to the reference policy as a per-token reward penalty (verl's use_kl_in_reward):
    r'_t = r_t - beta * KL_t, with beta fixed or adapted towards a target KL."""

    coef: float = 0.0
    """Initial beta; 0 turns the penalty off."""
    estimator: str = "k1"
    """KL estimator from tephra.algos.KL_ESTIMATORS (verl's kl_penalty: `kl`/`k1`, `abs`,
    `mse`/`k2`, `low_var_kl`/`k3`)."""
    controller: str = "fixed"
    """`fixed` (beta stays `coef`) or `adaptive` (Ziegler et al. 2019: beta follows
    `target_kl` over `horizon` samples)."""
    target_kl: float = 0.1
    """`adaptive`: the KL per token the controller steers towards."""
    horizon: int = 10000
    """`adaptive`: samples over which beta moves by up to 20%."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ConfigError(f"algorithm.kl_in_reward.coef={self.coef} must be >= 0 (0 = off)")
        check_registered("algorithm.kl_in_reward.estimator", self.estimator, KL_ESTIMATORS)
        if self.estimator.startswith("full"):
            raise ConfigError(
                "algorithm.kl_in_reward.estimator='full' needs full-vocabulary "
                "log-probs, which engines do not return; use 'k1' or 'k3'"
            )
        if self.controller not in ("fixed", "adaptive"):
            raise ConfigError(
                f"algorithm.kl_in_reward.controller={self.controller!r}: choose "
                "'fixed' or 'adaptive'"
            )
        if self.target_kl <= 0 or self.horizon < 1:
            raise ConfigError("algorithm.kl_in_reward.target_kl must be > 0 and horizon >= 1")

    @property
    def enabled(self) -> bool:
        return self.coef > 0


@dataclass
class AlgorithmConfig:
    """The estimator by name and its settings, KL in the reward, DAPO's sampling rules."""

    adv_estimator: str = "grpo"
    """Advantage estimator from tephra.algos.ADVANTAGE_ESTIMATORS; what it needs (a critic,
    groups of samples, greedy baselines) is read from the registry's metadata."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """gamma, lam, norm_by_std, passk_k, ... (tephra.algos.AdvantageConfig)."""
    kl_in_reward: KLInRewardConfig = field(default_factory=KLInRewardConfig)
    """KL penalty in the reward (off by default; the KL loss is `actor.objective.use_kl_loss`)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop prompt groups whose samples all got the same score (no
    group-relative signal) and generate more prompts until `batch.prompts_per_step` groups
    remain; filtered on the outcome score, before length shaping."""
    max_gen_batches: int = 3
    """Dynamic sampling: at most this many rounds of `batch.prompts_per_step` prompts per
    step; a batch still short of informative groups is filled with flat ones."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the last `overlong_buffer` tokens of the response budget
    cost up to `overlong_penalty_factor` of reward, linearly; 0 turns it off."""
    overlong_penalty_factor: float = 1.0
    """The penalty at the full response budget (added to the score as a negative reward)."""
    rollout_correction: str = "none"
    """What the policy loss does about rollouts sampled by other weights (`trainer.mode=
    one_step_off`) or another engine, from tephra.algos.ROLLOUT_CORRECTIONS: `none`;
    `tis` (truncated importance sampling of exp(old_log_prob - rollout_log_prob), old
    log-probs recomputed); `bypass` (the rollout's log-probs are the old log-probs, the
    recompute is skipped). `rollout_corr/*` mismatch metrics are logged whenever the
    trainer's old log-probs are computed."""
    rollout_correction_level: str = "token"
    """`tis`: one weight per token (`token`) or per sequence (`sequence`: product of its
    tokens' ratios)."""
    rollout_correction_cap: float = 2.0
    """`tis`: truncation C of min(ratio, C), >= 1."""
    rollout_rejection: list[str] = field(default_factory=list)
    """Rejection sampling (verl's `rollout_rs`) from tephra.algos.REJECTION_OPTIONS, e.g.
    [token_k1] or [seq_mean_k3]: tokens (or whole sequences for `seq_*`) whose divergence
    between the trainer's and the rollout's log-probs leaves the bounds are dropped from the
    response mask for the update (the trainer's log-probs are then computed). Empty: none."""
    rollout_rejection_threshold: str | float | None = None
    """Bounds of `rollout_rejection` (verl's `rollout_rs_threshold`): `"lower_upper"` ratio
    bounds for *_k1 options (one number u means 1/u_u), an upper bound for k2 / k3; one for
    all options or one per option, comma-separated."""
    mismatch_probe_rows: int = 8
    """Rows whose log-probs the trainer recomputes every step to log the train/rollout
    mismatch (`rollout_corr/*`) when the step computes none of its own (one mini-batch, one
    epoch, no correction): a random subset, rounded to the data-parallel size. 0 turns the
    probe off. 8 rows cost a small forward pass and catch a dtype or kernel mismatch early."""
    mismatch_alarm_kl: float | None = None
    """Stop the run when `rollout_corr/kl_k3` (KL between the rollout's and the trainer's
    token distributions, estimated on the sampled tokens) exceeds this; None: log only.
    Healthy runs sit near 1e-4 to 1e-3; a wrong dtype or chat template gives 1e-2 and more."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation: a teacher scores the sampled tokens (off by default)."""
    prime: PrimeConfig = field(default_factory=PrimeConfig)
    """PRIME's implicit process reward model and advantage (off by default)."""
    spin: SpinConfig = field(default_factory=SpinConfig)
    """SPIN's self-play against the data's reference answers (off by default)."""

    def __post_init__(self) -> None:
        check_registered("algorithm.adv_estimator", self.adv_estimator, ADVANTAGE_ESTIMATORS)
        check_registered(
            "algorithm.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS
        )
        if self.rollout_correction_level not in LEVELS:
            raise ConfigError(
                f"algorithm.rollout_correction_level="
                f"{self.rollout_correction_level!r}: choose one of {list(LEVELS)}"
            )
        if not self.rollout_correction_cap >= 1:
            raise ConfigError(
                f"algorithm.rollout_correction_cap={self.rollout_correction_cap} "
                "must be >= 1 (the truncation C of min(ratio, C))"
            )
        self.correction  # noqa: B018 - validates the rejection options and bounds
        if self.mismatch_probe_rows < 0:
            raise ConfigError(
                f"algorithm.mismatch_probe_rows={self.mismatch_probe_rows} must "
                "be >= 0 (0 turns the mismatch probe off)"
            )
        if self.mismatch_alarm_kl is not None and not (
            math.isfinite(self.mismatch_alarm_kl) and self.mismatch_alarm_kl > 0
        ):
            raise ConfigError(
                f"algorithm.mismatch_alarm_kl={self.mismatch_alarm_kl} must be a "
                "positive number (e.g. 0.01), or null to log without an alarm"
            )
        if self.max_gen_batches < 1:
            raise ConfigError(f"algorithm.max_gen_batches={self.max_gen_batches} must be >= 1")
        if self.overlong_penalty_factor < 0:
            raise ConfigError(
                f"algorithm.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0"
            )

    @property
    def correction(self) -> RolloutCorrectionConfig:
        return RolloutCorrectionConfig(
            self.rollout_correction,
            self.rollout_correction_level,
            self.rollout_correction_cap,
            tuple(self.rollout_rejection),
            self.rollout_rejection_threshold,
        )

    def needs(self, what: str) -> bool:
        """Whether the estimator's registry metadata says it needs `values`, `groups`,
        `baselines`, `k` or `token_stats` (the trainer's log-probs and sum pi^2)."""
        return bool(ADVANTAGE_ESTIMATORS.meta(self.adv_estimator).get(f"needs_{what}"))

    def reads(self, what: str) -> bool:
        """Whether the estimator's registry metadata says it uses `what` when given
        (`reward_components`: `gdpo`), without needing it."""
        return bool(ADVANTAGE_ESTIMATORS.meta(self.adv_estimator).get(f"reads_{what}"))
