"""Reductions over the positions where a mask is 1; masked-out values never matter.

`torch.where` is used rather than multiplication so that non-finite values at masked
positions (e.g. -inf log-probs of padding) cannot leak into a result as NaN.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_{mask=1} x, over `dim` (all positions when None)."""
    z = torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of positions where mask is 1."""
    m = (mask > 0).long()
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_{mask=1} x / max(count, 1): an all-zero mask gives 0, not NaN."""
    n = masked_count(mask, dim).clamp(min=1).to(x.dtype)
    return masked_sum(x, mask, dim) / n


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked values (over all positions); Bessel-corrected when `unbiased`
    (denominator n - 1, kept >= 1 so a single value has variance 0)."""
    mean = masked_mean(x, mask)
    n = masked_count(mask).to(x.dtype)
    denom = (n - 1 if unbiased else n).clamp(min=1)
    return masked_sum((x - mean) ** 2, mask) / denom


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked values (unbiased variance); 0 where the
    mask is 0."""
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return torch.where(mask > 0, out, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Largest masked value (0 when the mask is empty)."""
    if not bool((mask > 0).any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask > 0].max()


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Smallest masked value (0 when the mask is empty)."""
    if not bool((mask > 0).any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask > 0].min()
