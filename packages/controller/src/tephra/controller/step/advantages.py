"""From a step's scores to its advantages: outcome rewards on the last token, DAPO's length
shaping, GDPO's reward components, KL in the reward, and the estimator call."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tephra.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_advantages,
    kl_penalty,
    overlong_penalty,
)
from tephra.controller.config.tree import PPOConfig
from tephra.controller.samples import Sample
from tephra.core.errors import ConfigError
from tephra.episodes.agent.loops import TIMEOUTS


def outcome_token_rewards(
    scores: torch.Tensor, response_mask: torch.Tensor, samples: list[Sample] | None = None
) -> torch.Tensor:
    """[B] scores -> [B, T] with the score on each sample's last response token.

    With `samples` (the batch's rows, in `tephra.rollout.to_batch`'s layout: responses start
    at the longest prompt's length), an environment's per-turn rewards
    (`extra_info["turn_rewards"]`, at `extra_info["turn_ends"]`) each land on the last
    generated token of their turn, and what the score holds beyond their sum (length shaping,
    clipping) stays on the last token; a trajectory cut by a deadline keeps its whole score
    there."""
    mask = response_mask.long()
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = mask.sum(-1) > 0
    out[has, last[has]] = scores[has].float()
    if samples is None:
        return out
    start = max(len(s.prompt_ids) for s in samples)
    for i, s in enumerate(samples):
        rewards = s.extra_info.get("turn_rewards")
        ends = s.extra_info.get("turn_ends")
        if not rewards or ends is None or s.env_reward is None or s.finish_reason in TIMEOUTS:
            continue
        if not has[i]:
            continue
        for reward, end in zip(rewards, ends, strict=True):
            # a turn of no tokens: its reward goes to the last trained token before it
            trained = mask[i, : start + end + 1].nonzero()
            at = int(trained[-1]) if len(trained) else int(last[i])
            out[i, at] += float(reward)
        out[i, last[i]] -= float(sum(rewards))
    return out


def kl_controller(cfg: PPOConfig) -> AdaptiveKLController | FixedKLController:
    """The KL-in-the-reward coefficient's controller (`algorithm.kl_in_reward.controller`)."""
    kl = cfg.algorithm.kl_in_reward
    if kl.controller == "adaptive":
        return AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon)
    return FixedKLController(kl.coef)


def length_shaping(cfg: PPOConfig, samples: list[Sample]) -> torch.Tensor:
    """DAPO's soft overlong punishment added to each kept sample's score ([B]; zeros when
    `algorithm.overlong_buffer` is 0), from the full response length (tool tokens count)."""
    a = cfg.algorithm
    if not a.overlong_buffer:
        return torch.zeros(len(samples))
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    return overlong_penalty(
        lengths, cfg.rollout.response_budget, a.overlong_buffer, a.overlong_penalty_factor
    )


def reward_components(cfg: PPOConfig, samples: list[Sample]) -> torch.Tensor | None:
    """GDPO's reward components [B, K]: each sample's reward dict entries named by
    `algorithm.advantage.gdpo_reward_keys` ("score": the score), 0 for a sample whose
    scorer failed; None without keys (GDPO then takes the score alone)."""
    keys = cfg.algorithm.advantage.gdpo_reward_keys
    if keys is None or not cfg.algorithm.reads("reward_components"):
        return None
    rows = []
    for i, s in enumerate(samples):
        values = {**s.reward.extras, "score": s.reward.score}
        missing = [k for k in keys if k not in values]
        if missing and s.reward.error is None:
            raise ConfigError(
                f"algorithm.advantage.gdpo_reward_keys={keys} but the reward of sample {i} "
                f"has no {missing} (its reward dict held {sorted(values)}); return those "
                "keys from the reward function, or list the keys it returns"
            )
        rows.append([float(values.get(k, 0.0)) for k in keys])
    return torch.tensor(rows, dtype=torch.float32)


def set_advantages(
    cfg: PPOConfig,
    batch: TensorDict,
    token_rewards: torch.Tensor,
    baselines: torch.Tensor | None,
    components: torch.Tensor | None = None,
) -> None:
    """Set batch["advantages"] and ["returns"] by `algorithm.adv_estimator` (values from
    batch["values"] when the estimator needs a critic)."""
    a = cfg.algorithm
    stats = {}
    if a.needs("token_stats"):
        stats = {
            "old_log_probs": batch["old_log_probs"],
            "sum_pi_squared": batch.pop("sum_pi_squared"),  # read here only
            # verl scales OTB's W by the rollout IS weights squared when they exist
            "rollout_is_weights": batch.get("rollout_is_weights", None),
        }
    adv, ret = compute_advantages(
        a.adv_estimator,
        token_rewards=token_rewards,
        response_mask=batch["response_mask"],
        group_ids=batch["uid"],
        values=batch["values"] if a.needs("values") else None,
        config=a.advantage,
        baselines=baselines,
        reward_components=components,
        **stats,
    )
    batch["advantages"], batch["returns"] = adv.float(), ret.float()


def kl_reward(
    cfg: PPOConfig,
    batch: TensorDict,
    token_rewards: torch.Tensor,
    kl_ctrl: AdaptiveKLController | FixedKLController,
) -> tuple[torch.Tensor, dict]:
    """KL to the reference as a per-token reward penalty (algorithm.kl_in_reward); updates
    `kl_ctrl` by the step's KL."""
    kl = kl_penalty(
        batch["rollout_log_probs"]
        if "old_log_probs" not in batch.keys()
        else batch["old_log_probs"],
        batch["ref_log_probs"],
        cfg.algorithm.kl_in_reward.estimator,
    )
    rewards, metrics = apply_kl_penalty(token_rewards, batch["response_mask"], kl, kl_ctrl.value)
    kl_ctrl.update(metrics["kl_penalty/kl"], batch.batch_size[0])
    return rewards, metrics
