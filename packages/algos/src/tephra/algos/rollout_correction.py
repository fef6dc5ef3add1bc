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

Rejection sampling (verl's `rollout_rs`, Liu et al. 2025, "When Speed Kills Stability") can
be added to any mode that has the trainer's log-probs: tokens, or whole sequences, whose
divergence between pi_old and pi_rollout leaves a bound are dropped from the response mask
(`REJECTION_OPTIONS`, one statistic per name, several names all applied).

Weights carry no gradient. The registry's metadata tells a caller what to do:
`needs_train_log_probs` (compute the trainer's log-probs before the update) and
`replaces_old_log_probs` (never compute them: the mode supplies pi_old).
"""

from __future__ import annotations

import difflib
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
    rejection: tuple[str, ...] = ()
    """Rejection sampling options from `REJECTION_OPTIONS` (verl's `rollout_rs`, e.g.
    `token_k1`, `seq_mean_k3`): a token, or with a `seq_*` option its whole sequence, is
    dropped from the response mask when its statistic leaves the bound; all options apply.
    Empty (default): no rejection."""
    rejection_threshold: str | float | None = None
    """Bounds, one per option or one for all (verl's `rollout_rs_threshold`): `*_k1` options
    take ratio bounds `"lower_upper"` (a single number u means 1/u_u); k2 / k3 options an
    upper bound on the divergence."""

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTIONS:
            close = difflib.get_close_matches(str(self.mode), ROLLOUT_CORRECTIONS.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"rollout_correction.mode={self.mode!r} is not registered{hint}; "
                f"choose one of {ROLLOUT_CORRECTIONS.names()}"
            )
        if self.level not in LEVELS:
            raise ConfigError(
                f"rollout_correction.level={self.level!r}: choose one of {list(LEVELS)}"
            )
        if not (isinstance(self.cap, (int, float)) and math.isfinite(self.cap) and self.cap >= 1):
            raise ConfigError(
                f"rollout_correction.cap={self.cap!r} must be a finite number "
                ">= 1 (the truncation C of min(ratio, C))"
            )
        self.rejection = tuple(dict.fromkeys(self.rejection))
        self.bounds = rejection_bounds(self.rejection, self.rejection_threshold)
        if self.rejection and ROLLOUT_CORRECTIONS.meta(self.mode)["replaces_old_log_probs"]:
            raise ConfigError(
                f"rollout_rejection={list(self.rejection)} needs the trainer's "
                f"log-probs, which rollout_correction={self.mode!r} skips; use "
                f"'none' or 'tis' with rejection"
            )


@dataclass
class RolloutCorrection:
    """What a correction mode gives the loss."""

    old_log_probs: torch.Tensor
    """pi_old of the PPO ratio [batch, seq]."""
    weights: torch.Tensor | None
    """Per-token multiplier of the policy loss [batch, seq] (0 where the mask is 0); None: 1."""
    metrics: dict[str, float]
    """`rollout_corr/*` floats about the batch."""
    keep: torch.Tensor | None = None
    """Rejection sampling's mask [batch, seq]: 0 for the tokens to drop from the response mask
    (the caller multiplies it in); None: no rejection configured."""


# ----- rejection sampling (verl's rollout_rs) ------------------------------------------------

_RS_CLAMP = 20.0  # verl's SAFETY_BOUND on the log-ratio


def _token_stat(kind: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """verl's per-token statistics of g = log pi_old - log pi_rollout (clamped to +-20):
    k1 = -g, k2 = g^2 / 2, k3 = exp(g) - 1 - g."""
    g = log_ratio.clamp(-_RS_CLAMP, _RS_CLAMP)
    return {"k1": -g, "k2": 0.5 * g * g, "k3": torch.expm1(g) - g}[kind]


def _reduce(how: str, stat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum / mean / max of a token statistic over mask = 1 (max of none: 0)."""
    m = mask.to(stat.dtype)
    if how == "sum":
        return (stat * m).sum(-1)
    if how == "mean":
        return (stat * m).sum(-1) / m.sum(-1).clamp(min=1)
    top = stat.masked_fill(mask <= 0, -torch.inf).max(-1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


REJECTION_OPTIONS: Registry[tuple[str | None, str]] = Registry("rejection sampling option")
"""verl's rollout_rs names -> (per-sequence reduction or None for per-token, statistic)."""
for _kind in ("k1", "k2", "k3"):
    REJECTION_OPTIONS.register(f"token_{_kind}", (None, _kind))
    REJECTION_OPTIONS.register(f"seq_sum_{_kind}", ("sum", _kind))
    REJECTION_OPTIONS.register(f"seq_mean_{_kind}", ("mean", _kind))
for _kind in ("k2", "k3"):
    REJECTION_OPTIONS.register(f"seq_max_{_kind}", ("max", _kind))


def rejection_bounds(
    options: tuple[str, ...], threshold: str | float | None
) -> dict[str, tuple[float | None, float]]:
    """{option: (lower, upper)} from verl's threshold spec, in the statistic's own units (log
    bounds for k1); raises a ConfigError naming the field for anything malformed."""
    field = "algorithm.rollout_rejection_threshold"
    for name in options:
        REJECTION_OPTIONS.check(name, "algorithm.rollout_rejection")
    if not options:
        return {}
    if threshold is None:
        raise ConfigError(
            f"{field} is missing: algorithm.rollout_rejection={list(options)} "
            f"needs bounds, e.g. '0.5_2.0' for a *_k1 option or 0.01 for k2/k3"
        )
    specs = (
        [str(threshold)]
        if isinstance(threshold, (int, float))
        else [p.strip() for p in str(threshold).split(",") if p.strip()]
    )
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ConfigError(
            f"{field}={threshold!r}: give one bound for all options or one per "
            f"option ({len(options)}), separated by commas"
        )
    bounds: dict[str, tuple[float | None, float]] = {}
    for name, spec in zip(options, specs):
        try:
            parts = [float(x) for x in spec.split("_")]
        except ValueError:
            raise ConfigError(
                f"{field}={threshold!r}: {spec!r} (for {name}) is not a number "
                f"or a 'lower_upper' pair"
            ) from None
        if not all(math.isfinite(x) and x > 0 for x in parts) or len(parts) > 2:
            raise ConfigError(
                f"{field}={threshold!r}: {spec!r} (for {name}) must be one or two positive numbers"
            )
        if name.endswith("k1"):
            lower, upper = parts if len(parts) == 2 else (1.0 / parts[0], parts[0])
            bounds[name] = (math.log(lower), math.log(upper))
        elif len(parts) == 2:
            raise ConfigError(
                f"{field}={threshold!r}: {name} takes an upper bound only, not {spec!r}"
            )
        else:
            bounds[name] = (None, parts[0])
    return bounds


def rejection_mask(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    bounds: dict[str, tuple[float | None, float]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """(keep [batch, seq], metrics): 1 where every option in `bounds` keeps the token.

    Per option, the statistic of g = log pi_old - log pi_rollout (`_token_stat`), per token or
    reduced over the sequence, must lie in [lower, upper] (k1) or under upper (k2, k3); a
    `seq_*` option drops its whole sequence. Metrics: `rollout_corr/rs_masked_frac` (share of
    response tokens dropped), `rollout_corr/rs_seq_masked_frac` (share of sequences with any
    dropped token), and both per option."""
    check_same_shape(
        train_log_probs=train_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    on = response_mask > 0
    has = on.any(-1)
    log_ratio = (train_log_probs - rollout_log_probs).detach()
    keep = torch.ones_like(on)
    metrics: dict[str, float] = {}

    def fractions(kept: torch.Tensor) -> tuple[float, float]:
        dropped = on & ~kept
        tok = float(dropped.sum()) / max(int(on.sum()), 1)
        seq = float((dropped.any(-1) & has).sum()) / max(int(has.sum()), 1)
        return tok, seq

    for name, (lower, upper) in bounds.items():
        how, kind = REJECTION_OPTIONS.get(name)
        stat = _token_stat(kind, log_ratio)
        if how is not None:
            stat = _reduce(how, stat, response_mask).unsqueeze(-1).expand_as(log_ratio)
        ok = stat <= upper
        if lower is not None:
            ok = ok & (stat >= lower)
        keep = keep & ok
        (
            metrics[f"rollout_corr/rs_{name}_masked_frac"],
            metrics[f"rollout_corr/rs_{name}_seq_masked_frac"],
        ) = fractions(ok)
    metrics["rollout_corr/rs_masked_frac"], metrics["rollout_corr/rs_seq_masked_frac"] = fractions(
        keep
    )
    return (keep & on).to(response_mask.dtype), metrics


class CorrectionFn(Protocol):
    def __call__(
        self,
        rollout_log_probs: torch.Tensor,
        response_mask: torch.Tensor,
        config: RolloutCorrectionConfig,
        train_log_probs: torch.Tensor | None,
    ) -> RolloutCorrection: ...


ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")


def rollout_mismatch_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout policy is from the trainer's ([batch, seq], over mask=1 tokens),
    with g = log pi_old - log pi_rollout and rho = exp(g):
    `rollout_corr/log_prob_gap_mean` mean g; `rollout_corr/log_prob_abs_gap_mean` mean |g|;
    `rollout_corr/kl_k3` mean (rho - 1 - g), Schulman's k3 estimate of KL(pi_rollout ||
    pi_old) from the rollout's samples (>= 0); `rollout_corr/ratio_max` max rho."""
    check_same_shape(
        train_log_probs=train_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    gap = (train_log_probs - rollout_log_probs).detach().clamp(-_LOG_CLAMP, _LOG_CLAMP)
    return {
        "rollout_corr/log_prob_gap_mean": float(masked_mean(gap, response_mask)),
        "rollout_corr/log_prob_abs_gap_mean": float(masked_mean(gap.abs(), response_mask)),
        "rollout_corr/kl_k3": float(masked_mean(torch.expm1(gap) - gap, response_mask)),
        "rollout_corr/ratio_max": float(torch.exp(masked_max(gap, response_mask))),
    }


@ROLLOUT_CORRECTIONS.register("none", needs_train_log_probs=False, replaces_old_log_probs=False)
def no_correction(
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    train_log_probs: torch.Tensor | None,
) -> RolloutCorrection:
    """The trainer's log-probs as pi_old (when the caller has them; without them the engine
    uses the current log-probs, which equal them for one mini-batch and one epoch)."""
    old = train_log_probs if train_log_probs is not None else rollout_log_probs
    return RolloutCorrection(old, None, {})


@ROLLOUT_CORRECTIONS.register("tis", needs_train_log_probs=True, replaces_old_log_probs=False)
def truncated_is(
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    train_log_probs: torch.Tensor | None,
) -> RolloutCorrection:
    """Truncated importance weights min(pi_old / pi_rollout, cap) at `config.level`, plus
    `rollout_corr/tis_weight_mean` and `rollout_corr/tis_capped_frac` (share of tokens, or
    of sequences, whose ratio exceeded the cap)."""
    if train_log_probs is None:
        raise InputError(
            "rollout correction 'tis' needs train_log_probs: the trainer's "
            "log-probs of the current weights (engine forward before the update)"
        )
    check_same_shape(
        train_log_probs=train_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    mask = response_mask > 0
    gap = torch.where(
        mask,
        (train_log_probs - rollout_log_probs).detach(),
        torch.zeros((), dtype=train_log_probs.dtype, device=train_log_probs.device),
    )
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
    weights = torch.where(
        mask,
        torch.exp(log_w.clamp(max=log_cap)),
        torch.zeros((), dtype=gap.dtype, device=gap.device),
    )
    metrics = {
        "rollout_corr/tis_weight_mean": float(masked_mean(weights, response_mask)),
        "rollout_corr/tis_capped_frac": capped,
    }
    return RolloutCorrection(train_log_probs, weights, metrics)


@ROLLOUT_CORRECTIONS.register("bypass", needs_train_log_probs=False, replaces_old_log_probs=True)
def bypass(
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    train_log_probs: torch.Tensor | None,
) -> RolloutCorrection:
    """The rollout's log-probs as pi_old: no forward pass for them, and the PPO ratio clips
    the update against the policy that actually sampled."""
    return RolloutCorrection(rollout_log_probs, None, {})


def apply_rollout_correction(
    config: RolloutCorrectionConfig,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    train_log_probs: torch.Tensor | None = None,
) -> RolloutCorrection:
    """Run `config.mode`; with `train_log_probs` the mismatch metrics
    (`rollout_mismatch_metrics`) are added whatever the mode."""
    out = ROLLOUT_CORRECTIONS.get(config.mode)(
        rollout_log_probs, response_mask, config, train_log_probs
    )
    if train_log_probs is not None:
        out.metrics = {
            **rollout_mismatch_metrics(train_log_probs, rollout_log_probs, response_mask),
            **out.metrics,
        }
    if config.rejection:
        if train_log_probs is None:
            raise InputError(
                "rejection sampling needs train_log_probs: the trainer's "
                "log-probs of the current weights (engine forward before the "
                "update)"
            )
        out.keep, rs_metrics = rejection_mask(
            train_log_probs, rollout_log_probs, response_mask, config.bounds
        )
        out.metrics.update(rs_metrics)
        if out.weights is not None:
            out.weights = out.weights * out.keep.to(out.weights.dtype)
    return out
