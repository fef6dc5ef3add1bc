"""Self-play preference losses: SPIN's DPO-style loss and SPPO's squared win-rate loss.

Both act on sequence log-probs log pi(y|x) = sum_t log pi(y_t) over response tokens
(`sequence_log_probs`), of the model being trained and of the previous iteration's frozen
copy (the reference).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tephra.algos.errors import InputError
from tephra.algos.groups import group_index
from tephra.algos.inputs import check_keys, check_per_sample, check_same_shape
from tephra.algos.masked import masked_sum


def sequence_log_probs(log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log pi(y|x) = sum over response tokens of log pi(y_t), [batch]."""
    check_same_shape(log_probs=log_probs, response_mask=response_mask)
    return masked_sum(log_probs, response_mask, dim=-1)


def spin_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SPIN (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong
    Language Models"), logistic loss: the SFT answer y_w is chosen, the model's own
    generation y_l rejected, against the previous iteration pi_ref:
        m_i  = beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))]
        loss = mean_i -log sigmoid(m_i)        (the DPO loss of Rafailov et al. 2023)
    All arguments are [pairs] sequence log-probs. Metrics: the mean margin and the share
    of pairs with m > 0."""
    n = chosen.shape[0] if chosen.dim() else 0
    for name, t in (
        ("chosen", chosen),
        ("rejected", rejected),
        ("ref_chosen", ref_chosen),
        ("ref_rejected", ref_rejected),
    ):
        check_per_sample(name, t, n)
    if beta <= 0:
        raise InputError(f"SPIN beta={beta!r} must be > 0 (SPIN uses 0.1)")
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    loss = -F.logsigmoid(margin).mean()
    with torch.no_grad():
        metrics = {
            "spin/loss": float(loss),
            "spin/margin": float(margin.mean()),
            "spin/accuracy": float((margin > 0).to(margin.dtype).mean()),
        }
    return loss, metrics


SPIN_CHOSEN = "spin_chosen"
"""`[B]` batch column of SPIN's pairs: 1.0 on the chosen row (the reference answer), 0.0 on
the rejected one (the policy's sample). A pair is two consecutive rows sharing a
`keep_together` id (`tephra.engine_api.batch.KEEP_TOGETHER`), so a micro-batch holds both."""
PAIR_ID = "keep_together"


def spin_pair_columns(rows: int) -> dict[str, torch.Tensor]:
    """The columns of a batch of `rows` SPIN rows, pairs consecutive (chosen, rejected):
    `keep_together` and `uid` = the pair's index i // 2 [B] (int64), `spin_chosen` = 1.0 on
    even rows [B]."""
    index = torch.arange(rows, dtype=torch.int64) // 2
    return {
        PAIR_ID: index,
        "uid": index,
        SPIN_CHOSEN: (torch.arange(rows) % 2 == 0).to(torch.float32),
    }


class SpinObjective:
    """SPIN's engine loss `loss_fn(outputs, batch) -> (loss, metrics)`: this micro-batch's
    share of `spin_loss`, so that the sum over micro-batches and ranks is the mean over the
    step's pairs,
        loss = sum_{pairs in micro-batch} -log sigmoid(m_i) / (batch["global_seq_count"][0] / 2)
    (every row of a pair has a response token, so the step counts 2 sequences per pair).
    Reads outputs["log_probs"], batch["ref_log_probs"], ["response_mask"], [SPIN_CHOSEN],
    ["keep_together"] (the pair id) and ["global_seq_count"]; metrics are this micro-batch's
    `spin_loss` metrics."""

    def __init__(self, beta: float = 0.1) -> None:
        if beta <= 0:
            raise InputError(f"SPIN beta={beta!r} must be > 0 (SPIN uses 0.1)")
        self.beta = beta

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_keys(
            outputs,
            batch,
            ["log_probs"],
            ["ref_log_probs", "response_mask", SPIN_CHOSEN, PAIR_ID, "global_seq_count"],
            "the SPIN loss needs it",
        )
        mask = batch["response_mask"]
        seq = sequence_log_probs(outputs["log_probs"], mask)
        ref = sequence_log_probs(batch["ref_log_probs"].to(seq.dtype), mask)
        chosen = batch[SPIN_CHOSEN] > 0.5
        pair = batch[PAIR_ID]
        n = seq.shape[0]
        if n % 2 or not bool((pair[0::2] == pair[1::2]).all()):
            raise InputError(
                f"SPIN pairs are cut: a micro-batch of {n} rows holds rows of a pair whose "
                "other row is elsewhere; keep the pair's rows consecutive with one "
                f"{PAIR_ID!r} id (the engines then never split them)"
            )
        first, second = chosen[0::2], chosen[1::2]
        if bool((first == second).any()):
            raise InputError(
                f"every SPIN pair needs one chosen and one rejected row ({SPIN_CHOSEN!r} 1 and 0)"
            )
        # row order inside a pair is free: pick by the flag
        pick = torch.stack([first, second], -1)  # [pairs, 2]: which row of the pair is chosen
        seq2, ref2 = seq.view(-1, 2), ref.view(-1, 2)
        loss, metrics = spin_loss(seq2[pick], seq2[~pick], ref2[pick], ref2[~pick], beta=self.beta)
        pairs = n // 2
        return loss * pairs / (batch["global_seq_count"][0] / 2), metrics


def win_rates(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """SPPO's win-rate estimate P(y_i > pi_t | x), [batch], from scalar scores of the K
    samples of each prompt (a reward model's or judge's), under Bradley-Terry:
        P_i = 1/(K-1) sum_{j != i in g} sigmoid(s_i - s_j)
    A group of one gets 0.5 (no opponent: a tie)."""
    check_per_sample("scores", scores, scores.shape[0] if scores.dim() else 0)
    check_per_sample("group_ids", group_ids, scores.shape[0], integer=True)
    groups = group_index(group_ids)
    same = groups.index.unsqueeze(0) == groups.index.unsqueeze(1)
    same.fill_diagonal_(False)
    pair = torch.sigmoid(scores.unsqueeze(1) - scores.unsqueeze(0))
    count = same.sum(-1).to(scores.dtype)
    total = torch.where(same, pair, torch.zeros_like(pair)).sum(-1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, 0.5))


def sppo_loss(
    seq_log_probs: torch.Tensor,
    ref_seq_log_probs: torch.Tensor,
    win_rate: torch.Tensor,
    eta: float = 1e3,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SPPO (Wu et al. 2024, "Self-Play Preference Optimization for Language Model
    Alignment"), squared loss per response y with estimated win rate P(y > pi_t | x):
        loss = mean_y (log pi(y|x) - log pi_t(y|x) - eta * (P(y > pi_t | x) - 1/2))^2
    pi_t the previous iteration (reference); eta the paper's step size (1e3 in its
    experiments). All arguments [batch]."""
    n = seq_log_probs.shape[0] if seq_log_probs.dim() else 0
    check_per_sample("seq_log_probs", seq_log_probs, n)
    check_per_sample("ref_seq_log_probs", ref_seq_log_probs, n)
    check_per_sample("win_rate", win_rate, n)
    if eta <= 0:
        raise InputError(f"SPPO eta={eta!r} must be > 0 (the paper uses 1e3)")
    if bool(((win_rate < 0) | (win_rate > 1)).any()):
        raise InputError("SPPO win_rate must lie in [0, 1] (a probability of winning)")
    target = eta * (win_rate.to(seq_log_probs.dtype) - 0.5)
    resid = seq_log_probs - ref_seq_log_probs.to(seq_log_probs.dtype) - target
    loss = resid.square().mean()
    with torch.no_grad():
        metrics = {"sppo/loss": float(loss), "sppo/win_rate": float(win_rate.float().mean())}
    return loss, metrics
