"""How a call on a worker group is spread over its ranks and collected back.

A worker method is declared with `@dispatch(Dispatch.X)`; the `WorkerGroup` reads the mode
and does the splitting/collecting, so the driver writes `wg.compute_log_probs(batch)` once
and gets one batch back.

- `DP_SPLIT`: every `TensorDict` / list argument is cut into `world_size` contiguous, equal
  shares (rank r gets share r); the ranks' results are concatenated in rank order
  (TensorDicts with `torch.cat`, lists by extending) or, for dicts of metrics, taken from
  rank 0 (engines already reduce metrics over data-parallel ranks).
- `BROADCAST`: every rank gets the same arguments (SPMD collective calls such as
  `save_checkpoint`); the result is the list of every rank's result.
- `RANK_ZERO`: every rank gets the same arguments (so collectives inside still match) and
  only rank 0's result is returned.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from tephra.engine_api.errors import BatchError

DISPATCH_ATTR = "__tephra_dispatch__"


class Dispatch(enum.Enum):
    DP_SPLIT = "dp_split"
    BROADCAST = "broadcast"
    RANK_ZERO = "rank_zero"


def dispatch(mode: Dispatch) -> Callable[[Callable], Callable]:
    """Mark a worker method as callable through a `WorkerGroup` with `mode`."""

    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def dispatch_mode(fn: Callable) -> Dispatch | None:
    return getattr(fn, DISPATCH_ATTR, None)


def split_value(value: Any, world_size: int, name: str) -> list[Any]:
    """Cut one argument into `world_size` equal shares (non-batch values are repeated)."""
    if isinstance(value, (TensorDict, list)):
        n = value.batch_size[0] if isinstance(value, TensorDict) else len(value)
        if n % world_size:
            raise BatchError(
                f"argument {name!r} has {n} rows, which does not split evenly over "
                f"{world_size} data-parallel ranks; make the batch a multiple of {world_size}"
            )
        share = n // world_size
        return [value[r * share : (r + 1) * share] for r in range(world_size)]
    return [value] * world_size


def split_args(args: tuple, kwargs: dict, world_size: int) -> list[tuple[tuple, dict]]:
    split_a = [split_value(a, world_size, f"#{i}") for i, a in enumerate(args)]
    split_k = {k: split_value(v, world_size, k) for k, v in kwargs.items()}
    return [
        (tuple(s[r] for s in split_a), {k: s[r] for k, s in split_k.items()})
        for r in range(world_size)
    ]


def collect(results: list[Any]) -> Any:
    """Merge per-rank results of a `DP_SPLIT` call into one value."""
    first = results[0]
    if isinstance(first, TensorDict):
        return torch.cat(results, dim=0)
    if isinstance(first, list):
        return [x for r in results for x in r]
    return first
