"""Ray worker groups: one actor per rank on a resource pool, one process group per group.

    ray_init(address=None)                      # local when no address, a cluster otherwise
    pool = ResourcePool(world_size=2, cpus_per_rank=1)
    wg = WorkerGroup(MyWorker, pool, init_kwargs={...})
    out = wg.compute_log_probs(batch)           # dispatched as the method declares

A pool is a Ray placement group (one bundle of `cpus_per_rank` CPUs and `gpus_per_rank` GPUs
per rank, packed on as few nodes as possible by default); rank r runs in bundle r. The
rendezvous address of the group's `torch.distributed` process group (gloo on CPU, NCCL on
GPUs) is rank 0's node and a free port there, so groups span nodes. Every worker subclasses
`Worker`, whose constructor joins that group, so the methods run SPMD. Roles that share a
process (actor, reference, rollout, critic) live in one worker class; that is what
"colocated" means here. A worker with GPUs computes on the device Ray assigned to it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray._private import ray_constants
from ray._private.services import canonicalize_bootstrap_address
from ray._private.utils import get_num_cpus

# Ray's `_raylet.pyi` declares only the ID and ObjectRef types of the compiled module, not these
from ray._raylet import Config as RayConfig  # type: ignore[attr-defined]
from ray._raylet import GcsClient  # type: ignore[attr-defined]
from ray.exceptions import AuthenticationError, OutOfMemoryError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tephra.controller.cluster.dispatch import (
    DataParallelInfo,
    Dispatch,
    check_layout,
    collect,
    dispatch_mode,
    rollout_shares,
    split_args,
)
from tephra.controller.cluster.memory_kills import KNOBS, node_memory, ray_oom_usage
from tephra.controller.cluster.startup import process_age_s
from tephra.controller.cluster.stop import sigterm_blocked
from tephra.controller.cluster.watchdog import (
    RankPlace,
    StageFailure,
    Watchdog,
    sample_ids,
    this_rank_place,
)
from tephra.core.host_memory import retain_freed_memory, retain_supported
from tephra.core.quiet import quiet_third_party_warnings
from tephra.engine_api.errors import ConfigError


def ray_init(
    address: str | None = None,
    num_cpus: int | None = None,
    dashboard: bool = False,
    **kwargs: Any,
) -> None:
    """Start (or join) Ray once. `address=None` joins the cluster `RAY_ADDRESS` names, else
    starts a private local session: never a cluster some other job left running here.

    A local session turns Ray's token authentication on with a token made for this session:
    Ray 2.60's servers listen on every interface whatever node address is given (measured),
    so the token is what keeps another machine (or user) from submitting work to it. The
    dashboard (an HTTP server) starts only when `dashboard` asks for it."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and os.environ.get("RAY_AUTH_MODE", "token") == "token":
        # Ray turns token mode on for a new local session itself (it must: it reads the mode
        # at import); a token in the environment keeps it from writing one to ~/.ray, and the
        # workers inherit it
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        # Ray announces the mode it turned on with a warning on every start: it is the
        # intended state here, said once in the README
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
            logging.ERROR
        )
    # Under `uv run`, Ray would otherwise copy the working tree and build a fresh virtual
    # environment for the workers on every session (a minute on 2 cores); the driver's
    # environment already has everything, so workers reuse its interpreter.
    # Ray starts workers at niceness 15; here the workers ARE the training, so they get
    # the same priority as the driver (read by the raylet when it starts).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray reads the switch once at import, so the module constant is set too.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0":
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    if address not in (None, "auto", "local"):
        check_reachable(address)
    if address is not None:
        join_with_token()
    if address not in (None, "auto", "local") and not address.startswith("ray://"):
        check_token(address)
    # transformers' per-rank "Loading weights" bars would interleave in the console on every
    # build; HF_HUB_DISABLE_PROGRESS_BARS=0 in the driver's environment brings them back
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    }
    for key in ("TEPHRA_CACHE", "HF_HUB_OFFLINE", "HF_HOME", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    # the daemons a local session starts keep SIGTERM blocked (as Ray keeps SIGINT): a SIGTERM
    # to the job's process group reaches the driver alone, which stops them (tephra.controller.cluster.stop)
    with sigterm_blocked():
        ray.init(
            address=address or "local",
            num_cpus=num_cpus if address is None else None,
            include_dashboard=dashboard,
            log_to_driver=True,
            runtime_env={"env_vars": env},
            **kwargs,
        )


def join_with_token() -> None:
    """Joining a cluster with a token in the environment (RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH, as the cluster scripts set it) turns Ray's token mode on in this
    process, unless RAY_AUTH_MODE says otherwise: Ray reads the mode when it is imported, so a
    token exported later, or a process that imported Ray first, would otherwise connect
    without it and be refused."""
    has_token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if has_token and os.environ.get("RAY_AUTH_MODE", "token") == "token":
        os.environ["RAY_AUTH_MODE"] = "token"
        RayConfig.initialize("")  # what Ray does when it turns the mode on itself


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a Ray address nothing answers on: `ray.init` would retry it for minutes."""
    host_port = address.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"resources.ray_address={address!r}: write host:port (e.g. "
            "10.0.0.5:6379 or ray://10.0.0.5:10001), or null for a local session"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"resources.ray_address={address!r}: nothing answers there ({exc}); start the "
            "cluster (`ray start --head` on that node) and check host and port, or set "
            "resources.ray_address=null for a local session"
        ) from None


def check_token(address: str) -> None:
    """Refuse at once a cluster that refuses this process's token: `ray.init` would retry
    for about 2 minutes (measured) and end in a ConnectionError that does not say why."""
    try:
        GcsClient(address=address)
    except AuthenticationError:
        raise ConfigError(
            f"resources.ray_address={address!r}: the Ray cluster refused this process's token "
            "(or it has none); export the RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) its nodes "
            "were started with (scripts/cluster/ray-head.sh), before starting the trainer"
        ) from None
    except Exception:  # noqa: BLE001  (anything else: ray.init reports it as it does)
        pass


def find_local_cluster() -> str:
    """`resources.ray_address=auto`: the address of the Ray cluster on this machine, found as
    `ray.init("auto")` finds it (RAY_ADDRESS, the last `ray start`, a running GCS), and
    answering there; otherwise a `ConfigError` (ray.init would raise a ConnectionError)."""
    try:
        address = canonicalize_bootstrap_address("auto")
    except ConnectionError:
        address = None
    if not address:
        raise ConfigError(
            "resources.ray_address=auto but no Ray cluster runs on this machine; start one "
            "(`ray start --head`), give a cluster's host:port, or set resources.ray_address=null "
            "for a private local session"
        )
    check_reachable(address)
    return address


def machine_capacity(num_cpus: int | None) -> tuple[float, int]:
    """(CPUs, GPUs) a private local Ray session started with `num_cpus` gets: `num_cpus`
    when given, else the CPUs Ray detects (cgroup quotas included); the visible GPUs."""
    cpus: float
    if num_cpus is not None:
        cpus = num_cpus
    else:
        try:
            cpus = get_num_cpus()
        except ImportError:  # Ray moved it: what the OS lets this process use
            cpus = len(os.sched_getaffinity(0))
    return float(cpus), torch.cuda.device_count()


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ResourcePool:
    """Where a worker group's ranks go: a Ray placement group of one bundle per rank."""

    world_size: int = 1
    """Number of ranks (one Ray actor each)."""
    cpus_per_rank: float = 1.0
    """CPUs Ray reserves per rank; also the rank's torch thread count (Ray sets
    OMP_NUM_THREADS from it)."""
    gpus_per_rank: float = 0.0
    """GPUs per rank (0 on CPU machines; the process group is then gloo)."""
    strategy: str = "PACK"
    """Ray placement strategy of the bundles: `PACK` (as few nodes as possible), `SPREAD`,
    `STRICT_PACK` (one node), `STRICT_SPREAD` (one rank per node)."""
    name: str = "global"
    """Name of the pool (roles placed on the same pool share its bundles)."""
    ready_timeout_s: float = 60.0
    """Seconds to wait for the cluster to grant the bundles before giving up with an error
    that says what is missing (instead of waiting forever)."""
    retain_freed_memory: bool | None = None
    """Whether the ranks keep freed host memory for reuse (`tephra.core.retain_freed_memory`):
    None is on for CPU ranks (no GPUs), where it saves each step's page faults on the large
    tensors it allocates again, and off for GPU ranks, whose host memory then shrinks back
    after loading or exporting weights. True needs glibc."""
    memory_per_rank_gb: float = 0.0
    """Host memory (GiB) Ray reserves per rank (its `memory` resource, in the rank's bundle):
    Ray then places no more ranks on a node than its memory holds. 0: none reserved."""

    def __post_init__(self) -> None:
        if self.memory_per_rank_gb < 0:
            raise ConfigError(
                f"resources.memory_per_rank_gb={self.memory_per_rank_gb} must be >= 0 (0: none)"
            )
        if self.world_size < 1:
            raise ConfigError(f"resources.world_size={self.world_size} must be >= 1")
        if self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ConfigError("resources.cpus_per_rank and gpus_per_rank must be >= 0")
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"resources.placement={self.strategy!r}: choose one of {list(PLACEMENT_STRATEGIES)}"
            )
        check_retain(self.retain_freed_memory)
        self._group: PlacementGroup | None = None

    @property
    def retains_freed_memory(self) -> bool:
        """`retain_freed_memory` with None resolved: on where the ranks have no GPUs."""
        if self.retain_freed_memory is None:
            return self.gpus_per_rank == 0 and retain_supported()
        return self.retain_freed_memory

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            out["GPU"] = self.gpus_per_rank
        if self.memory_per_rank_gb:
            out["memory"] = float(int(self.memory_per_rank_gb * 2**30))
        return out

    def check_fits(self) -> None:
        """Fail fast when the cluster as a whole lacks the resources."""
        have = ray.cluster_resources()
        need_cpu = self.world_size * self.cpus_per_rank
        if need_cpu > have.get("CPU", 0) + 1e-9:
            raise ConfigError(
                f"the worker group needs {need_cpu:g} CPUs (world_size={self.world_size} x "
                f"cpus_per_rank={self.cpus_per_rank:g}) but Ray has {have.get('CPU', 0):g}; "
                "lower resources.cpus_per_rank or resources.world_size"
            )
        need_memory = self.world_size * self.memory_per_rank_gb * 2**30
        if need_memory > have.get("memory", 0) + 1:
            raise ConfigError(
                f"the worker group needs {need_memory / 2**30:.1f} GiB of memory (world_size="
                f"{self.world_size} x memory_per_rank_gb={self.memory_per_rank_gb:g}) but Ray "
                f"has {have.get('memory', 0) / 2**30:.1f} GiB; lower resources.memory_per_rank_gb"
            )
        need_gpu = self.world_size * self.gpus_per_rank
        if need_gpu > have.get("GPU", 0) + 1e-9:
            raise ConfigError(
                f"the worker group needs {need_gpu:g} GPUs but Ray has {have.get('GPU', 0):g}"
            )

    def placement_group(self) -> PlacementGroup:
        """The pool's placement group, created (and waited for) on first use."""
        if self._group is None:
            self.check_fits()
            group = placement_group(
                [self.bundle()] * self.world_size,
                strategy=self.strategy,
                name=f"tephra-{self.name}-{os.getpid()}-{id(self)}",
            )
            ready, _ = ray.wait([group.ready()], timeout=self.ready_timeout_s)
            if not ready:
                ray.util.remove_placement_group(group)
                raise ConfigError(
                    f"Ray could not place {self.world_size} bundles of {self.bundle()} with "
                    f"strategy {self.strategy} within {self.ready_timeout_s:g} s (free: "
                    f"{ray.available_resources()}, nodes: {len(ray.nodes())}); lower "
                    "resources.world_size / cpus_per_rank, or use a less strict placement"
                )
            self._group = group
        return self._group

    def release(self) -> None:
        if self._group is not None:
            ray.util.remove_placement_group(self._group)
            self._group = None

    def strategy_for(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group(),
            placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
def _rendezvous_address() -> tuple[str, int]:
    """Runs on rank 0's bundle: that node's address and a free port there."""
    return ray.util.get_node_ip_address(), _free_port()


def rendezvous_address(pool: ResourcePool) -> tuple[str, int]:
    """The address and a free port on the node of the pool's rank 0, where its process
    group listens. Found here when that node is the driver's (every single-machine run): a
    Ray task would first wait for an idle worker process to start and import (seconds of
    start-up, tens under load); on another node, a zero-CPU task on rank 0's bundle asks."""
    group = pool.placement_group()
    node = placement_group_table(group).get("bundles_to_node_id", {}).get(0)
    if node is not None and node == ray.get_runtime_context().get_node_id():
        return ray.util.get_node_ip_address(), _free_port()
    return ray.get(_rendezvous_address.options(scheduling_strategy=pool.strategy_for(0)).remote())


def device_from_assignment(gpu_ids: list, visible: str | None) -> tuple[str, int]:
    """(torch device, LOCAL_RANK) of a Ray actor: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it
    assigned, so the actor's first assigned GPU is at its index in that list (0 when Ray set
    it); no GPU assigned: ("cpu", 0)."""
    if not gpu_ids:
        return "cpu", 0
    listed = [v.strip() for v in (visible or "").split(",") if v.strip()]
    first = str(gpu_ids[0])
    index = listed.index(first) if first in listed else 0
    return f"cuda:{index}", index


def process_group_backend(device: str) -> str:
    """gloo on CPU. On a GPU, NCCL for CUDA tensors and gloo beside it: both engines reduce
    host-side values (token counts, metrics) over their groups too."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def check_retain(value: bool | None) -> None:
    """Refuse `resources.retain_freed_memory=true` where it cannot take effect."""
    if value and not retain_supported():
        raise ConfigError(
            "resources.retain_freed_memory=true needs glibc (Linux); this "
            "C library has no such setting: leave it null or false"
        )


class Worker:
    """Base of every worker class: joins the group's process group on construction and
    knows its device (`self.device`: "cpu" or the "cuda:i" Ray assigned). Subclasses take
    the base's positional arguments as `*worker_args` and pass them on."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        threads: int,
        retain_memory: bool = False,
    ) -> None:
        self.startup: dict[str, float] = {"process_s": round(process_age_s(), 2)}
        """Seconds of this worker's start-up phases: `process_s` from its process's start
        to this constructor (Ray starting the process, the imports); subclasses add theirs."""
        quiet_third_party_warnings()  # before this worker imports reward or agent packages
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(max(1, threads))
        self.retains_freed_memory = retain_memory and retain_freed_memory()
        """Whether this process keeps freed host memory (`ResourcePool.retain_freed_memory`)."""
        self.device, local_rank = device_from_assignment(
            ray.get_gpu_ids() if ray.is_initialized() else [],
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        if self.device.startswith("cuda"):
            torch.cuda.set_device(local_rank)
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
        )
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                process_group_backend(self.device), rank=rank, world_size=world_size
            )

    def ping(self) -> int:
        return self.rank

    def startup_phases(self) -> dict[str, float]:
        """This worker's start-up phases (`self.startup`), for the run's timeline."""
        return self.startup

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def place(self) -> RankPlace:
        """This rank's node, pid and log files, for the watchdog's messages."""
        return this_rank_place(self.rank)

    def dp_info(self) -> DataParallelInfo:
        """Where this rank stands for `DP_SPLIT`; the default is pure data parallelism.
        Workers whose engines shard the model override it (ask the engine)."""
        return DataParallelInfo(dp_rank=self.rank, dp_size=self.world_size)

    def rollout_info(self) -> DataParallelInfo:
        """Where this rank stands for `ROLLOUT_SPLIT` (generation's data parallelism); the
        default is one rollout replica per rank."""
        return DataParallelInfo(dp_rank=self.rank, dp_size=self.world_size)

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)


