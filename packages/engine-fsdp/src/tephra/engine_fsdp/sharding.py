"""Process group, device mesh and FSDP2 (`fully_shard`) wrapping.

World size 1 without an initialised process group: the engine initialises a 1-rank
process group itself (gloo on CPU, NCCL+gloo on CUDA, rendezvous through an in-process
`HashStore`, so no port is taken), so a single process runs exactly the sharded code path
that multi-rank runs use. That group is the process's default group from then on.
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from tephra.engine_api.config import EngineConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.process_group import ensure_single_process_group
from tephra.engine_api.process_group import release_process_group as release_process_group

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(choice: str) -> torch.device:
    """`auto` -> this rank's CUDA device when CUDA is available, else CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device='cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def ensure_process_group(device: torch.device) -> bool:
    """Initialise a 1-rank group when none exists; returns whether this call created it.
    Where CUDA is visible the group gets NCCL for CUDA tensors whatever `device` is, so a CPU
    engine built first in the process does not leave a later CUDA engine without it."""
    cuda = device.type == "cuda" or torch.cuda.is_available()
    return ensure_single_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")


def cpu_group() -> dist.ProcessGroup | None:
    """A process group that can reduce CPU tensors: the default one when its backend has
    gloo, else a gloo group over the same ranks (e.g. after `init_process_group("nccl")`)."""
    if "gloo" in str(dist.get_backend()):
        return None
    return dist.new_group(backend="gloo")


def check_parallel(config: EngineConfig, world: int) -> None:
    """Refuse the parallel options engine=fsdp does not implement at `world` ranks."""
    par = config.parallel
    for name in ("tensor", "pipeline", "virtual_pipeline", "expert", "expert_tensor"):
        if getattr(par, name) != 1:
            raise ConfigError(
                f"parallel.{name}={getattr(par, name)}: engine=fsdp has data and sequence "
                f"(parallel.context) parallelism only; set it to 1 or use engine=megatron"
            )
    if par.moe_token_dispatcher != "alltoall":
        raise ConfigError(
            f"parallel.moe_token_dispatcher={par.moe_token_dispatcher!r}: engine=fsdp has no "
            "expert parallelism; leave it at 'alltoall' or use engine=megatron"
        )
    if world % par.context:
        raise ConfigError(
            f"parallel.context={par.context} must divide the world size {world} (engine=fsdp "
            "splits each sequence across that many ranks)"
        )


def build_mesh(config: EngineConfig, device: torch.device) -> DeviceMesh:
    """1-D mesh `("shard",)` over all ranks, or 2-D `("replicate", "shard")` (HSDP) when
    `parallel.fsdp_size` divides the world into several shard groups."""
    par = config.parallel
    world = dist.get_world_size()
    check_parallel(config, world)
    shard = world if par.fsdp_size in (-1, world) else par.fsdp_size
    if shard < 1 or world % shard:
        raise ConfigError(
            f"parallel.fsdp_size={par.fsdp_size} must be -1 or divide the world size {world}"
        )
    if shard == world:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard")
    )


def check_ulysses(config: EngineConfig, hf_model: PreTrainedModel, where: str) -> None:
    """Refuse what Ulysses sequence parallelism (`parallel.context > 1`) does not cover."""
    sp = config.parallel.context
    text = hf_model.config.get_text_config()
    heads = text.num_attention_heads
    if heads % sp:
        raise ConfigError(
            f"{where}: {heads} attention heads are not divisible by parallel.context={sp}; "
            "choose a context size that divides the head count"
        )


def shard_model(
    root: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh,
    config: EngineConfig,
    device: torch.device,
) -> None:
    """`fully_shard` each decoder layer, then the root (embeddings, norm, output head).

    Mixed precision: parameters are cast to `precision.param_dtype` (`auto` resolved for the
    device) for compute and
    gradients reduced in `precision.reduce_dtype`; the sharded parameters the optimizer
    updates stay float32 (the master weights).
    """
    prec = config.precision
    if prec.master_dtype != "float32":
        raise ConfigError(
            f"precision.master_dtype={prec.master_dtype!r}: engine=fsdp keeps float32 master "
            "weights; set it to 'float32' and use precision.param_dtype for low-precision compute"
        )
    kwargs: dict = {"mesh": mesh}
    param_dtype = prec.compute_dtype(device.type)
    if param_dtype != "float32" or prec.reduce_dtype != "float32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[prec.reduce_dtype]
        )
    if config.offload.params:
        # pinned memory needs an accelerator: on a CPU-only machine pinning fails
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for unit in sharing_units(layers):
        fully_shard(unit if len(unit) > 1 else unit[0], **kwargs)
    fully_shard(root, **kwargs)
    # a parameter one rank's tokens leave unused (LongCat-Flash's routed experts when a
    # micro-batch routes a rank's tokens to its zero-compute experts only) has no gradient
    # there: without zeros in its place the ranks' reduce-scatters differ in size and the
    # process group aborts
    cast(FSDPModule, root).set_reduce_scatter_unused_params(True)


def sharing_units(layers: list[nn.Module]) -> list[list[nn.Module]]:
    """`layers` grouped into FSDP units: one layer each, except that layers holding the same
    parameter (Zamba's hybrid layers share one tied transformer block) are one unit, since
    FSDP manages a parameter in one group only."""
    units: list[list[nn.Module]] = []
    owner: dict[int, int] = {}  # parameter id -> index of its unit in `units`
    for layer in layers:
        ids = [id(p) for p in layer.parameters()]
        joined = sorted({owner[i] for i in ids if i in owner})
        if not joined:
            units.append([layer])
            index = len(units) - 1
        else:
            index = joined[0]
            units[index].append(layer)
            for other in joined[1:]:  # this layer links two units: merge them
                units[index] += units[other]
                units[other] = []
                owner.update({i: index for i, u in owner.items() if u == other})
        owner.update(dict.fromkeys(ids, index))
    return [unit for unit in units if unit]
