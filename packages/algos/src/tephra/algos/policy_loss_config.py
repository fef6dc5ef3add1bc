"""The policy losses' parameters (`PolicyLossConfig`), below the losses that read them
(`policy_losses`) and the actor's objective section that holds them (`config`)."""

from __future__ import annotations

from dataclasses import dataclass

from tephra.algos.config_checks import in_range, positive
from tephra.algos.errors import ConfigError


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
        positive("policy_loss", "clip_ratio", self.clip_ratio)
        if self.clip_ratio_low is None:
            self.clip_ratio_low = self.clip_ratio
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio
        positive("policy_loss", "clip_ratio_low", self.clip_ratio_low)
        positive("policy_loss", "clip_ratio_high", self.clip_ratio_high)
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(
                f"policy_loss.clip_ratio_c={self.clip_ratio_c!r} must be > 1 (dual-clip bound); "
                f"use None to disable dual-clip"
            )
        positive("policy_loss", "log_ratio_clamp", self.log_ratio_clamp)
        in_range("policy_loss", "clip_cov_ratio", self.clip_cov_ratio, 0.0, 1.0)
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(
                f"policy_loss.clip_cov_lb={self.clip_cov_lb!r} must be < "
                f"policy_loss.clip_cov_ub={self.clip_cov_ub!r}"
            )
        in_range("policy_loss", "kl_cov_ratio", self.kl_cov_ratio, 0.0, 1.0)
        positive("policy_loss", "kl_cov_coef", self.kl_cov_coef, zero_ok=True)
        positive("policy_loss", "sapo_tau_pos", self.sapo_tau_pos)
        positive("policy_loss", "sapo_tau_neg", self.sapo_tau_neg)
        positive("policy_loss", "dro_beta", self.dro_beta)
        if self.dppo_ratio_cap is not None:
            positive("policy_loss", "dppo_ratio_cap", self.dppo_ratio_cap)
