"""PRIME's implicit process reward (Cui et al. 2025, "Process Reinforcement through Implicit
Rewards", arXiv 2502.01456): the reward model's loss and the combined advantage.

A reward model pi_rm (initialised from the policy) and a frozen reference pi_ref give every
response token an implicit process reward r_t = beta * (log pi_rm(y_t) - log pi_ref(y_t)).
pi_rm is trained online from outcome labels only, by cross-entropy on the sequence's
implicit reward sum_t r_t (a logit); the token rewards and the outcome reward then form an
RLOO-style advantage.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tephra.algos.errors import InputError
from tephra.algos.groups import group_index
from tephra.algos.inputs import check_keys, check_per_sample, check_same_shape
from tephra.algos.masked import masked_mean, masked_sum, masked_whiten
from tephra.algos.recipe_config import PrimeConfig


def implicit_process_rewards(
    rm_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """r_t = beta * (log pi_rm(y_t) - log pi_ref(y_t)) on response tokens, 0 elsewhere;
    [batch, seq]. Keeps the graph of `rm_log_probs` (the reward model's loss needs it)."""
    check_same_shape(
        rm_log_probs=rm_log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask
    )
    if beta <= 0:
        raise InputError(f"PRIME beta={beta!r} must be > 0 (PRIME uses 0.05)")
    diff = beta * (rm_log_probs - ref_log_probs.to(rm_log_probs.dtype))
    return torch.where(response_mask > 0, diff, torch.zeros_like(diff))


def prime_rm_loss(
    rm_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    labels: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The implicit PRM's cross-entropy on outcome labels l_i in [0, 1] ([batch]):
        R_i = sum_t r_it    (the sequence-level implicit reward, a logit)
        loss = mean_i -[l_i log sigmoid(R_i) + (1 - l_i) log(1 - sigmoid(R_i))]
    Metrics: the mean R and the accuracy of sign(R) against l > 0.5."""
    check_per_sample("labels", labels, rm_log_probs.shape[0])
    rewards = implicit_process_rewards(rm_log_probs, ref_log_probs, response_mask, beta)
    seq = rewards.sum(-1)
    target = labels.to(seq.dtype)
    loss = F.binary_cross_entropy_with_logits(seq, target)
    with torch.no_grad():
        acc = ((seq > 0) == (target > 0.5)).to(seq.dtype).mean()
    return loss, {
        "prime/rm_loss": float(loss.detach()),
        "prime/rm_acc": float(acc),
        "prime/implicit_reward": float(seq.detach().mean()),
    }


def prime_advantages(
    process_rewards: torch.Tensor,
    outcome_scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    process_coef: float = 5.0,
    outcome_coef: float = 5.0,
    whiten: bool = True,
) -> torch.Tensor:
    """PRIME's advantage [batch, seq] for K samples per prompt (group), RLOO on both rewards:
        b_i   = 1/(K-1) sum_{j != i in g} mean_t(r_j)       (the others' mean token reward)
        o'_i  = o_i - 1/(K-1) sum_{j != i in g} o_j          (outcome leave-one-out)
        A_it  = process_coef * sum_{s >= t} (r_is - b_i) + outcome_coef * o'_i
    sums over response tokens (gamma 1), then whitened over the batch's response tokens
    (`whiten`, as PRIME's code and verl's recipe). A group of one has baselines 0.
    process_coef / outcome_coef default to verl's recipe (reward_dpo_coef, reward_gt_coef)."""
    check_same_shape(process_rewards=process_rewards, response_mask=response_mask)
    n = process_rewards.shape[0]
    check_per_sample("outcome_scores", outcome_scores, n)
    check_per_sample("group_ids", group_ids, n, integer=True)
    with torch.no_grad():
        r = torch.where(response_mask > 0, process_rewards, torch.zeros_like(process_rewards))
        o = outcome_scores.to(r.dtype)
        token_mean = masked_mean(r, response_mask, dim=-1)
        groups = group_index(group_ids)
        size = groups.sizes[groups.index].to(r.dtype)
        others = (size - 1).clamp(min=1)
        single = size == 1
        b = torch.where(single, 0.0, (groups.sum(token_mean)[groups.index] - token_mean) / others)
        o_loo = torch.where(single, o, o - (groups.sum(o)[groups.index] - o) / others)
        centred = torch.where(response_mask > 0, r - b.unsqueeze(-1), torch.zeros_like(r))
        to_go = centred.flip(-1).cumsum(-1).flip(-1)
        adv = process_coef * to_go + outcome_coef * o_loo.unsqueeze(-1)
        adv = torch.where(response_mask > 0, adv, torch.zeros_like(adv))
        if whiten:
            adv = masked_whiten(adv, response_mask)
        return adv


def sequence_implicit_reward(process_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t r_t over response tokens, [batch] (the PRM's logit of success)."""
    return masked_sum(process_rewards, mask, dim=-1)


class PrimeRMObjective:
    """The implicit PRM's engine loss `loss_fn(outputs, batch) -> (loss, metrics)`: this
    micro-batch's share of `prime_rm_loss`, so that the sum over micro-batches and ranks is
    the full batch's mean cross-entropy,
        loss = sum_{i in micro-batch} BCE(R_i, l_i) / batch["global_seq_count"][0]
    Reads outputs["log_probs"] (the PRM's), batch["ref_log_probs"], ["response_mask"],
    ["prime_labels"] ([batch] outcome labels in [0, 1]) and ["global_seq_count"]."""

    def __init__(self, beta: float = 0.05) -> None:
        if beta <= 0:
            raise InputError(f"PRIME beta={beta!r} must be > 0 (PRIME uses 0.05)")
        self.beta = beta

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_keys(
            outputs,
            batch,
            ["log_probs"],
            ["ref_log_probs", "response_mask", "prime_labels", "global_seq_count"],
            "the PRIME reward model's loss needs it",
        )
        log_probs, mask = outputs["log_probs"], batch["response_mask"]
        rewards = implicit_process_rewards(log_probs, batch["ref_log_probs"], mask, self.beta)
        seq = rewards.sum(-1)
        labels = batch["prime_labels"].to(seq.dtype)
        check_per_sample("prime_labels", labels, seq.shape[0])
        per_seq = F.binary_cross_entropy_with_logits(seq, labels, reduction="none")
        loss = per_seq.sum() / batch["global_seq_count"][0]
        with torch.no_grad():
            acc = ((seq > 0) == (labels > 0.5)).to(seq.dtype).mean()
        return loss, {"prime/rm_loss": float(per_seq.detach().mean()), "prime/rm_acc": float(acc)}


def prime_step(
    prm_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    section: PrimeConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(advantages [batch, seq], outcome labels [batch], metrics) of one RL step: implicit
    process rewards from the reward model's and the reference's log-probs of the sampled
    tokens, labels l_i = [score_i >= label_threshold], and PRIME's RLOO advantage of both."""
    process = implicit_process_rewards(prm_log_probs, ref_log_probs, response_mask, section.beta)
    labels = (scores >= section.label_threshold).to(torch.float32)
    adv = prime_advantages(
        process,
        scores,
        response_mask,
        group_ids,
        process_coef=section.process_coef,
        outcome_coef=section.outcome_coef,
    )
    sequence = process.sum(-1)
    metrics = {
        "prime/implicit_reward_token_mean": float(masked_mean(process, response_mask)),
        "prime/implicit_reward_seq_mean": float(sequence.mean()),
        "prime/label_mean": float(labels.mean()),
        # before this step's update: how well the reward model's sign predicts the label
        "prime/rm_acc_before": float(((sequence > 0) == (labels > 0.5)).float().mean()),
    }
    return adv, labels, metrics
