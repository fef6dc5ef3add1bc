"""How a call on a worker group is spread over its ranks and collected back.

A worker method is declared with `@dispatch(Dispatch.X)`; the `WorkerGroup` reads the mode
and does the splitting/collecting, so the driver writes `wg.compute_log_probs(batch)` once
and gets one batch back.

- `DP_SPLIT`: every `TensorDict` / list argument is cut into `dp_size` contiguous, equal
  shares; every rank of data-parallel replica d gets share d (its tensor / pipeline /
  context peers get the same rows, as SPMD model parallelism needs); the results of one output
  rank per replica are concatenated in replica order (TensorDicts with `torch.cat`, lists by
  extending), results with a `merge(parts)` class method merged by it (`Scores`: rewards
  concatenated, the slowest rank's seconds) or, for dicts of metrics, the first replica's is
  taken (engines already reduce metrics over data-parallel ranks). Each worker says where it stands with `dp_info()`.
- `ROLLOUT_SPLIT`: generation's own data parallelism. Every list / `TensorDict` argument is
  cut into `rollout_dp` contiguous shares whose sizes differ by at most one
  (`share_bounds`); the output rank of rollout replica d (the rank holding its rollout
  engine) gets share d, the other ranks of the replica (its rollout tensor-parallel peers)
  an empty share. Arguments with a `for_share(first_row)` method (`SamplingParams`: the
  seeds of a share's samples) get it called with their share's first row, so a sample does
  not depend on the split. Results are collected as for `DP_SPLIT`. Each worker says where
  it stands with `rollout_info()`: trainer model-parallel peers are separate rollout
  replicas, so they never generate the same prompts twice.
- `BROADCAST`: every rank gets the same arguments (SPMD collective calls such as
  `save_checkpoint`); the result is the list of every rank's result.
- `RANK_ZERO`: every rank gets the same arguments (so collectives inside still match) and
  only rank 0's result is returned.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from tensordict import TensorDict

from tephra.engine_api.errors import BatchError

DISPATCH_ATTR = "__tephra_dispatch__"


class Dispatch(enum.Enum):
    DP_SPLIT = "dp_split"
    ROLLOUT_SPLIT = "rollout_split"
    BROADCAST = "broadcast"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DataParallelInfo:
    """Where a rank stands for `DP_SPLIT`: its data-parallel replica, how many replicas there
    are, and whether it is the one rank of its replica whose results are collected."""

    dp_rank: int
    dp_size: int
    is_output_rank: bool = True


def check_layout(infos: list[DataParallelInfo]) -> int:
    """The data-parallel size of a group's ranks, after checking they agree: one size, every
    replica present, exactly one output rank per replica."""
    sizes = {i.dp_size for i in infos}
    if len(sizes) != 1:
        raise BatchError(f"the ranks disagree on the data-parallel size: {sorted(sizes)}")
    dp = sizes.pop()
    outputs = sorted(i.dp_rank for i in infos if i.is_output_rank)
    if outputs != list(range(dp)):
        raise BatchError(
            f"each of the {dp} data-parallel replicas needs exactly one output "
            f"rank; the ranks' output replicas are {outputs}"
        )
    return dp


Method = TypeVar("Method", bound=Callable[..., Any])


def dispatch(mode: Dispatch) -> Callable[[Method], Method]:
    """Mark a worker method as callable through a `WorkerGroup` with `mode`."""

    def mark(fn: Method) -> Method:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def dispatch_mode(fn: object) -> Dispatch | None:
    return getattr(fn, DISPATCH_ATTR, None)


def dispatched_methods(cls: type) -> set[str]:
    """The names of `cls`'s methods that the driver calls through a dispatch mode."""
    return {name for name in dir(cls) if dispatch_mode(getattr(cls, name, None)) is not None}


def split_value(value: Any, world_size: int, name: str) -> list[Any]:
    """Cut one argument into `world_size` (data-parallel) equal shares (non-batch values are
    repeated)."""
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


def share_bounds(n: int, shares: int) -> list[tuple[int, int]]:
    """[start, end) of `shares` contiguous shares of `n` rows, in order, the first `n % shares`
    one row longer (some are empty when n < shares)."""
    size, extra = divmod(n, shares)
    bounds, start = [], 0
    for d in range(shares):
        end = start + size + (d < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _rows(value: Any) -> int | None:
    if isinstance(value, TensorDict):
        return value.batch_size[0]
    return len(value) if isinstance(value, list) else None


def rollout_shares(args: tuple, kwargs: dict, shares: int) -> list[tuple[tuple, dict]]:
    """`args` / `kwargs` cut for `ROLLOUT_SPLIT` into `shares` shares, plus one empty share
    last (for the ranks that hold no rollout engine)."""
    counts = {c for c in map(_rows, (*args, *kwargs.values())) if c is not None}
    if len(counts) > 1:
        raise BatchError(
            f"the batch arguments of a rollout call disagree on their row counts: {sorted(counts)}"
        )
    n = counts.pop() if counts else 0
    bounds = share_bounds(n, shares) + [(0, 0)]

    def cut(value: Any, start: int, end: int) -> Any:
        if _rows(value) is not None:
            return value[start:end]
        return value.for_share(start) if hasattr(value, "for_share") else value

    return [
        (tuple(cut(a, s, e) for a in args), {k: cut(v, s, e) for k, v in kwargs.items()})
        for s, e in bounds
    ]


@runtime_checkable
class Mergeable(Protocol):
    """A per-rank result that merges the ranks' results itself (`tephra.controller.samples.
    Scores`)."""

    @classmethod
    def merge(cls, parts: list[Any]) -> Any: ...


def collect(results: list[Any]) -> Any:
    """Merge per-rank results of a `DP_SPLIT` call into one value."""
    first = results[0]
    if isinstance(first, TensorDict):
        return torch.cat(results, dim=0)
    if isinstance(first, list):
        return [x for r in results for x in r]
    if isinstance(first, Mergeable):
        return type(first).merge(results)
    return first
