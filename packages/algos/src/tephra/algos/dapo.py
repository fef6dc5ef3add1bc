"""DAPO pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): dynamic sampling and overlong reward shaping."""

from __future__ import annotations

import torch

from tephra.algos.errors import InputError
from tephra.algos.groups import group_index
from tephra.algos.inputs import check_per_sample


def filter_groups(
    scores: torch.Tensor, group_ids: torch.Tensor, *, keep_singletons: bool = True
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dynamic sampling: drop the groups (samples sharing a group id) whose scores are all
    equal, since their group-relative advantages are all 0 and they only dilute the batch.

    scores: [batch] per-sample scores; group_ids: [batch] int64 prompt uids.
    keep_singletons: a group of one sample has no group baseline (it is kept by default,
        as its advantage is its own score).
    Returns keep [batch] bool and a report: `n_groups`, `n_groups_kept`, `n_groups_dropped`,
    `n_groups_all_max` / `n_groups_all_min` (dropped groups whose common score is the
    batch's max / min score: solved by every sample / by none), `frac_groups_dropped`,
    `n_samples_kept`. The caller samples more prompts until it has enough groups (DAPO).
    """
    check_per_sample(
        "group_ids", group_ids, group_ids.shape[0] if group_ids.dim() == 1 else -1, integer=True
    )
    check_per_sample("scores", scores, group_ids.shape[0])
    groups = group_index(group_ids)
    gmax, gmin = groups.max(scores), groups.min(scores)
    flat = gmax == gmin
    if keep_singletons:
        flat = flat & (groups.sizes > 1)
    keep = ~flat[groups.index]
    n_groups = groups.n_groups
    n_dropped = int(flat.sum())
    report = {
        "n_groups": float(n_groups),
        "n_groups_kept": float(n_groups - n_dropped),
        "n_groups_dropped": float(n_dropped),
        "n_groups_all_max": float((flat & (gmax == scores.max())).sum()),
        "n_groups_all_min": float((flat & (gmin == scores.min())).sum()),
        "frac_groups_dropped": n_dropped / max(n_groups, 1),
        "n_samples_kept": float(keep.sum()),
    }
    return keep, report


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment (DAPO, Eq. 13), with L_max = max_response_length, L_buf =
    overlong_buffer_len, |y| the response length in tokens:
        R(y) = 0                                   |y| <= L_max - L_buf
        R(y) = ((L_max - L_buf) - |y|) / L_buf      L_max - L_buf < |y| <= L_max
        R(y) = -1                                   |y| > L_max
    times `penalty_factor`. Returns [batch] float32 (added to the outcome reward).
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise InputError(
            f"overlong_buffer_len={overlong_buffer_len!r} must be in (0, max_response_length="
            f"{max_response_length!r}]"
        )
    if penalty_factor < 0:
        raise InputError(f"penalty_factor={penalty_factor!r} must be >= 0")
    lengths = response_lengths.to(torch.float32)
    expected = max_response_length - overlong_buffer_len
    r = ((expected - lengths) / overlong_buffer_len).clamp(min=-1.0, max=0.0)
    return r * penalty_factor
