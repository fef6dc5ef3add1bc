"""Which GPUs a rollout server colocated with the training ranks runs on.

A server of tensor-parallel size k is held by rank r (r % k == 0) and spans the GPUs of ranks
r .. r + k - 1: its process is started with `CUDA_VISIBLE_DEVICES` listing those ranks' GPUs
(Ray gives each rank's process only its own). The ranks report their GPUs to each other once
at start (`gather_rank_gpus`, over the group's process group); `server_gpus` is the pure rule,
tested from recorded inventories. It refuses, naming the fix, a group whose ranks sit on
different nodes or share a GPU: a k-GPU server is never started inside one rank's GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist

from tephra.core.errors import ConfigError


@dataclass(frozen=True)
class RankGpu:
    """One rank's GPU as its process sees it."""

    rank: int
    node: str
    """Ray node id of the rank's process."""
    gpu_ids: tuple[str, ...]
    """The GPUs Ray assigned (`ray.get_gpu_ids()`, as `CUDA_VISIBLE_DEVICES` lists them on
    the node); the first is the one the rank computes on."""
    name: str
    """Device name (`torch.cuda.get_device_name`)."""
    total_bytes: int
    """Total memory of the rank's GPU (`torch.cuda.get_device_properties(..).total_memory`)."""


@dataclass(frozen=True)
class ServerGpus:
    """The GPUs one colocated server spans."""

    owner: int
    """The rank that starts the server (a multiple of the tensor-parallel size)."""
    ranks: tuple[int, ...]
    visible_devices: str
    """`CUDA_VISIBLE_DEVICES` of the server's process: the ranks' GPUs in rank order."""
    total_bytes: int
    """Memory of the smallest of those GPUs."""
    sharing: int = 1
    """Most ranks of the whole group on any one of those GPUs (fractional GPUs per rank)."""


def rank_gpus(rows: list[dict]) -> list[RankGpu]:
    """`RankGpu`s from JSON rows (each a dict of its fields, as `dataclasses.asdict` writes
    them): how an inventory recorded on a cluster is read back."""
    return [
        RankGpu(
            rank=int(r["rank"]),
            node=str(r["node"]),
            gpu_ids=tuple(str(g) for g in r["gpu_ids"]),
            name=str(r["name"]),
            total_bytes=int(r["total_bytes"]),
        )
        for r in rows
    ]


def server_gpus(ranks: list[RankGpu], tensor_parallel_size: int, backend: str) -> list[ServerGpus]:
    """The GPUs of each colocated server (module docstring), in owner order; a ConfigError
    naming `rollout.<backend>.tensor_parallel_size` and the fix where a group's ranks are on
    different nodes, share a GPU, or have none."""
    k = tensor_parallel_size
    field = f"rollout.{backend}.tensor_parallel_size={k}"
    ordered = sorted(ranks, key=lambda r: r.rank)
    if [r.rank for r in ordered] != list(range(len(ordered))) or len(ordered) % k:
        raise ValueError(f"ranks {[r.rank for r in ordered]} are not 0..n-1 in groups of {k}")
    per_gpu: dict[tuple[str, str], int] = {}
    for r in ordered:
        if r.gpu_ids:
            key = (r.node, r.gpu_ids[0])
            per_gpu[key] = per_gpu.get(key, 0) + 1
    out = []
    for start in range(0, len(ordered), k):
        group = ordered[start : start + k]
        names = [r.rank for r in group]
        missing = [r.rank for r in group if not r.gpu_ids]
        if missing:
            raise ConfigError(
                f"{field} colocated on GPUs: ranks {missing} have no GPU; give every rank one "
                "(resources.gpus_per_rank=1)"
            )
        nodes = sorted({r.node for r in group})
        if len(nodes) > 1:
            raise ConfigError(
                f"{field} colocated: ranks {names} of one server landed on {len(nodes)} nodes "
                f"({', '.join(n[:12] for n in nodes)}); a server's GPUs must be on one node: "
                f"use nodes whose GPU count is a multiple of {k} with resources.placement=PACK "
                f"(or STRICT_PACK), a smaller tensor_parallel_size, or rollout replicas of "
                "their own (resources.rollout.replicas)"
            )
        devices = [r.gpu_ids[0] for r in group]
        if len(set(devices)) < k:
            raise ConfigError(
                f"{field} colocated: ranks {names} share GPUs {devices} (fractional "
                "resources.gpus_per_rank); a server of k ranks needs k GPUs: set "
                "resources.gpus_per_rank=1"
            )
        out.append(
            ServerGpus(
                owner=group[0].rank,
                ranks=tuple(names),
                visible_devices=",".join(devices),
                total_bytes=min(r.total_bytes for r in group),
                sharing=max(per_gpu[(r.node, r.gpu_ids[0])] for r in group),
            )
        )
    return out


def this_rank_gpu(rank: int, device: str) -> RankGpu:
    """This rank's `RankGpu` (`device`: the rank's `cuda:i`)."""
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    return RankGpu(
        rank=rank,
        node=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
        gpu_ids=tuple(str(g) for g in (ray.get_gpu_ids() if ray.is_initialized() else [index])),
        name=props.name,
        total_bytes=int(props.total_memory),
    )


def gather_rank_gpus(own: RankGpu, world_size: int) -> list[RankGpu]:
    """Every rank's `RankGpu`, exchanged over the default process group (collective: every
    rank of the group calls it)."""
    if world_size == 1:
        return [own]
    rows: list[RankGpu | None] = [None] * world_size
    dist.all_gather_object(rows, own)
    return [r for r in rows if r is not None]