class WorkerGroup:
    """`world_size` Ray actors of `worker_cls` on `pool`, called through their dispatch modes."""

    def __init__(
        self,
        worker_cls: type[Worker],
        pool: ResourcePool,
        init_kwargs: dict[str, Any] | None = None,
        name: str = "workers",
        concurrency_groups: dict[str, int] | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        """`concurrency_groups`: Ray concurrency groups of the actors (name -> threads), for
        methods called with `execute.options(concurrency_group=name)`; the default group keeps
        one call at a time. `watchdog` sets each call's deadline (default: `WatchdogConfig()`'s
        rules) and names the rank that missed it or died."""
        if not issubclass(worker_cls, Worker):
            raise TypeError(f"{worker_cls.__name__} must subclass tephra.controller.Worker")
        self.pool, self.worker_cls, self.name = pool, worker_cls, name
        self.concurrency_groups = dict(concurrency_groups or {})
        self.watchdog = watchdog or Watchdog()
        self.workers: list = []
        self.places: list[RankPlace | None] = []
        # The rendezvous port is free when picked but may be taken before rank 0 listens on
        # it (other processes open ephemeral ports too): then the group is built again on
        # another port.
        for attempt in range(3):
            try:
                self._start(init_kwargs or {})
                break
            except OutOfMemoryError as err:  # a rank killed by Ray's monitor while it built
                self.shutdown(grace_s=0)
                at_kill = ray_oom_usage(str(err))
                raise StageFailure(
                    f"worker group {self.name!r} at start-up: a rank was killed by Ray's memory "
                    "monitor while it started ("
                    + (f"node memory at the kill {at_kill}" if at_kill else node_memory())
                    + f"); to lower a rank's memory: {KNOBS}",
                    "out_of_memory",
                    self.name,
                    "start",
                    [],
                ) from None
            except Exception as err:
                self.shutdown(grace_s=0)  # ranks may wait on a rendezvous that never comes
                if "EADDRINUSE" not in str(err) or attempt == 2:
                    raise
        self.dp_size = check_layout(self.layout)
        self.rollout_dp_size = check_layout(self.rollout_layout)

    def _start(self, init_kwargs: dict[str, Any]) -> None:
        pool = self.pool
        master_addr, port = rendezvous_address(pool)
        # Ray takes concurrency groups on the class, not in `.options()`; its `remote`
        # overloads leave out the `concurrency_groups` keyword that it documents and accepts
        remote = (
            ray.remote(concurrency_groups=self.concurrency_groups)(self.worker_cls)  # type: ignore[call-overload]
            if self.concurrency_groups
            else ray.remote(self.worker_cls)
        )
        threads = max(1, int(pool.cpus_per_rank))
        self.workers = [
            remote.options(
                num_cpus=pool.cpus_per_rank,
                num_gpus=pool.gpus_per_rank,
                scheduling_strategy=pool.strategy_for(r),
                name=f"{self.name}-{r}-{os.getpid()}-{id(self)}-{port}",
            ).remote(
                r,
                pool.world_size,
                master_addr,
                port,
                threads,
                pool.retains_freed_memory,
                **init_kwargs,
            )
            for r in range(pool.world_size)
        ]
        # surfaces constructor errors now (rank 0's first: it is the one that listens)
        self.layout = ray.get([w.execute.remote("dp_info") for w in self.workers])
        self.rollout_layout = ray.get([w.execute.remote("rollout_info") for w in self.workers])
        self.places = ray.get([w.execute.remote("place") for w in self.workers])

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    def startup_phases(self) -> dict[str, float]:
        """The slowest rank's start-up phases (`Worker.startup`), the ones the run waited for."""
        phases = ray.get([w.execute.remote("startup_phases") for w in self.workers])
        return max(phases, key=lambda p: sum(p.values()))

    def node_ids(self) -> list[str]:
        """The Ray node of every rank (in rank order)."""
        return ray.get([w.execute.remote("node_id") for w in self.workers])

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every rank as its dispatch mode says; blocks for the result."""
        fn = getattr(self.worker_cls, method, None)
        mode = dispatch_mode(fn) if fn is not None else None
        if mode is None:
            raise AttributeError(
                f"{self.worker_cls.__name__}.{method} is not a dispatched worker method "
                "(declare it with @dispatch(Dispatch.DP_SPLIT | BROADCAST | RANK_ZERO))"
            )
        if mode in (Dispatch.DP_SPLIT, Dispatch.ROLLOUT_SPLIT):
            if mode is Dispatch.DP_SPLIT:
                layout, shares = self.layout, split_args(args, kwargs, self.dp_size)
                share_of = [info.dp_rank for info in layout]
            else:  # ranks without a rollout engine get the empty share, the last one
                layout = self.rollout_layout
                shares = rollout_shares(args, kwargs, self.rollout_dp_size)
                share_of = [i.dp_rank if i.is_output_rank else -1 for i in layout]
            refs = [
                w.execute.remote(method, *shares[d][0], **shares[d][1])
                for w, d in zip(self.workers, share_of)
            ]
            results = self._wait(method, refs, [sample_ids(*shares[d]) for d in share_of])
            outputs = sorted(
                ((info.dp_rank, r) for info, r in zip(layout, results) if info.is_output_rank),
                key=lambda pair: pair[0],
            )
            return collect([r for _, r in outputs])
        refs = [w.execute.remote(method, *args, **kwargs) for w in self.workers]
        results = self._wait(method, refs)
        return results[0] if mode is Dispatch.RANK_ZERO else results

    def _wait(self, method: str, refs: list, samples: list[str | None] | None = None) -> list:
        return self.watchdog.wait(
            refs, group=self.name, stage=method, places=self.places, samples=samples or []
        )

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop the actors. Each first gets `grace_s` seconds to exit on its own, after the
        calls it has queued (Ray's `exit_actor`); whatever is still alive then is killed.
        Killed at once, a worker takes Ray's SIGTERM wherever it stands, and the SystemExit
        that raises inside an interrupted cleanup is printed as a traceback."""
        if grace_s > 0 and self.workers:
            exits = [w.__ray_terminate__.remote() for w in self.workers]
            ray.wait(exits, num_returns=len(exits), timeout=grace_s)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
