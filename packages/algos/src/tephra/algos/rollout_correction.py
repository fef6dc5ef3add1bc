"""Rollout correction: what the loss does about samples drawn by a policy other than the one
it trains (an older weights version in asynchronous RL, or the same weights in a rollout
engine with other kernels / precision).

Three policies meet in one update:
    pi_rollout  what sampled the tokens (the rollout engine's `rollout_log_probs`)
    pi_old      the proximal policy of the PPO ratio (`old_log_probs`)
    pi          the policy being trained (the engine's forward)
A correction mode, chosen by name from `ROLLOUT_CORRECTIONS`, says what pi_old is and how
each token's policy loss is weighted:

    none    pi_old = the trainer's log-probs of the current weights (today's PPO); weight 1
    tis     pi_old = the trainer's log-probs; truncated importance sampling (Yao et al. 2025;
            Ionides 2008) weights each token's loss by
              token:    w_t = min(exp(log pi_old(y_t) - log pi_rollout(y_t)), cap)
              sequence: w_t = min(exp(sum_{t' in response} log pi_old - log pi_rollout), cap)
    bypass  pi_old = pi_rollout: the PPO ratio is taken against the rollout's own log-probs
            and the trainer's old-log-prob forward pass is skipped; weight 1

Weights carry no gradient. The registry's metadata tells a caller what to do:
`needs_train_log_probs` (compute the trainer's log-probs before the update) and
`replaces_old_log_probs` (never compute them: the mode supplies pi_old).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from tephra.algos.errors import ConfigError, InputError
from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_max, masked_mean
from tephra.algos.registry import Registry

LEVELS = ("token", "sequence")
"""Levels of truncated importance sampling."""

_LOG_CLAMP = 20.0
"""Log-ratios are clamped here before exp in metrics, so one wild token cannot overflow."""


@dataclass
class RolloutCorrectionConfig:
    """How the policy loss treats the rollout policy (`apply_rollout_correction`)."""

    mode: str = "none"
    """Name in `ROLLOUT_CORRECTIONS`: `none`, `tis` or `bypass`."""
    level: str = "token"
    """`tis`: one weight per token (`token`) or one per sequence, the product of its tokens'
    ratios (`sequence`; lower bias for sequence-level rewards, higher variance)."""
    cap: float = 2.0
    """`tis`: the truncation C of min(ratio, C), >= 1. 2 bounds the variance a stale or
    mismatched token can add while leaving ratios near 1 untouched."""

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTIONS:
            import difflib

            close = difflib.get_close_matches(str(self.mode), ROLLOUT_CORRECTIONS.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"rollout_correction.mode={self.mode!r} is not registered{hint}; "
                              f"choose one of {ROLLOUT_CORRECTIONS.names()}")
        if self.level not in LEVELS:
            raise ConfigError(f"rollout_correction.level={self.level!r}: choose one of "
                              f"{list(LEVELS)}")
        if not (isinstance(self.cap, (int, float)) and math.isfinite(self.cap) and self.cap >= 1):
            raise ConfigError(f"rollout_correction.cap={self.cap!r} must be a finite number "
                              ">= 1 (the truncation C of min(ratio, C))")


@dataclass
class RolloutCorrection:
    """What a correction mode gives the loss."""

    old_log_probs: torch.Tensor
    """pi_old of the PPO ratio [batch, seq]."""
    weights: torch.Tensor | None
    """Per-token multiplier of the policy loss [batch, seq] (0 where the mask is 0); None: 1."""
    metrics: dict[str, float]
    """`rollout_corr/*` floats about the batch."""


class CorrectionFn(Protocol):
    def __call__(self, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                 config: RolloutCorrectionConfig,
                 train_log_probs: torch.Tensor | None) -> RolloutCorrection: ...


ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


def rollout_mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout policy is from the trainer's ([batch, seq], over mask=1 tokens),
    with g = log pi_old - log pi_rollout and rho = exp(g):
    `rollout_corr/log_prob_gap_mean` mean g; `rollout_corr/log_prob_abs_gap_mean` mean |g|;
    `rollout_corr/kl_k3` mean (rho - 1 - g), Schulman's k3 estimate of KL(pi_rollout ||
    pi_old) from the rollout's samples (>= 0); `rollout_corr/ratio_max` max rho."""
    check_same_shape(train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     response_mask=response_mask)
    gap = (train_log_probs - rollout_log_probs).detach().clamp(-_LOG_CLAMP, _LOG_CLAMP)
    return {
        "rollout_corr/log_prob_gap_mean": float(masked_mean(gap, response_mask)),
        "rollout_corr/log_prob_abs_gap_mean": float(masked_mean(gap.abs(), response_mask)),
        "rollout_corr/kl_k3": float(masked_mean(torch.expm1(gap) - gap, response_mask)),
        "rollout_corr/ratio_max": float(torch.exp(masked_max(gap, response_mask))),
    }


