"""Checks of tensor arguments, so that a wrong shape fails with the argument's name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from tephra.algos.errors import InputError


def check_keys(
    outputs: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    output_keys: Iterable[str],
    batch_keys: Iterable[str],
    why: str,
) -> None:
    """Raise naming the first key a loss reads that `outputs` or `batch` lacks (`why`: what
    needs it)."""
    for where, mapping, keys in (("outputs", outputs, output_keys), ("batch", batch, batch_keys)):
        for key in keys:
            if key not in mapping.keys():
                raise InputError(f"{where}[{key!r}] is missing: {why}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise naming the arguments when the given `[batch, seq]` tensors disagree in shape."""
    items = list(tensors.items())
    first_name, first = items[0]
    if first.dim() != 2:
        raise InputError(f"{first_name} must be [batch, seq] (2-D), got shape {tuple(first.shape)}")
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise InputError(
                f"{name} has shape {tuple(t.shape)} but {first_name} has {tuple(first.shape)}; "
                f"every per-token tensor must be [batch, seq] aligned with input_ids"
            )


def check_per_sample(name: str, t: torch.Tensor, batch: int, *, integer: bool = False) -> None:
    """Raise when `t` is not a `[batch]` vector (of integers when `integer`)."""
    if t.dim() != 1 or t.shape[0] != batch:
        raise InputError(
            f"{name} must be a [batch] vector of length {batch}, got shape {tuple(t.shape)}"
        )
    if integer and (t.is_floating_point() or t.is_complex()):
        raise InputError(
            f"{name} must hold integer group ids (int64 prompt uids), got dtype "
            f"{t.dtype}; convert with .long()"
        )


def float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The 0/1 mask in `like`'s floating dtype (masks arrive as int64 or bool)."""
    return (mask > 0).to(like.dtype)
