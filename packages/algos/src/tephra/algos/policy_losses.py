"""Policy losses, chosen by name from `POLICY_LOSSES`.

A registered loss maps
    (log_probs, old_log_probs, advantages, response_mask: [batch, seq], PolicyLossConfig)
    -> (per-token loss [batch, seq], metrics: dict[str, float])
and `compute_policy_loss` aggregates the per-token loss with an explicit global normaliser
(`tephra.algos.aggregation`). Notation: ratio r_t = pi(y_t) / pi_old(y_t) = exp(log_probs -
old_log_probs) (the log-ratio clamped to +-`log_ratio_clamp`), A_t the advantage,
eps_l / eps_h the lower / upper clip ratios. Metrics are masked means over this call's
response tokens: `pg_clipfrac` (share of tokens whose gradient the clip removed), `ppo_kl`
(k1 estimate of KL(pi_old || pi): mean of old - new log-prob), `ratio_mean`, `ratio_max`,
`ratio_min`, plus a loss's own. To add a loss, register a function of that signature:
`@POLICY_LOSSES.register("name")`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tephra.algos.aggregation import aggregate_loss
from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_count, masked_max, masked_mean, masked_min
from tephra.algos.policy_loss_config import PolicyLossConfig
from tephra.algos.registry import Registry

# (per-token loss [batch, seq], metrics)
LossOutput = tuple[torch.Tensor, dict[str, float]]
PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossConfig], LossOutput
]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, config: PolicyLossConfig
) -> torch.Tensor:
    c = config.log_ratio_clamp
    return (log_probs - old_log_probs).clamp(min=-c, max=c)


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    lr = log_ratio.detach()
    ratio = lr.exp()
    return {
        "ppo_kl": float(masked_mean(-lr, mask)),
        "ratio_mean": float(masked_mean(ratio, mask)),
        "ratio_max": float(masked_max(ratio, mask)),
        "ratio_min": float(masked_min(ratio, mask)),
    }


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(flags.to(torch.float32), mask))


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h)) and whether the clipped branch won."""
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    return torch.maximum(pg1, pg2), pg2 > pg1


@POLICY_LOSSES.register("vanilla")
def vanilla(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms") with decoupled clip ratios (clip-higher, DAPO: Yu et al. 2025) and dual-clip
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"):
        L_t = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))
        L_t = min(L_t, -A c)  where A < 0    (c = clip_ratio_c; bounds the loss of very
                                              off-policy tokens with negative advantage)
    Extra metric `pg_clipfrac_lower`: share of tokens where the dual clip is active.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    loss, clipped = _clipped_surrogate(log_ratio.exp(), advantages, config)
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = _frac(clipped, response_mask)
    if config.clip_ratio_c is not None:
        bound = -advantages * config.clip_ratio_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["pg_clipfrac_lower"] = _frac(dual, response_mask)
    return loss, metrics


# verl's `bypass_mode` loss (its default loss_type ppo_clip): the PPO clipped surrogate with the
# rollout log-probs as the old log-probs, which the trainer passes when
# `algorithm.rollout_correction=bypass` (the app requires it with this name).
POLICY_LOSSES.register("bypass_mode", vanilla, old_log_probs="rollout")