@ROLLOUT_CORRECTIONS.register("none", needs_train_log_probs=False, replaces_old_log_probs=False)
def no_correction(rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                  config: RolloutCorrectionConfig,
                  train_log_probs: torch.Tensor | None) -> RolloutCorrection:
    """The trainer's log-probs as pi_old (when the caller has them; without them the engine
    uses the current log-probs, which equal them for one mini-batch and one epoch)."""
    old = train_log_probs if train_log_probs is not None else rollout_log_probs
    return RolloutCorrection(old, None, {})


@ROLLOUT_CORRECTIONS.register("tis", needs_train_log_probs=True, replaces_old_log_probs=False)
def truncated_is(rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                 config: RolloutCorrectionConfig,
                 train_log_probs: torch.Tensor | None) -> RolloutCorrection:
    """Truncated importance weights min(pi_old / pi_rollout, cap) at `config.level`, plus
    `rollout_corr/tis_weight_mean` and `rollout_corr/tis_capped_frac` (share of tokens, or
    of sequences, whose ratio exceeded the cap)."""
    if train_log_probs is None:
        raise InputError("rollout correction 'tis' needs train_log_probs: the trainer's "
                         "log-probs of the current weights (engine forward before the update)")
    check_same_shape(train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     response_mask=response_mask)
    mask = response_mask > 0
    gap = torch.where(mask, (train_log_probs - rollout_log_probs).detach(),
                      torch.zeros((), dtype=train_log_probs.dtype,
                                  device=train_log_probs.device))
    log_cap = math.log(config.cap)
    if config.level == "token":
        log_w = gap
        capped = float(masked_mean((gap > log_cap).to(gap.dtype), response_mask))
    else:
        seq = gap.sum(-1)
        has = mask.any(-1)
        log_w = seq.unsqueeze(-1).expand_as(gap)
        capped = float(((seq > log_cap) & has).sum() / has.sum().clamp(min=1))
    # min(exp(g), C) = exp(min(g, log C)): the clamp first, so exp never overflows
    weights = torch.where(mask, torch.exp(log_w.clamp(max=log_cap)),
                          torch.zeros((), dtype=gap.dtype, device=gap.device))
    metrics = {"rollout_corr/tis_weight_mean": float(masked_mean(weights, response_mask)),
               "rollout_corr/tis_capped_frac": capped}
    return RolloutCorrection(train_log_probs, weights, metrics)


@ROLLOUT_CORRECTIONS.register("bypass", needs_train_log_probs=False, replaces_old_log_probs=True)
def bypass(rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
           config: RolloutCorrectionConfig,
           train_log_probs: torch.Tensor | None) -> RolloutCorrection:
    """The rollout's log-probs as pi_old: no forward pass for them, and the PPO ratio clips
    the update against the policy that actually sampled."""
    return RolloutCorrection(rollout_log_probs, None, {})


def apply_rollout_correction(config: RolloutCorrectionConfig, rollout_log_probs: torch.Tensor,
                             response_mask: torch.Tensor,
                             train_log_probs: torch.Tensor | None = None) -> RolloutCorrection:
    """Run `config.mode`; with `train_log_probs` the mismatch metrics
    (`rollout_mismatch_metrics`) are added whatever the mode."""
    out = ROLLOUT_CORRECTIONS.get(config.mode)(rollout_log_probs, response_mask, config,
                                               train_log_probs)
    if train_log_probs is not None:
        out.metrics = {**rollout_mismatch_metrics(train_log_probs, rollout_log_probs,
                                                  response_mask), **out.metrics}
    return out

