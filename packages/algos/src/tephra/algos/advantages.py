"""Advantage estimators, chosen by name from `ADVANTAGE_ESTIMATORS`.

All tensors are [batch, seq] aligned with input_ids; `response_mask` marks the tokens the
policy generated. Outcome rewards are placed by the caller at the last response token of
`token_rewards`; an outcome estimator's score of sample i is
    s_i = sum_t m[i, t] * r[i, t].
Group membership comes from `group_ids` ([batch] int64, the prompt uid), never batch order.
Token-level recursions (GAE, discounted returns) run over RESPONSE tokens only: positions
with mask 0 (prompt, tool output, padding) are skipped, so inserting or removing them never
changes a result (the "time" of the MDP is the index among response tokens).
Advantages and returns are 0 where the mask is 0.

A group of one sample has no baseline: its baseline is 0 and its std 1 (the sample's own
score is its signal), in every group estimator below.

To add an estimator: `@ADVANTAGE_ESTIMATORS.register("name")` on a function taking the
keyword arguments token_rewards, response_mask, group_ids, values, baselines, config and
returning (advantages, returns), both [batch, seq] and 0 where the mask is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tephra.algos.config import AdvantageConfig
from tephra.algos.errors import InputError
from tephra.algos.groups import Groups, group_index
from tephra.algos.inputs import check_per_sample, check_same_shape, float_mask
from tephra.algos.masked import masked_sum, masked_whiten
from tephra.algos.registry import Registry
from tephra.algos.self_play import win_rates

# (advantages [batch, seq], returns [batch, seq])
AdvantagePair = tuple[torch.Tensor, torch.Tensor]
# called with keyword arguments only (see the module docstring)
Estimator = Callable[..., AdvantagePair]

ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def compute_advantages(
    name: str,
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
    config: AdvantageConfig | None = None,
    baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [batch, seq], returns [batch, seq]) by the estimator registered as `name`.

    token_rewards: [batch, seq] rewards (outcome reward at the last response token, plus any
        per-token terms such as a KL penalty). response_mask: [batch, seq] 1 = generated.
    group_ids: [batch] int64 prompt uid. values: [batch, seq] critic values (`gae` only).
    baselines: [batch] reward of the greedy response (`remax` only).
    old_log_probs, sum_pi_squared: [batch, seq] log pi_old(y_t) and sum_v pi_old(v)^2 of the
    sampling policy (the optimal-token-baseline estimators only, metadata needs_token_stats).
    rollout_is_weights: [batch, seq] rollout importance weights rho (the optimal-token-baseline
    estimators scale their path weights by rho^2, as verl; None: no scaling; others ignore it).
    reward_components: [batch, K] per-sample reward components (`gdpo` only; None: the one
    component sum_t token_rewards).
    Computed without a graph: advantages are constants of the policy loss.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    config = config if config is not None else AdvantageConfig()
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    if not token_rewards.is_floating_point():
        raise InputError(f"token_rewards must be floating point, got {token_rewards.dtype}")
    check_per_sample("group_ids", group_ids, token_rewards.shape[0], integer=True)
    if values is not None:
        check_same_shape(token_rewards=token_rewards, values=values)
    if baselines is not None:
        check_per_sample("baselines", baselines, token_rewards.shape[0])
    extra: dict[str, torch.Tensor] = {}
    if ADVANTAGE_ESTIMATORS.meta(name).get("needs_token_stats"):
        if old_log_probs is None or sum_pi_squared is None:
            field = "old_log_probs" if old_log_probs is None else "sum_pi_squared"
            raise InputError(
                f"advantage estimator {name!r} needs {field}=[batch, seq] of the "
                "sampling policy; pass it or choose e.g. 'grpo'"
            )
        check_same_shape(
            token_rewards=token_rewards, old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared
        )
        extra = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared}
        if rollout_is_weights is not None:
            check_same_shape(token_rewards=token_rewards, rollout_is_weights=rollout_is_weights)
            extra["rollout_is_weights"] = rollout_is_weights
    if reward_components is not None:
        if (
            reward_components.dim() != 2
            or reward_components.shape[0] != token_rewards.shape[0]
            or not reward_components.is_floating_point()
        ):
            raise InputError(
                f"reward_components must be a floating [batch={token_rewards.shape[0]}, K] "
                f"tensor (one column per reward), got {reward_components.dtype} "
                f"{tuple(reward_components.shape)}"
            )
        extra["reward_components"] = reward_components
    with torch.no_grad():
        return fn(
            token_rewards=token_rewards,
            response_mask=response_mask,
            group_ids=group_ids,
            values=values,
            baselines=baselines,
            config=config,
            **extra,
        )


def _scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(token_rewards, response_mask, dim=-1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(-1) * float_mask(response_mask, per_sample)


def _baseline_and_scale(
    groups: Groups, scores: torch.Tensor, eps: float, by_std: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and (std + eps, or 1): singletons get mean 0 and scale 1."""
    single = groups.sizes[groups.index] == 1
    mean = torch.where(single, torch.zeros_like(scores), groups.mean(scores)[groups.index])
    if not by_std:
        return mean, torch.ones_like(scores)
    std = groups.std(scores)[groups.index]
    scale = torch.where(single, torch.ones_like(scores), std + eps)
    return mean, scale


