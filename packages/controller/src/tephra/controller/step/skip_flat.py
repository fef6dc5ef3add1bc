"""Leaving zero-advantage rows out of the actor's update (`skip_zero_advantage_rows`): when the
objective allows it (`can_skip_flat`), the rows whose samples all scored the same add nothing to
the gradient but cost a forward and backward; the step logs the groups left out."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from tephra.engine_api.batch import LEFT_OUT_SEQS, LEFT_OUT_TOKENS

# policy losses whose per-token loss is (advantage x something): zero advantage, zero gradient
ZERO_AT_ZERO_ADVANTAGE = frozenset({"vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean"})


def can_skip_flat(objective: Any) -> bool:
    """Whether rows with zero advantage add exactly zero to the actor's gradient under
    `objective` (an `ActorObjectiveConfig`): the loss is the advantage times a policy term
    (no entropy bonus, no KL loss, no covariance-based token selection, which looks at the
    whole micro-batch). Any data-parallel size: the rows left out still count in the
    engine's global normalisers (`skip_zero_advantage_rows`)."""
    return (
        objective.policy_loss in ZERO_AT_ZERO_ADVANTAGE
        and objective.entropy_coeff == 0
        and not objective.use_kl_loss
    )


def informative_rows(batch: TensorDict) -> torch.Tensor:
    """[B] bool: rows with a non-zero advantage on some response token."""
    return ((batch["advantages"] != 0) & (batch["response_mask"] > 0)).any(-1)


def flat_groups(batch: TensorDict) -> int:
    """Groups (`uid`) none of whose rows is informative (all samples scored the same): the
    groups that skipping leaves out whole."""
    uid = batch["uid"]
    return len(set(uid.tolist()) - set(uid[informative_rows(batch)].tolist()))


def skip_zero_advantage_rows(batch: TensorDict) -> tuple[TensorDict, int]:
    """Leave out the rows whose advantage is exactly zero on every token (GRPO / RLOO groups
    whose samples all scored the same): they add nothing to the gradient but cost a forward
    and backward. Their response tokens and sequences go into the kept rows' `LEFT_OUT_*`
    columns, which the engine adds to the step's normalisers before summing them over the
    data-parallel ranks, so the gradient is that of the full batch at any data-parallel size
    (the engines already give every rank as many micro-batches, padding with zero-weight
    ones). One row is always kept, so every parameter still gets a (zero) gradient and
    AdamW's step is the same. Returns (rows kept, rows left out)."""
    informative = informative_rows(batch)
    if not bool(informative.any()):
        informative[0] = True
    if bool(informative.all()):
        return batch, 0
    mask = batch["response_mask"][~informative]
    part = batch[informative.nonzero().squeeze(-1)]
    for key, count in ((LEFT_OUT_TOKENS, mask.sum()), (LEFT_OUT_SEQS, (mask.sum(-1) > 0).sum())):
        column = torch.zeros(part.batch_size[0], dtype=torch.float32)
        column[0] = float(count)
        part[key] = column
    return part, int((~informative).sum())
