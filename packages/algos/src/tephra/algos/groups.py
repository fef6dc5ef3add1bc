"""Group membership from a per-sample group id (the prompt uid), never from batch order.

Samples of one prompt share an id; they may sit anywhere in the batch. Group statistics are
computed with scatter-adds over the dense group index returned by `torch.unique`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Groups:
    """Dense group index of a batch."""

    index: torch.Tensor
    """int64 [batch]: the dense group (0..n_groups-1) of each sample."""
    sizes: torch.Tensor
    """int64 [n_groups]: samples per group."""
    ids: torch.Tensor
    """[n_groups]: the original group id of each dense group."""

    @property
    def n_groups(self) -> int:
        return int(self.sizes.shape[0])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group sums of the per-sample values `x` [batch] -> [n_groups]."""
        out = torch.zeros(self.n_groups, dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.index, x)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group means [n_groups]."""
        return self.sum(x) / self.sizes.to(x.dtype)

    def std(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group unbiased standard deviation [n_groups] (n - 1 in the denominator, kept
        >= 1, so a group of one has std 0)."""
        centred = x - self.mean(x)[self.index]
        denom = (self.sizes - 1).clamp(min=1).to(x.dtype)
        return (self.sum(centred**2) / denom).sqrt()

    def max(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.n_groups,), -torch.inf, dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, self.index, x, reduce="amax")

    def min(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.n_groups,), torch.inf, dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, self.index, x, reduce="amin")

    def members(self, g: int) -> torch.Tensor:
        """Batch positions of dense group `g` (ascending)."""
        return torch.nonzero(self.index == g, as_tuple=True)[0]


def group_index(group_ids: torch.Tensor) -> Groups:
    """Dense groups of a `[batch]` id vector."""
    ids, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return Groups(index=index, sizes=sizes, ids=ids)
