"""Ray worker groups: one actor per rank on a resource pool, one process group per group.

    ray_init(address=None)                      # local when no address, a cluster otherwise
    pool = ResourcePool(world_size=2, cpus_per_rank=1)
    wg = WorkerGroup(MyWorker, pool, init_kwargs={...})
    out = wg.compute_log_probs(batch)           # dispatched as the method declares

Every worker subclasses `Worker`, whose constructor joins a `torch.distributed` process
group (gloo on CPU, NCCL when the pool has GPUs) across the group's ranks, so the methods
run SPMD. Roles that share a process (actor, reference, rollout, critic) live in one worker
class; that is what "colocated" means here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import ray

from tephra.controller.dispatch import Dispatch, collect, dispatch_mode, split_args
from tephra.engine_api.errors import ConfigError


def ray_init(address: str | None = None, num_cpus: int | None = None, **kwargs: Any) -> None:
    """Start (or join) Ray once. `address=None` starts a local one-machine session."""
    if ray.is_initialized():
        return
    # Under `uv run`, Ray would otherwise copy the working tree and build a fresh virtual
    # environment for the workers on every session (a minute on 2 cores); the driver's
    # environment already has everything, so workers reuse its interpreter.
    # Ray starts workers at niceness 15; here the workers ARE the training, so they get
    # the same priority as the driver (read by the raylet when it starts).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray reads the switch once at import, so the module constant is set too.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0":
        from ray._private import ray_constants

        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    env = {"TOKENIZERS_PARALLELISM": "false"}
    for key in ("TEPHRA_CACHE", "HF_HUB_OFFLINE", "HF_HOME", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    ray.init(
        address=address,
        num_cpus=num_cpus if address is None else None,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": env},
        **kwargs,
    )


@dataclass
class ResourcePool:
    """Where a worker group's ranks go."""

    world_size: int = 1
    """Number of ranks (one Ray actor each)."""
    cpus_per_rank: float = 1.0
    """CPUs Ray reserves per rank; also the rank's torch thread count (Ray sets
    OMP_NUM_THREADS from it). Keep world_size * cpus_per_rank <= the machine's CPUs, or the
    actors wait forever for resources."""
    gpus_per_rank: float = 0.0
    """GPUs per rank (0 on CPU machines; the process group is then gloo)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"resources.world_size={self.world_size} must be >= 1")
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError("resources.cpus_per_rank and gpus_per_rank must be >= 0")

    def check_fits(self) -> None:
        """Fail fast instead of leaving actors pending forever."""
        have = ray.available_resources()
        need_cpu = self.world_size * self.cpus_per_rank
        if need_cpu > have.get("CPU", 0) + 1e-9:
            raise ConfigError(
                f"the worker group needs {need_cpu:g} CPUs (world_size={self.world_size} x "
                f"cpus_per_rank={self.cpus_per_rank:g}) but Ray has {have.get('CPU', 0):g} free; "
                "lower resources.cpus_per_rank or resources.world_size"
            )
        need_gpu = self.world_size * self.gpus_per_rank
        if need_gpu > have.get("GPU", 0) + 1e-9:
            raise ConfigError(
                f"the worker group needs {need_gpu:g} GPUs but Ray has {have.get('GPU', 0):g}"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Worker:
    """Base of every worker class: joins the group's process group on construction."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 threads: int) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(max(1, threads))
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_RANK="0" if not torch.cuda.is_available() else str(rank))
        if world_size > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world_size)

    def ping(self) -> int:
        return self.rank

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)


class WorkerGroup:
    """`world_size` Ray actors of `worker_cls`, called through their dispatch modes."""

    def __init__(self, worker_cls: type[Worker], pool: ResourcePool,
                 init_kwargs: dict[str, Any] | None = None, name: str = "workers") -> None:
        if not issubclass(worker_cls, Worker):
            raise TypeError(f"{worker_cls.__name__} must subclass tephra.controller.Worker")
        pool.check_fits()
        self.pool, self.worker_cls, self.name = pool, worker_cls, name
        master_addr = ray.util.get_node_ip_address()
        port = _free_port()
        remote = ray.remote(worker_cls)
        threads = max(1, int(pool.cpus_per_rank))
        self.workers = [
            remote.options(num_cpus=pool.cpus_per_rank, num_gpus=pool.gpus_per_rank,
                           name=f"{name}-{r}-{os.getpid()}-{id(self)}")
            .remote(r, pool.world_size, master_addr, port, threads, **(init_kwargs or {}))
            for r in range(pool.world_size)
        ]
        ray.get([w.ping.remote() for w in self.workers])  # surfaces constructor errors now

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def dp_size(self) -> int:
        return self.pool.world_size

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every rank as its dispatch mode says; blocks for the result."""
        fn = getattr(self.worker_cls, method, None)
        mode = dispatch_mode(fn) if fn is not None else None
        if mode is None:
            raise AttributeError(
                f"{self.worker_cls.__name__}.{method} is not a dispatched worker method "
                "(declare it with @dispatch(Dispatch.DP_SPLIT | BROADCAST | RANK_ZERO))"
            )
        if mode is Dispatch.DP_SPLIT:
            shares = split_args(args, kwargs, self.world_size)
            refs = [w.execute.remote(method, *a, **k) for w, (a, k) in zip(self.workers, shares)]
            return collect(ray.get(refs))
        refs = [w.execute.remote(method, *args, **kwargs) for w in self.workers]
        results = ray.get(refs)
        return results[0] if mode is Dispatch.RANK_ZERO else results

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
