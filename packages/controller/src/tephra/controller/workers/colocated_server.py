"""A server backend colocated with the training ranks on GPUs: its GPUs, and its automatic
launch settings sized to the trainer beside it (`tephra.rollout.colocation`), settled on every
rank of the group before any server starts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tephra.controller.cluster.gpu_placement import (
    RankGpu,
    gather_rank_gpus,
    server_gpus,
    this_rank_gpu,
)
from tephra.controller.config.tree import EngineRoleConfig, PPOConfig
from tephra.controller.run.memory_estimate import (
    DTYPE_BYTES,
    EngineShape,
    ModelSize,
    trainer_memory,
)
from tephra.engine_api.fastest_dtype import resolve_dtype
from tephra.rollout.base import ServerSettings
from tephra.rollout.colocation import ColocatedBudget, resolve_server_settings


def engine_shape(section: EngineRoleConfig, cfg: PPOConfig, lora: bool) -> EngineShape:
    """What the memory estimate reads of a trained role's section (`actor`, `critic`)."""
    p = section.parallel
    dp = p.data_parallel_size(cfg.resources.world_size)
    fsdp = (p.fsdp_size if p.fsdp_size > 0 else dp) if section.engine == "fsdp" else 1
    return EngineShape(
        compute_dtype=resolve_dtype(section.precision.param_dtype, "cuda"),
        master_dtype=section.precision.master_dtype,
        shard=fsdp * p.tensor * p.pipeline,
        tensor=p.tensor,
        context=p.context,
        tokens_per_microbatch=section.micro_batch.max_tokens_per_microbatch,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        lora=lora,
        offload_params=section.offload.params,
        offload_optimizer=section.offload.optimizer,
        fused_head=section.engine == "fsdp",
    )


def colocated_budget(
    cfg: PPOConfig, size: ModelSize, gpu_total_bytes: int, sharing: int = 1
) -> ColocatedBudget:
    """The trainer's estimated peak on one rank (`tephra.controller.run.memory_estimate`) beside
    a server of `cfg.rollout` on GPUs of `gpu_total_bytes`, each shared by `sharing` ranks."""
    actor = engine_shape(cfg.actor, cfg, lora=cfg.actor.lora.enabled)
    reference = cfg.resources.ref.ranks == 0 and cfg.needs_reference and not cfg.actor.lora.enabled
    critic = (
        engine_shape(cfg.critic, cfg, lora=False)
        if cfg.resources.critic.ranks == 0 and cfg.algorithm.needs("values")
        else None
    )
    memory = trainer_memory(size, actor, reference, critic)
    rollout_bytes = DTYPE_BYTES[resolve_dtype(cfg.rollout.dtype, "cuda")]
    return ColocatedBudget(
        trainer_peak_bytes=memory.peak,
        gpu_total_bytes=gpu_total_bytes,
        server_weight_bytes=size.params * rollout_bytes // cfg.rollout.tensor_parallel_size,
        basis=memory.describe(size, actor.shard),
        sharing=sharing,
    )


@dataclass(frozen=True)
class ColocatedServer:
    """This rank's server settings, resolved, and the line that says what was chosen."""

    settings: ServerSettings
    note: str | None


def plan_colocated_server(
    cfg: PPOConfig, rank: int, ranks: list[RankGpu], size: ModelSize
) -> ColocatedServer | None:
    """The settings of the server rank `rank` starts, from every rank's GPU (`ranks`): its
    GPUs (`CUDA_VISIBLE_DEVICES` in its environment, unless `env` sets it) and its automatic
    fields for the trainer's estimated peak; None on a rank that starts none. Refuses (every
    rank alike) a placement no server can run on (`gpu_placement.server_gpus`)."""
    backend = cfg.rollout.backend
    settings = getattr(cfg.rollout, backend)
    plans = {p.owner: p for p in server_gpus(ranks, cfg.rollout.tensor_parallel_size, backend)}
    mine = plans.get(rank)
    if mine is None:
        return None
    resolved = resolve_server_settings(
        settings,
        backend,
        "cuda",
        colocated_budget(cfg, size, mine.total_bytes, mine.sharing),
        sleeps=cfg.rollout.sleep_when_training,
    )
    out = resolved.settings
    if len(mine.ranks) > 1:
        out = replace(out, env={"CUDA_VISIBLE_DEVICES": mine.visible_devices, **out.env})
    return ColocatedServer(out, resolved.note)


def colocated_server(
    cfg: PPOConfig, rank: int, world_size: int, device: str, model_path: str
) -> ColocatedServer | None:
    """`plan_colocated_server` for this rank, its GPUs exchanged with the group's other ranks
    first (collective: every rank of the colocated group on GPUs calls it)."""
    ranks = gather_rank_gpus(this_rank_gpu(rank, device), world_size)
    if rank % cfg.rollout.tensor_parallel_size:
        # the placement is checked on every rank, so that all of them refuse it together
        server_gpus(ranks, cfg.rollout.tensor_parallel_size, cfg.rollout.backend)
        return None
    return plan_colocated_server(cfg, rank, ranks, ModelSize.of_model(model_path))
