"""Run a function on N ranks of a gloo process group, for multi-process tests.

`run_distributed(fn, world_size=2, args=(...))` spawns one process per rank (fresh
interpreters: `fn` must be importable, i.e. defined at module level in an installed
module), initialises `torch.distributed` with gloo, pins torch to one thread, calls
`fn(*args)` and returns the list of per-rank return values. A rank that raises makes the
whole call raise with that rank's traceback; a rank that hangs is killed after `timeout`.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: mp.Queue[tuple[int, str, Any]],
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # plain pickle bytes: a queue would pass tensors through torch's shared-memory
        # handles, which the parent can no longer open once this rank has exited
        value = pickle.dumps(fn(*args))
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call `fn(*args)` on `world_size` gloo ranks; return the ranks' results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, env or {}))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out
                ]
                if dead:
                    raise RuntimeError(
                        f"run_distributed: rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                        "without a result (is the function importable by module path?)"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run_distributed: ranks {sorted(set(range(world_size)) - set(out))} gave no "
                        f"result within {timeout:.0f} s (a collective mismatch or a hang)"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def all_reduce_probe(fail_on_rank: int | None = None) -> tuple[float, int]:
    """Sum of (rank + 1) over the group, and this rank: a check that a group works.
    With `fail_on_rank`, that rank raises instead (to test error reporting)."""
    if dist.get_rank() == fail_on_rank:
        raise ValueError(f"deliberate failure on rank {fail_on_rank}")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t), dist.get_rank()
