"""Random batches for tests of tephra.algos (and of packages that call it), shaped like
real ones: prompt (mask 0), response (mask 1, sometimes with tool-output holes), right
padding (mask 0); garbage at masked positions so a result that depends on padding shows up.
"""

from __future__ import annotations

import torch


def random_mask(gen: torch.Generator, batch: int, seq: int, *, holes: bool = True) -> torch.Tensor:
    mask = torch.zeros(batch, seq, dtype=torch.int64)
    for b in range(batch):
        prompt = int(torch.randint(1, max(2, seq // 3), (1,), generator=gen))
        length = int(torch.randint(1, seq - prompt + 1, (1,), generator=gen))
        mask[b, prompt : prompt + length] = 1
        if holes and length > 3 and bool(torch.rand((), generator=gen) < 0.5):
            start = prompt + int(torch.randint(1, length - 1, (1,), generator=gen))
            mask[b, start : start + 1] = 0  # a tool-output token inside the response
    return mask


def random_group_ids(gen: torch.Generator, batch: int, n_groups: int) -> torch.Tensor:
    """Every group id used at least once, in shuffled order (membership is by id)."""
    ids = torch.cat(
        [torch.arange(n_groups), torch.randint(0, n_groups, (batch - n_groups,), generator=gen)]
    )
    return (ids[torch.randperm(batch, generator=gen)] * 7 + 3).long()  # non-dense ids


def outcome_rewards(
    gen: torch.Generator, mask: torch.Tensor, *, binary: bool = False
) -> torch.Tensor:
    """Outcome reward at the last response token, garbage where the mask is 0."""
    batch, seq = mask.shape
    rewards = torch.randn(batch, seq, generator=gen, dtype=torch.float64) * 5
    rewards = torch.where(mask > 0, torch.zeros_like(rewards), rewards)
    for b in range(batch):
        idx = torch.nonzero(mask[b]).flatten()
        if idx.numel():
            val = (
                float(torch.randint(0, 2, (1,), generator=gen))
                if binary
                else float(torch.randn((), generator=gen, dtype=torch.float64))
            )
            rewards[b, idx[-1]] = val
    return rewards


def response_positions(mask_row: torch.Tensor) -> list[int]:
    return [t for t in range(mask_row.shape[0]) if int(mask_row[t]) > 0]