def _reverse_scan(
    x: torch.Tensor, mask: torch.Tensor, step: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Right-to-left recursion over response tokens; masked positions carry the state
    through unchanged and output 0."""
    out = torch.zeros_like(x)
    carry = torch.zeros_like(x[:, 0])
    on = mask > 0
    for t in range(x.shape[1] - 1, -1, -1):
        new = step(t, carry)
        carry = torch.where(on[:, t], new, carry)
        out[:, t] = torch.where(on[:, t], new, torch.zeros_like(new))
    return out


@ADVANTAGE_ESTIMATORS.register("gae", needs_values=True)
def gae(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None,
    config: AdvantageConfig,
    **_unused: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation"), over response tokens t < t' < ...:
        delta_t = r_t + gamma * V_{next(t)} - V_t      (V after the last response token = 0)
        A_t = delta_t + gamma * lam * A_{next(t)}
        returns_t = A_t + V_t;  advantages = whiten(A) over the batch (`whiten_gae`).
    VAPO's decoupled lambda (Yue et al. 2025): the advantages use `lam_actor` and the returns
    `lam_critic` (returns_t = A_t(lam_critic) + V_t); with `lam_length_alpha` = alpha the
    actor's lambda of sample i is 1 - 1 / (alpha * l_i), l_i its response-token count.
    """
    if values is None:
        raise InputError(
            "advantage estimator 'gae' needs values=[batch, seq] from the critic; "
            "pass values= or choose an estimator without a critic (e.g. 'grpo')"
        )
    on = response_mask > 0
    actor_lam = torch.full_like(values[:, 0], config.actor_lam)
    if config.lam_length_alpha is not None:
        lengths = on.sum(-1).to(values.dtype).clamp(min=1)
        actor_lam = (1.0 - 1.0 / (config.lam_length_alpha * lengths)).clamp(0.0, 1.0)
    adv = _gae_scan(token_rewards, values, on, config.gamma, actor_lam)
    if config.lam_length_alpha is None and config.critic_lam == config.actor_lam:
        critic_adv = adv
    else:
        critic_lam = torch.full_like(values[:, 0], config.critic_lam)
        critic_adv = _gae_scan(token_rewards, values, on, config.gamma, critic_lam)
    returns = torch.where(on, critic_adv + values, torch.zeros_like(adv))
    if config.whiten_gae:
        adv = masked_whiten(adv, response_mask)
    return adv, returns


def _gae_scan(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    on: torch.Tensor,
    gamma: float,
    lam: torch.Tensor,
) -> torch.Tensor:
    """GAE advantages [batch, seq] with a per-sample lambda `lam` [batch]; 0 where not `on`."""
    rewards = torch.where(on, token_rewards, torch.zeros_like(token_rewards))
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_value = torch.where(on[:, t], values[:, t], next_value)
        next_adv = torch.where(on[:, t], a, next_adv)
        adv[:, t] = torch.where(on[:, t], a, torch.zeros_like(a))
    return adv


@ADVANTAGE_ESTIMATORS.register("grpo", needs_groups=True)
def grpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """GRPO (Shao et al. 2024, "DeepSeekMath"): outcome advantage relative to the group,
        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)    (std: unbiased, within the group)
    or, with `norm_by_std=False`, A_i = s_i - mean_g(s) (Dr. GRPO, Liu et al. 2025).
    Broadcast to every response token; returns = advantages.
    """
    scores = _scores(token_rewards, response_mask)
    mean, scale = _baseline_and_scale(
        group_index(group_ids), scores, config.epsilon, config.norm_by_std
    )
    adv = _broadcast((scores - mean) / scale, response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("dr_grpo", needs_groups=True)
def dr_grpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = s_i - mean_g(s),
    GRPO without the std division whatever `norm_by_std` says (pair it with the
    `seq-mean-token-sum-norm` aggregation)."""
    scores = _scores(token_rewards, response_mask)
    mean, _ = _baseline_and_scale(group_index(group_ids), scores, config.epsilon, False)
    adv = _broadcast(scores - mean, response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo", needs_groups=True)
def rloo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    **_unused: object,
) -> AdvantagePair:
    """RLOO (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian
    et al. 2024): leave-one-out baseline,
        A_i = s_i - (1 / (n - 1)) sum_{j != i} s_j = n / (n - 1) * (s_i - mean_g(s)).
    """
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    n = groups.sizes[groups.index].to(scores.dtype)
    loo = (groups.sum(scores)[groups.index] - scores) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, scores - loo, scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """REINFORCE++ (Hu 2025, "REINFORCE++"): discounted return over response tokens,
        G_t = r_t + gamma * G_{next(t)},  A = whiten(G) over the batch's response tokens.
    returns = G (before whitening).
    """
    rewards = torch.where(response_mask > 0, token_rewards, torch.zeros_like(token_rewards))
    returns = _reverse_scan(
        rewards, response_mask, lambda t, carry: rewards[:, t] + config.gamma * carry
    )
    return masked_whiten(returns, response_mask), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", needs_groups=True)
def reinforce_plus_plus_baseline(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    **_unused: object,
) -> AdvantagePair:
    """REINFORCE++ with a group baseline (Hu 2025): A_i = s_i - mean_g(s) on every response
    token, then whitened over the batch's response tokens (token-weighted). returns = A."""
    scores = _scores(token_rewards, response_mask)
    mean, _ = _baseline_and_scale(group_index(group_ids), scores, 1.0, False)
    adv = masked_whiten(_broadcast(scores - mean, response_mask), response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("remax", needs_baselines=True)
def remax(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    baselines: torch.Tensor | None,
    **_unused: object,
) -> AdvantagePair:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient RL Method for
    Aligning LLMs"): the baseline is the reward b_i of the greedy response to the same prompt,
        G_t = sum_{t' >= t} r_t' (response tokens),  A_t = G_t - b_i.   returns = G.
    """
    if baselines is None:
        raise InputError(
            "advantage estimator 'remax' needs baselines=[batch]: the reward of "
            "the greedy (argmax) response to each sample's prompt"
        )
    rewards = torch.where(response_mask > 0, token_rewards, torch.zeros_like(token_rewards))
    returns = _reverse_scan(rewards, response_mask, lambda t, carry: rewards[:, t] + carry)
    adv = returns - _broadcast(baselines.to(returns.dtype), response_mask)
    return adv, returns


@ADVANTAGE_ESTIMATORS.register("opo", needs_groups=True)
def opo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    **_unused: object,
) -> AdvantagePair:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): the
    length-weighted group baseline, optimal for sequence-level policy gradients,
        b_g = sum_{j in g} |y_j| s_j / sum_{j in g} |y_j|,   A_i = s_i - b_g
    with |y| the number of response tokens."""
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    lengths = (response_mask > 0).sum(-1).to(scores.dtype)
    baseline = groups.sum(lengths * scores) / groups.sum(lengths).clamp(min=1)
    baseline = torch.where(
        groups.sizes[groups.index] == 1, torch.zeros_like(scores), baseline[groups.index]
    )
    adv = _broadcast(scores - baseline, response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("gpg", needs_groups=True)
def gpg(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    **_unused: object,
) -> AdvantagePair:
    """GPG as verl computes it (`compute_gpg_outcome_advantage`, f_norm = 1): group-centred
    scores rescaled by the share of samples with a non-zero score,
        A_i = alpha * (s_i - mean_g(s)),   alpha = B / max(#{j : s_j != 0}, 1)
    B the batch size; a group of one has baseline 0. No division by the group std, whatever
    `norm_by_std` says. The paper's own alpha is `gpg_paper`."""
    scores = _scores(token_rewards, response_mask)
    mean, _ = _baseline_and_scale(group_index(group_ids), scores, 0.0, False)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = _broadcast(alpha * (scores - mean), response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("gpg_paper", needs_groups=True)
def gpg_paper(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """GPG as the paper defines it (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning"): group-centred advantage rescaled for the samples
    that carry no signal,
        A_i = alpha * (s_i - mean_g(s)) / F,   alpha = B / max(B - M, 1)
    with B the batch size, M the samples in groups whose scores are all equal (zero
    advantage), F = std_g(s) + eps when `norm_by_std` else 1. Groups of one count as
    informative (their baseline is 0)."""
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    mean, scale = _baseline_and_scale(groups, scores, config.epsilon, config.norm_by_std)
    flat = (groups.max(scores) == groups.min(scores)) & (groups.sizes > 1)
    m = int(groups.sizes[flat].sum())
    b = scores.shape[0]
    alpha = b / max(b - m, 1)
    adv = _broadcast(alpha * (scores - mean) / scale, response_mask)
    return adv, adv


def _max_at_k_weights(n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """P(the largest of a uniformly random k-subset of n sorted values is the j-th smallest)
    = C(j - 1, k - 1) / C(n, k), j = 1..n."""
    total = math.comb(n, k)
    return torch.tensor([math.comb(j, k - 1) / total for j in range(n)], dtype=dtype, device=device)


@ADVANTAGE_ESTIMATORS.register("passk_expectation", needs_groups=True, needs_k=True)
def passk_expectation(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """Pass@k advantage (Chen et al. 2025, "Pass@k Training for Adaptively Balancing
    Exploration and Exploitation of Large Reasoning Models"), in its max@k form so that it
    also holds for non-binary scores. For a group of n scores and k = `passk_k`:
        R_g   = E_S[max_{j in S} s_j]          S a uniformly random k-subset of the group
        A_i   = (E_S[max_{j in S} s_j | i in S] - R_g) / (sigma_g + eps)
        sigma_g^2 = Var_S[max_{j in S} s_j]    (sigma = 1 when `norm_by_std` is False)
    For 0/1 rewards with c correct this is the paper's analytic form: R_g = 1 - C(n-c, k) /
    C(n, k); a correct sample gets (1 - R_g) / sigma, a wrong one (1 - C(n-c-1, k-1) /
    C(n-1, k-1) - R_g) / sigma. k = 1 gives GRPO with the population std.
    """
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    k = config.passk_k
    per_sample = torch.zeros_like(scores)
    for g in range(groups.n_groups):
        members = groups.members(g)
        n = members.numel()
        if n < k:
            raise InputError(
                f"passk_expectation: group with id {int(groups.ids[g])} has {n} samples, fewer than "
                f"AdvantageConfig.passk_k={k}; lower passk_k or sample more per prompt"
            )
        s = scores[members]
        w = _max_at_k_weights(n, k, s.dtype, s.device)
        sorted_s, _ = torch.sort(s)
        mean = (w * sorted_s).sum()
        var = ((w * sorted_s.square()).sum() - mean.square()).clamp(min=0)
        if k == 1:
            conditional = s
        else:
            # Given i in S, the other k - 1 members are a random (k-1)-subset of the other
            # n - 1 scores: E[max(s_i, max of them)].
            w_rest = _max_at_k_weights(n - 1, k - 1, s.dtype, s.device)
            others = (
                s.unsqueeze(0)
                .expand(n, n)[~torch.eye(n, dtype=torch.bool, device=s.device)]
                .view(n, n - 1)
            )
            others, _ = torch.sort(others, dim=-1)
            conditional = (w_rest * torch.maximum(others, s.unsqueeze(-1))).sum(-1)
        scale = var.sqrt() + config.epsilon if config.norm_by_std else 1.0
        per_sample[members] = (conditional - mean) / scale
    adv = _broadcast(per_sample, response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("grpo_passk", needs_groups=True)
def grpo_passk(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """verl's `grpo_passk` (after Tang et al. 2025, "Optimizing Language Models for Inference
    Time Objectives using Reinforcement Learning", arXiv 2503.19595): in each group only the
    best sample learns, by its lead over the runner-up,
        A_best = (s_(1) - s_(2)) / (std_g(s) + eps)     (std unbiased; no division when
        A_other = 0                                      `norm_by_std` is False)
    The best is the first sample holding the maximum score. Groups need at least 2 samples.
    tephra's expectation form of pass@k is `passk_expectation`.
    """
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    per_sample = torch.zeros_like(scores)
    for g in range(groups.n_groups):
        members = groups.members(g)
        if members.numel() < 2:
            raise InputError(
                f"grpo_passk: group with id {int(groups.ids[g])} has "
                f"{members.numel()} sample; it needs at least 2 per group"
            )
        s = scores[members]
        best = int(torch.argmax(s))  # the first index of the maximum
        runner_up = torch.cat([s[:best], s[best + 1 :]]).max()
        lead = s[best] - runner_up
        if config.norm_by_std:
            lead = lead / (s.std() + config.epsilon)
        per_sample[members[best]] = lead
    adv = _broadcast(per_sample, response_mask)
    return adv, adv


# verl's names for the same estimators (verl's vectorised implementations of GRPO and RLOO
# compute the same numbers for groups of two or more samples; see the README's verl table)
@ADVANTAGE_ESTIMATORS.register("grpo_vectorized", needs_groups=True)
def grpo_vectorized(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """verl's vectorised GRPO (`compute_grpo_vectorized_outcome_advantage`): `grpo` with the
    group variance floored at eps before the square root,
        A_i = (s_i - mean_g) / (sqrt(max(var_g, eps)) + eps),   groups of one: mean 0, std 1.
    """
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    mean, _ = _baseline_and_scale(groups, scores, config.epsilon, False)
    if not config.norm_by_std:
        adv = _broadcast(scores - mean, response_mask)
        return adv, adv
    single = groups.sizes[groups.index] == 1
    std = groups.std(scores).square().clamp(min=config.epsilon).sqrt()[groups.index]
    scale = torch.where(single, torch.ones_like(scores), std + config.epsilon)
    adv = _broadcast((scores - mean) / scale, response_mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo_vectorized", needs_groups=True)
def rloo_vectorized(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    **_unused: object,
) -> AdvantagePair:
    """verl's vectorised RLOO (`compute_rloo_vectorized_outcome_advantage`): `rloo`, except
    that a group of one gets 0 (plain `rloo` gives it its raw score, as verl's `rloo` does)."""
    scores = _scores(token_rewards, response_mask)
    groups = group_index(group_ids)
    n = groups.sizes[groups.index].to(scores.dtype)
    loo = (groups.sum(scores)[groups.index] - scores) / (n - 1).clamp(min=1)
    adv = _broadcast(torch.where(n > 1, scores - loo, torch.zeros_like(scores)), response_mask)
    return adv, adv


def _otb_baseline(
    returns: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    groups: Groups,
    zero_tail: bool,
    eps: float,
) -> torch.Tensor:
    """Per-group, per-column B_t = sum_j G_jt W_jt m_jt / (sum_j W_jt m_jt + eps); groups of
    one get B = 0. With `zero_tail`, a group's unique longest sample (by mask count) gets
    B = 0 from column L2 on, L2 the second-longest length: no other sample informs it."""
    m = mask.to(returns.dtype)
    base = torch.zeros_like(returns)
    lengths = (mask > 0).sum(-1)
    for g in range(groups.n_groups):
        members = groups.members(g)
        if members.numel() < 2:
            continue
        num = (returns[members] * weights[members] * m[members]).sum(0)
        den = (weights[members] * m[members]).sum(0) + eps
        base[members] = (num / den).unsqueeze(0)
        if zero_tail:
            lens = lengths[members]
            top2 = torch.sort(lens).values[-2:]
            if top2[1] > top2[0]:
                base[members[int(torch.argmax(lens))], int(top2[0]) :] = 0.0
    return base


@ADVANTAGE_ESTIMATORS.register("optimal_token_baseline", needs_groups=True, needs_token_stats=True)
def optimal_token_baseline(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    config: AdvantageConfig,
    rollout_is_weights: torch.Tensor | None = None,
    **_unused: object,
) -> AdvantagePair:
    """Optimal token baseline (verl's `optimal_token_baseline`): a baseline per token position
    that minimises the variance of the token-level policy gradient within a prompt group.
    With pi_t = exp(old_log_probs) and q_t = sum_v pi_old(v | .)^2 (`sum_pi_squared`),
        w_t = (1 - 2 pi_t + q_t) rho_t^2 (||grad log pi(y_t)||^2 proxy of the softmax logits;
                                         rho = `rollout_is_weights`, 1 when None)
        W_t = sum_{t' <= t} m_t' w_t'    (cumulative over columns)
        G_t = sum_{t' >= t} m_t' r_t'    (reward-to-go over columns)
        B_t = sum_{j in g} m_jt G_jt W_jt / (sum_{j in g} m_jt W_jt + 1e-8)
        A_t = m_t (G_t - B_t);  returns = m_t G_t (verl keeps G at masked columns too).
    Columns are absolute positions (samples are aligned by index, not by response-token
    count; see `tir_optimal_token_baseline` for the aligned form). Groups of one: B = 0.
    `handle_zero_tail` (default False here): B = 0 on the unique longest sample's columns
    from the second-longest's length on.
    """
    returns, weights = _otb_inputs(
        token_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
    )
    zero_tail = bool(config.handle_zero_tail)  # None: verl's default for this one, False
    base = _otb_baseline(returns, weights, response_mask, group_index(group_ids), zero_tail, 1e-8)
    m = response_mask.to(returns.dtype)
    return (returns - base) * m, returns * m


def _otb_inputs(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * old_log_probs.to(returns.dtype).exp() + sum_pi_squared.to(returns.dtype)
    if is_weights is not None:  # truncated IS: W scaled by rho^2 (verl's MSE-optimal form)
        w = w * is_weights.to(returns.dtype).square()
    return returns, (w * m).cumsum(-1)


@ADVANTAGE_ESTIMATORS.register(
    "tir_optimal_token_baseline", needs_groups=True, needs_token_stats=True
)
def tir_optimal_token_baseline(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    config: AdvantageConfig,
    rollout_is_weights: torch.Tensor | None = None,
    **_unused: object,
) -> AdvantagePair:
    """Optimal token baseline for multi-turn / tool-integrated rollouts (verl's
    `tir_optimal_token_baseline`): as `optimal_token_baseline`, but samples are aligned by
    the index k of a token among the sample's response tokens (tool output and padding
    skipped), so the k-th generated token of each sample shares B_k; and the tail of a
    group's unique longest sample beyond the second-longest gets B = 0 (`handle_zero_tail`,
    default True here, as verl). Samples with no response token are left out of their group.
    `rollout_is_weights` scale w as in `optimal_token_baseline`.
    """
    returns, weights = _otb_inputs(
        token_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
    )
    zero_tail = config.handle_zero_tail is not False  # None: verl's default for this one, True
    on = response_mask > 0
    lengths = on.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    # pack each sample's response tokens to the left: column k = k-th response token
    packed_g = returns.new_zeros(returns.shape[0], width)
    packed_w = torch.zeros_like(packed_g)
    packed_m = torch.arange(width, device=returns.device).unsqueeze(0) < lengths.unsqueeze(-1)
    packed_g[packed_m] = returns[on]
    packed_w[packed_m] = weights[on]
    keep = lengths > 0
    adv = torch.zeros_like(returns)
    if bool(keep.any()):
        rows = torch.nonzero(keep, as_tuple=True)[0]
        base = torch.zeros_like(packed_g)
        base[rows] = _otb_baseline(
            packed_g[rows],
            packed_w[rows],
            packed_m[rows],
            group_index(group_ids[rows]),
            zero_tail,
            1e-8,
        )
        adv[on] = (packed_g - base)[packed_m]
    return adv, returns * response_mask.to(returns.dtype)


@ADVANTAGE_ESTIMATORS.register("gdpo", needs_groups=True, reads_reward_components=True)
def gdpo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    reward_components: torch.Tensor | None = None,
    **_unused: object,
) -> AdvantagePair:
    """GDPO (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization", arXiv 2601.05242; verl's `gdpo`): each reward component is normalised
    within its group on its own, so a dominant reward cannot drown the others, then the
    weighted sum is whitened over the batch:
        A_ik = (c_ik - mean_g(c_k)) / (std_g(c_k) + eps)     (GRPO per component k;
                                                             no std when `norm_by_std` False)
        A_i  = whiten(sum_k w_k A_ik)    over the batch's response tokens (token-weighted)
    c = `reward_components` [batch, K]; without them the one component is the score
    s_i = sum_t r_it (then GDPO is whitened GRPO, as verl's fallback). w =
    `gdpo_reward_weights` (default all 1). returns = advantages.
    """
    comps = (
        _scores(token_rewards, response_mask).unsqueeze(-1)
        if reward_components is None
        else reward_components.to(token_rewards.dtype)
    )
    weights = config.gdpo_reward_weights
    if weights is not None and len(weights) != comps.shape[1]:
        raise InputError(
            f"gdpo: AdvantageConfig.gdpo_reward_weights has {len(weights)} weights for "
            f"{comps.shape[1]} reward components; give one weight per column of "
            "reward_components (or None for all 1)"
        )
    groups = group_index(group_ids)
    total = torch.zeros_like(comps[:, 0])
    for k in range(comps.shape[1]):
        mean, scale = _baseline_and_scale(groups, comps[:, k], config.epsilon, config.norm_by_std)
        total = total + (1.0 if weights is None else weights[k]) * (comps[:, k] - mean) / scale
    adv = masked_whiten(_broadcast(total, response_mask), response_mask)
    adv = adv * float_mask(response_mask, adv)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("sppo", needs_groups=True)
def sppo(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    config: AdvantageConfig,
    **_unused: object,
) -> AdvantagePair:
    """SPPO's target (Wu et al. 2024): with P_i the Bradley-Terry win rate of sample i
    against the other samples of its prompt (`win_rates`: 1/(K-1) sum_{j != i}
    sigmoid(s_i - s_j); 0.5 alone),
        A_i = eta * (P_i - 1/2)     (eta = `sppo_eta`) on every response token.
    Pair it with the `sppo` policy loss, which regresses the sequence log-ratio to it."""
    scores = _scores(token_rewards, response_mask)
    per_sample = config.sppo_eta * (win_rates(scores, group_ids) - 0.5)
    adv = _broadcast(per_sample, response_mask)
    return adv, adv