@POLICY_LOSSES.register("gspo")
def gspo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level,
    length-normalised ratio s_i = exp(mean_t (log pi - log pi_old)), used at every token
    through the token form that keeps per-token gradients:
        log s_{i,t} = sg(log s_i) + log pi(y_t) - sg(log pi(y_t))
        L_t = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_l, 1 + eps_h))
    The paper aggregates with `seq-mean-token-mean` and uses eps around 3e-4 / 4e-4.
    """
    raw = torch.where(response_mask > 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    n = masked_count(response_mask, dim=-1).clamp(min=1).to(log_probs.dtype)
    seq_log_ratio = (raw.sum(-1) / n).clamp(max=10.0)  # exp(10): beyond any clip range
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    loss, clipped = _clipped_surrogate(token_log_ratio.exp(), advantages, config)
    metrics = _ratio_metrics(token_log_ratio, response_mask)
    metrics["ppo_kl"] = float(masked_mean(-raw.detach(), response_mask))
    metrics["pg_clipfrac"] = _frac(clipped, response_mask)
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention"): clip the importance-sampling weight, not the update, so every token keeps a
    gradient:
        L_t = -sg(clip(r, 1 - eps_l, 1 + eps_h)) * A * log pi(y_t)
    `pg_clipfrac`: share of tokens whose weight was clipped.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    loss = -weight * advantages * log_probs
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = _frac(weight != ratio, response_mask)
    return loss, metrics


@POLICY_LOSSES.register("sapo")
def sapo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate instead of
    the hard clip,
        f_tau(r) = (4 / tau) * sigmoid(tau * (r - 1)),   L_t = -A f_tau(r)
    with tau = tau_pos for A > 0 and tau_neg otherwise. The gradient weight
    f'(r) = 4 sigmoid(.)(1 - sigmoid(.)) is 1 on-policy (r = 1) and decays smoothly off-policy.
    Metric `sapo_gate_mean`: mean gradient weight.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    ratio = log_ratio.exp()
    # built in the ratio's dtype: Python floats in torch.where would round through float32
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, config.sapo_tau_pos),
        torch.full_like(ratio, config.sapo_tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -advantages * gate * (4.0 / tau)
    metrics = _ratio_metrics(log_ratio, response_mask)
    g = gate.detach()
    metrics["sapo_gate_mean"] = float(masked_mean(4.0 * g * (1.0 - g), response_mask))
    metrics["pg_clipfrac"] = 0.0
    return loss, metrics


def _centred_cov(
    advantages: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token (A_t - mean A)(log pi_t - mean log pi), means over the masked tokens."""
    a = advantages.detach()
    lp = log_probs.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models"): the PPO clipped surrogate, plus: among tokens not already
    clipped with covariance cov_t = (A_t - mean A)(log pi_t - mean log pi) in
    (clip_cov_lb, clip_cov_ub), a random max(1, floor(clip_cov_ratio * N)) (N = response
    tokens of this call) have their loss and gradient removed, which keeps entropy from
    collapsing. Metric `cov_clipfrac`: share of tokens removed this way.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    loss, clipped = _clipped_surrogate(log_ratio.exp(), advantages, config)
    valid = response_mask > 0
    cov = _centred_cov(advantages, log_probs, response_mask)
    candidates = valid & ~clipped & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    idx = torch.nonzero(candidates.reshape(-1), as_tuple=True)[0]
    n_clip = max(int(config.clip_cov_ratio * int(valid.sum())), 1)
    keep = torch.ones_like(loss)
    if idx.numel() > 0:
        gen = None
        if config.clip_cov_seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(config.clip_cov_seed)
        chosen = idx[torch.randperm(idx.numel(), generator=gen)[:n_clip].to(idx.device)]
        keep.view(-1)[chosen] = 0.0
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = _frac(clipped, response_mask)
    metrics["cov_clipfrac"] = _frac(keep == 0, response_mask)
    return loss * keep, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """KL-Cov (Cui et al. 2025, same paper as Clip-Cov): the unclipped surrogate -A r, plus a
    KL penalty on the max(1, floor(kl_cov_ratio * N)) tokens with the largest covariance
    cov_t = (A_t - mean A)(log pi_t - mean log pi):
        L_t = -A r + kl_cov_coef * |log pi - log pi_old|   (selected tokens)
        L_t = -A r                                          (others)
    Metric `kl_cov_frac`: share of tokens penalised.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    loss = -advantages * log_ratio.exp()
    valid = response_mask > 0
    n_valid = int(valid.sum())
    selected = torch.zeros_like(valid)
    if n_valid > 0:
        cov = _centred_cov(advantages, log_probs, response_mask)
        idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        k = max(1, int(n_valid * config.kl_cov_ratio))
        top = torch.topk(cov.reshape(-1)[idx], k).indices
        selected.view(-1)[idx[top]] = True
    penalty = config.kl_cov_coef * (log_probs - old_log_probs).abs()
    loss = torch.where(selected, loss + penalty, loss)
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = 0.0
    metrics["kl_cov_frac"] = _frac(selected, response_mask)
    return loss, metrics


@POLICY_LOSSES.register("gpg")
def gpg_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"):
    plain policy gradient, no ratio and no clip (pair with the `gpg` estimator):
        L_t = -A log pi(y_t)
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = 0.0
    return -advantages * log_probs, metrics


@POLICY_LOSSES.register("geo_mean", aggregation="seq-mean-token-mean")
def geo_mean(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the geometric mean of the
    token ratios, each clipped in the direction of the advantage's sign,
        l_t  = sign(A) * min(sign(A) * log r_t, sign(A) * clip(log r_t, -eps_l, eps_h))
        L_i  = -Abar_i * exp(mean_t l_t)            Abar_i: the sequence's mean advantage
    The sequence loss is repeated on each of its tokens and averaged over sequences (verl's
    `geo_mean` ignores loss_agg_mode; so does this one). `pg_clipfrac`: tokens whose log
    ratio left [-eps_l, eps_h] with A > 0 (`pg_clipfrac_lower`: with A < 0).
    """
    raw = torch.where(response_mask > 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    sign = torch.sign(advantages)
    clamped = raw.clamp(-config.eps_low, config.eps_high)
    chosen = sign * torch.minimum(sign * raw, sign * clamped)
    chosen = torch.where(response_mask > 0, chosen, torch.zeros_like(chosen))
    n = masked_count(response_mask, dim=-1).clamp(min=1).to(log_probs.dtype)
    ratio = (chosen.sum(-1) / n).exp()
    mean_adv = torch.where(response_mask > 0, advantages, torch.zeros_like(advantages)).sum(-1) / n
    loss = (-mean_adv * ratio).unsqueeze(-1).expand_as(log_probs)
    clipped = raw != clamped
    metrics = _ratio_metrics(raw, response_mask)
    metrics["pg_clipfrac"] = _frac(clipped & (advantages > 0), response_mask)
    metrics["pg_clipfrac_lower"] = _frac(clipped & (advantages < 0), response_mask)
    return loss, metrics


@POLICY_LOSSES.register("dro")
def dro(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """DRO as verl's `dro` loss mode (Direct Reward Optimization, Richemond et al. 2024,
    "Offline Regularised Reinforcement Learning for LLMs Alignment", in its per-token form): a
    policy gradient with a quadratic proximity penalty instead of a clip,
        L_t = -(A log pi(y_t) - (beta / 2) (log pi(y_t) - log pi_old(y_t))^2)
        dL_t / d log pi = -A + beta (log pi - log pi_old)
    beta = `dro_beta`; the penalty uses the raw (unclamped) log-ratio.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    penalty = 0.5 * config.dro_beta * (log_probs - old_log_probs).square()
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = 0.0
    return -(advantages * log_probs - penalty), metrics


def _dppo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    valid: torch.Tensor,
) -> LossOutput:
    """-A sg(min(r, cap)) valid log pi: the shared DPPO policy gradient, given its mask."""
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    ratio = log_ratio.detach().exp()
    cap = config.dppo_ratio_cap
    if cap is None:  # verl: clip_ratio_c, or 20 where the config has none
        cap = config.clip_ratio_c if config.clip_ratio_c is not None else 20.0
    weight = ratio.clamp(max=cap)
    keep = valid.detach().to(log_probs.dtype)
    loss = -advantages * weight * log_probs * keep
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = _frac(~valid, response_mask)
    metrics["pg_clipfrac_lower"] = _frac(valid & (weight != ratio), response_mask)
    return loss, metrics


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """DPPO-Binary-TV (verl's `dppo_tv`; arXiv 2602.04879): a trust region on the sampled
    token's probability instead of on the ratio. With p = pi(y_t), q = pi_old(y_t),
        valid_t = (p - q <= eps_h) if A > 0 else (p - q >= -eps_l)
        L_t = -A sg(min(r, C)) valid_t log pi(y_t)     (C = `dppo_ratio_cap`)
    so a token moved more than eps (in probability) in the advantage's direction gets no
    gradient. eps_l / eps_h are `clip_ratio_low` / `clip_ratio_high`, read as probability
    distances. `pg_clipfrac`: share of masked-out tokens; `pg_clipfrac_lower`: share of
    valid tokens whose weight was truncated.
    """
    dp = log_probs.detach().exp() - old_log_probs.exp()
    valid = torch.where(advantages > 0, dp <= config.eps_high, dp >= -config.eps_low)
    return _dppo(log_probs, old_log_probs, advantages, response_mask, config, valid)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """DPPO-Binary-KL (verl's `dppo_kl`; arXiv 2602.04879): as `dppo_tv` with the KL between
    the Bernoulli distributions (q, 1 - q) and (p, 1 - p) of "the sampled token or not",
        D_t = q (log q - log p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))
        valid_t = D_t <= eps_h or p <= q    (A > 0: only a rise of p is bounded)
        valid_t = D_t <= eps_l or p >= q    (A <= 0: only a fall of p is bounded)
        L_t = -A sg(min(r, C)) valid_t log pi(y_t)
    """
    lp = log_probs.detach()
    p, q = lp.exp(), old_log_probs.exp()
    div = q * (old_log_probs - lp) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(
        advantages > 0,
        (div <= config.eps_high) | (p <= q),
        (div <= config.eps_low) | (p >= q),
    )
    return _dppo(log_probs, old_log_probs, advantages, response_mask, config, valid)


def compute_policy_loss(
    name: str,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    loss_agg_mode: str = "token-mean",
    global_token_count: float | torch.Tensor,
    global_seq_count: float | torch.Tensor,
    norm_constant: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(this micro-batch's loss contribution, metrics) of the policy loss `name`.

    All tensors [batch, seq]; `token_weights` (e.g. truncated importance weights, no graph)
    multiply the per-token loss before aggregation.
    """
    fn = POLICY_LOSSES.get(name)
    check_same_shape(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        response_mask=response_mask,
    )
    config = config if config is not None else PolicyLossConfig()
    loss_mat, metrics = fn(log_probs, old_log_probs, advantages, response_mask, config)
    loss_mat = weigh_policy_loss(name, loss_mat, token_weights, response_mask)
    loss = aggregate_loss(
        loss_mat,
        response_mask,
        policy_aggregation(name, loss_agg_mode),
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_constant=norm_constant,
    )
    return loss, metrics


@POLICY_LOSSES.register("sppo", aggregation="seq-mean-token-mean")
def sppo(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> LossOutput:
    """SPPO (Wu et al. 2024, "Self-Play Preference Optimization for Language Model
    Alignment"): squared regression of the sequence log-ratio to the estimator's target,
        L_i = (sum_t m_t log(pi(y_t) / pi_old(y_t)) - Abar_i)^2
    with pi_old the sampling policy (SPPO's previous iteration pi_t) and Abar_i the
    sequence's mean advantage, eta * (P(y_i > pi_t) - 1/2) from the `sppo` estimator. The
    sequence loss is repeated on its tokens and averaged over sequences (it fixes its own
    aggregation). Token log-ratios are clamped to +-`log_ratio_clamp`."""
    log_ratio = _log_ratio(log_probs, old_log_probs, config)
    on = response_mask > 0
    seq_ratio = torch.where(on, log_ratio, torch.zeros_like(log_ratio)).sum(-1)
    n = masked_count(response_mask, dim=-1).clamp(min=1).to(log_probs.dtype)
    target = torch.where(on, advantages, torch.zeros_like(advantages)).sum(-1) / n
    loss = (seq_ratio - target.detach()).square().unsqueeze(-1).expand_as(log_probs)
    metrics = _ratio_metrics(log_ratio, response_mask)
    metrics["pg_clipfrac"] = 0.0
    return loss, metrics


def policy_aggregation(name: str, loss_agg_mode: str) -> str:
    """The aggregation of policy loss `name`: a sequence-level loss (its value repeated on
    every token, e.g. `geo_mean`) fixes its own, as verl's ignores `loss_agg_mode`; the others
    take `loss_agg_mode`."""
    return str(POLICY_LOSSES.meta(name).get("aggregation", loss_agg_mode))


def weigh_policy_loss(
    name: str,
    loss_mat: torch.Tensor,
    token_weights: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """loss_mat [batch, seq] times importance weights (no gradient). A sequence-level loss
    takes the geometric mean of its tokens' weights, one per sequence, as verl's `geo_mean`
    does with `rollout_is_weights`: exp(sum_t m_t log(w_t + 1e-10) / (sum_t m_t + 1e-8))."""
    if token_weights is None:
        return loss_mat
    weights = token_weights.detach()
    if "aggregation" in POLICY_LOSSES.meta(name):
        m = response_mask.to(weights.dtype)
        log_w = (torch.log(weights + 1e-10) * m).sum(-1) / (m.sum(-1) + 1e-8)
        weights = log_w.exp().unsqueeze(-1)
    return loss_mat * weights


__all__ = ["POLICY_LOSSES", "compute_policy_loss", "policy_aggregation", "weigh_policy_loss"]
