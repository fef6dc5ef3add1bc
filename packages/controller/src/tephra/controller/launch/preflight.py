"""Checks across the RL trainer's config sections, and against the files and machine they
name, run when the config is built (before any process starts); plus the dtype and weight
path those checks settle."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tephra.algos.policy_losses import POLICY_LOSSES
from tephra.controller.cluster import worker_group
from tephra.controller.config.tree import adapter_sync_obstacle
from tephra.controller.data.swe_tasks import check_swe_setup
from tephra.controller.recipes import check_recipes
from tephra.controller.run.checkpoints import MANIFEST, CheckpointManager
from tephra.controller.run.models import declared_model_folder
from tephra.core.errors import ConfigError
from tephra.engine_api.fastest_dtype import resolve_dtype
from tephra.engine_api.multimodal import declared_hf_config, family_name, supported_model_types
from tephra.engine_api.registry import get_engine_class
from tephra.episodes.rewards import RewardConfig, RewardFunctionError, load_reward_function
from tephra.rollout.base import ServerSettings, can_pause
from tephra.rollout.registry import ROLLOUT_BACKENDS
from tephra.rollout.weight_transport import Placement, choose_transport

if TYPE_CHECKING:  # rl_config runs `validate` when a PPOConfig is built
    from tephra.controller.config.tree import (
        EngineRoleConfig,
        PPOConfig,
        ResourcesSection,
        TrainerSection,
    )

RoleConfig = TypeVar("RoleConfig", bound="EngineRoleConfig")


def resolve_auto_dtypes(cfg: PPOConfig) -> PPOConfig:
    """`cfg` with every `auto` compute dtype (actor, critic, rollout) made concrete for the
    workers' device, measured once here, so that every process computes in the same dtype
    and the weight sync sends what the rollout holds."""
    r = cfg.resources
    train = "cuda" if r.gpus_per_rank > 0 else "cpu"
    # rollout replicas of their own (disaggregated) generate on their pool's device
    rollout = (
        train if not r.rollout.replicas else "cuda" if r.rollout.gpus_per_replica > 0 else "cpu"
    )

    def role(section: RoleConfig, dtype: str) -> RoleConfig:
        return replace(section, precision=replace(section.precision, param_dtype=dtype))

    actor = resolve_dtype(cfg.actor.precision.param_dtype, train)
    critic = cfg.critic.precision.param_dtype
    return replace(
        cfg,
        actor=role(cfg.actor, actor),
        # the critic's `auto` is the actor's dtype, as its field says (an fp32 actor, an fp32
        # critic, whatever the machine's fastest dtype)
        critic=role(cfg.critic, actor if critic == "auto" else resolve_dtype(critic, train)),
        rollout=replace(cfg.rollout, dtype=resolve_dtype(cfg.rollout.dtype, rollout)),
    )


def validate(cfg: PPOConfig) -> None:  # noqa: C901, PLR0915 (older than the limit; to split)
    """The combinations, checked together with the arithmetic in the message."""
    b, r, a = cfg.batch, cfg.rollout, cfg.algorithm
    if cfg.data.source == "swe_tasks":
        check_swe_setup(r.agent_loop, r.agent.environment)
    ws = cfg.resources.world_size
    try:
        dp = cfg.data_parallel_size()
    except ConfigError as exc:
        raise ConfigError(
            f"resources.world_size={ws} with the actor's parallel sizes: {exc}; "
            "make world_size a multiple of tensor x pipeline x context"
        ) from None
    if b.prompts_per_step % dp:
        raise ConfigError(
            f"batch.prompts_per_step={b.prompts_per_step} must be a multiple of the data-"
            f"parallel size {dp} (resources.world_size={ws} / model-parallel "
            f"{cfg.actor.parallel.model_parallel_size()}): each data-parallel rank trains on "
            "an equal share of prompt groups"
        )
    rollout_tp = r.tensor_parallel_size
    if cfg.resources.rollout.replicas == 0 and ws % rollout_tp:
        raise ConfigError(
            f"rollout.{r.backend}.tensor_parallel_size={rollout_tp} does not divide "
            f"resources.world_size={ws}: each rollout engine takes that many consecutive "
            "ranks; choose a divisor of the world size (or rollout replicas of their own, "
            "resources.rollout.replicas)"
        )
    settings = getattr(r, r.backend, None)
    if (
        cfg.resources.rollout.replicas == 0
        and rollout_tp > 1
        and isinstance(settings, ServerSettings)
        and settings.sleep_level == 2
    ):
        raise ConfigError(
            f"rollout.{r.backend}.sleep_level=2 with rollout.{r.backend}.tensor_parallel_size="
            f"{rollout_tp} colocated: a server that dropped its weights gets them again from "
            "its own rank's export, which the ranks without a server would not join; use "
            f"sleep_level=1, or rollout replicas of their own (resources.rollout.replicas)"
        )
    check_server_gpus(cfg)
    if cfg.actor.lora_sync == "adapter":
        obstacle = (
            "it needs LoRA (actor.lora.rank > 0)"
            if not cfg.actor.lora.enabled
            else adapter_sync_obstacle(cfg)
        )
        if obstacle is not None:
            raise ConfigError(
                f"actor.lora_sync=adapter: {obstacle}; set actor.lora_sync=merged (or auto, "
                "which picks adapter-only syncs where they work)"
            )
    per_rank = b.samples_per_step // dp
    if per_rank % b.mini_batches:
        raise ConfigError(
            f"each data-parallel rank holds batch.prompts_per_step x samples_per_prompt / dp = "
            f"{b.prompts_per_step} x {b.samples_per_prompt} / {dp} = {per_rank} samples, which "
            f"batch.mini_batches={b.mini_batches} does not divide; choose a divisor of {per_rank}"
        )
    longest = cfg.data.max_prompt_tokens + r.response_budget
    for role in ("actor", "critic"):
        budget = getattr(cfg, role).micro_batch.max_tokens_per_microbatch
        if role == "critic" and not a.needs("values"):
            continue
        if longest > budget:
            raise ConfigError(
                f"a sample can reach data.max_prompt_tokens + {r.budget_name} = "
                f"{cfg.data.max_prompt_tokens} + {r.response_budget} = {longest} tokens, more "
                f"than {role}.micro_batch.max_tokens_per_microbatch={budget}; raise the budget "
                "or lower one of the two"
            )
    if a.needs("groups") and r.temperature == 0:
        raise ConfigError(
            f"rollout.temperature=0 with algorithm.adv_estimator={a.adv_estimator!r}: greedy "
            "sampling gives every sample of a prompt's group the same response, so the "
            "group-relative advantages are all 0 and nothing is learnt; set rollout.temperature "
            "> 0 (e.g. 1.0), or choose an estimator that does not compare samples of one prompt "
            "(e.g. reinforce_plus_plus); greedy evaluation is trainer.val.temperature=0"
        )
    if a.needs("groups") and b.samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} compares samples of one prompt; "
            f"batch.samples_per_prompt={b.samples_per_prompt} must be >= 2"
        )
    if a.needs("k") and b.samples_per_prompt < a.advantage.passk_k:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} with algorithm.advantage.passk_k="
            f"{a.advantage.passk_k} needs at least k samples per prompt; "
            f"batch.samples_per_prompt={b.samples_per_prompt}: raise it or lower passk_k"
        )
    if a.advantage.gdpo_reward_keys is not None and not a.reads("reward_components"):
        raise ConfigError(
            f"algorithm.advantage.gdpo_reward_keys={a.advantage.gdpo_reward_keys} is read by "
            f"algorithm.adv_estimator=gdpo only, not {a.adv_estimator!r}; remove it or set "
            "algorithm.adv_estimator=gdpo"
        )
    if a.needs("baselines") and r.uses_agent_loop:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} takes the greedy response's reward "
            "as the baseline, which the trainer generates with plain `generate`; it is not "
            "supported with rollout.agent_loop"
        )
    replicas = cfg.resources.rollout.replicas
    if cfg.trainer.mode == "async":
        if replicas < 1:
            raise ConfigError(
                "trainer.mode=async streams samples from rollout replicas on a pool "
                "of their own; set resources.rollout.replicas >= 1"
            )
        t = cfg.trainer
        per = t.async_groups_per_request
        capacity = t.async_in_flight * replicas * per
        # finished groups count against the bound: with want - 1 waiting, one more request
        # must still fit
        if capacity < b.prompts_per_step + per - 1:
            raise ConfigError(
                f"trainer.mode=async keeps trainer.async_in_flight x resources.rollout.replicas "
                f"x trainer.async_groups_per_request = {t.async_in_flight} x {replicas} x {per} "
                f"= {capacity} groups in flight or waiting, fewer than the "
                f"batch.prompts_per_step + async_groups_per_request - 1 = "
                f"{b.prompts_per_step + per - 1} a step needs; raise async_in_flight or the "
                "replicas"
            )
        if a.dynamic_sampling or a.needs("baselines"):
            raise ConfigError(
                "trainer.mode=async: algorithm.dynamic_sampling and greedy-baseline "
                f"estimators ({a.adv_estimator!r}) need the sync or one_step_off mode"
            )
    if cfg.trainer.partial_rollout:
        if cfg.trainer.mode != "async":
            raise ConfigError(
                f"trainer.partial_rollout=true interrupts generations in flight on "
                f"rollout replicas when weights arrive; it needs trainer.mode=async "
                f"(now {cfg.trainer.mode!r})"
            )
        if not can_pause(ROLLOUT_BACKENDS.get(r.backend)):
            pausable = [n for n in ROLLOUT_BACKENDS if can_pause(ROLLOUT_BACKENDS.get(n))]
            raise ConfigError(
                f"trainer.partial_rollout=true: rollout.backend={r.backend!r} cannot "
                "interrupt a generation in flight for a weight update (it has no "
                f"`paused()`); use one of {pausable} or set "
                "trainer.partial_rollout=false"
            )
    if a.dynamic_sampling and b.samples_per_prompt < 2:
        raise ConfigError(
            "algorithm.dynamic_sampling drops groups whose samples all scored the "
            f"same; batch.samples_per_prompt={b.samples_per_prompt} must be >= 2"
        )
    if not 0 <= a.overlong_buffer <= r.response_budget:
        raise ConfigError(
            f"algorithm.overlong_buffer={a.overlong_buffer} must be between 0 (off) and the "
            f"response budget {r.budget_name}={r.response_budget}"
        )
    if a.needs("values") and cfg.critic.engine != cfg.actor.engine:
        raise ConfigError(
            f"critic.engine={cfg.critic.engine!r} differs from actor.engine="
            f"{cfg.actor.engine!r}; the colocated worker runs one backend"
        )
    loss = cfg.actor.objective.policy_loss
    if (
        POLICY_LOSSES.meta(loss).get("old_log_probs") == "rollout"
        and a.rollout_correction != "bypass"
    ):
        raise ConfigError(
            f"actor.objective.policy_loss={loss!r} takes the rollout log-probs as the old "
            f"log-probs; set algorithm.rollout_correction=bypass with it (now "
            f"{a.rollout_correction!r})"
        )
    if a.rollout_correction != "none" and cfg.actor.objective.tis_level is not None:
        raise ConfigError(
            f"algorithm.rollout_correction={a.rollout_correction!r} with actor.objective."
            f"tis_level={cfg.actor.objective.tis_level!r} would correct twice; use "
            "algorithm.rollout_correction=tis (and its _level / _cap) alone"
        )
    check_recipes(cfg)
    check_role_pools(cfg)
    check_vision_family(cfg)
    if cfg.data.has_images:
        check_image_support(cfg)
    weight_path(cfg)
    check_engine_support(cfg)
    check_surroundings(cfg)


def check_surroundings(cfg: PPOConfig) -> None:
    """What the config names outside itself, checked while it loads (before Ray starts, so
    that a typo is one line, not Ray's start-up and then a worker's traceback): the reward
    function, the run folder, the checkpoint to resume from, the Ray cluster, and the CPUs
    and GPUs of this machine. The model folder is checked by `prepare` (it may be built or
    converted on first use)."""
    check_reward_files(cfg.reward)
    check_run_dir(cfg.trainer.run_dir)
    check_resume(cfg.trainer)
    check_resources(cfg.resources)


def check_reward_files(reward: RewardConfig) -> None:
    """The custom reward file exists, defines the function, and its signature takes verl's
    `compute_score(data_source, solution_str, ground_truth, extra_info)` (the file is
    imported here, as each worker imports it later); the reward model folder exists."""
    if reward.custom_function_path:
        try:
            load_reward_function(
                reward.custom_function_path,
                reward.custom_function_name,
                reward.custom_function_kwargs,
            )
        except RewardFunctionError as exc:
            raise ConfigError(f"reward.custom_function_path: {exc}") from None
    judge = reward.judge.model_path
    if judge and not (Path(judge).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"reward.judge.model_path={judge!r} is not a Hugging Face model folder (no "
            "config.json); give the folder of the judge model"
        )
    if reward.reward_model_path and not Path(reward.reward_model_path).expanduser().is_dir():
        raise ConfigError(
            f"reward.reward_model_path={reward.reward_model_path!r}: no such "
            "folder; give a Hugging Face sequence-classifier folder"
        )


def check_run_dir(run_dir: str) -> None:
    """`trainer.run_dir` is a folder that exists and is writable, or can be created."""
    path = Path(run_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    fix = "set trainer.run_dir to a folder you can write"
    if not existing.is_dir():
        raise ConfigError(
            f"trainer.run_dir={run_dir!r} cannot be created: {existing} is a "
            f"file, not a folder; {fix}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise ConfigError(f"trainer.run_dir={run_dir!r} {what} (permission denied); {fix}")


def check_resume(t: TrainerSection) -> None:
    """`trainer.resume_from` is a checkpoint folder; `trainer.resume=must` has a checkpoint
    in run_dir. Only their presence: the files are checked against their manifest (SHA-256,
    slow for big checkpoints) when the trainer resumes."""
    fix = "give a step_<N> folder of a run's checkpoints (run_dir/checkpoints/step_<N>)"
    if t.resume_from:
        folder = Path(t.resume_from).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"trainer.resume_from={t.resume_from!r}: no such folder; {fix}")
        if not (folder / MANIFEST).is_file():
            raise ConfigError(
                f"trainer.resume_from={t.resume_from!r}: {MANIFEST} is missing, "
                f"so it is no complete checkpoint; {fix}"
            )
    elif t.resume == "must":
        root = Path(t.run_dir).expanduser() / "checkpoints"
        if not CheckpointManager(root).committed():
            raise ConfigError(
                f"trainer.resume=must but {root} holds no checkpoint; run once "
                "with trainer.save_every or trainer.save_final set, set "
                "trainer.resume_from, or use trainer.resume=auto"
            )


def check_resources(r: ResourcesSection) -> None:
    """`ray_address=auto` finds a running cluster; a private local session (no address)
    has the CPUs and GPUs the ranks and rollout replicas ask for: Ray would wait for them
    forever (the pool's ready timeout then fails after Ray started)."""
    if r.ray_address == "auto":
        worker_group.find_local_cluster()
    if r.ray_address not in (None, "local") or os.environ.get("RAY_ADDRESS"):
        return  # a cluster: its other nodes may have what this one lacks
    # `ray_init` passes num_cpus to a session it starts without an address
    num_cpus = r.num_cpus if r.ray_address is None else None
    # through the module: tests fake the machine by patching worker_group.machine_capacity
    cpus, gpus = worker_group.machine_capacity(num_cpus)
    p = r.rollout
    pools = [(name, getattr(r, name)) for name in ("ref", "critic", "reward")]
    for kind, per_rank, per_replica, have, hint in (
        (
            "CPUs",
            r.cpus_per_rank,
            p.cpus_per_replica,
            cpus,
            f"this machine has {cpus:g}" if num_cpus is None else f"resources.num_cpus={num_cpus}",
        ),
        ("GPUs", r.gpus_per_rank, p.gpus_per_replica, gpus, f"this machine has {gpus}"),
    ):
        kind_l = kind[:-1].lower()
        # the role pools of their own (resources.ref / critic / reward) ask on top
        own = [
            (name, s.ranks, s.cpus_per_rank if kind == "CPUs" else s.gpus_per_rank)
            for name, s in pools
            if s.ranks
        ]
        need = r.world_size * per_rank + p.replicas * per_replica + sum(n * x for _, n, x in own)
        if need > have:
            replicas = (
                f" + resources.rollout.replicas={p.replicas} x {kind_l}s_per_replica="
                f"{per_replica:g}"
                if p.replicas
                else ""
            ) + "".join(
                f" + resources.{name}.ranks={n} x {kind_l}s_per_rank={x:g}" for name, n, x in own
            )
            raise ConfigError(
                f"resources.world_size={r.world_size} x resources.{kind_l}s_per_rank="
                f"{per_rank:g}{replicas} = {need:g} {kind}, but {hint}; lower world_size or "
                f"{kind_l}s_per_rank, or join a cluster with resources.ray_address"
            )


def weight_path(cfg: PPOConfig) -> str:
    """How the weights travel after each update, in one line (the driver prints it once
    per run); a ConfigError where a hop's transport cannot work with the placement.

    Separate rollout pools first receive from training rank 0 by a broadcast of their own
    (NCCL when both pools have GPUs, gloo otherwise); a server backend's
    `weight_transport` then carries them from the process holding the rollout engine into
    its server (`tephra.rollout.weight_transport.choose_transport`)."""
    r, pool = cfg.resources, cfg.resources.rollout
    hops = []
    if pool.replicas:
        both_gpu = r.gpus_per_rank > 0 and pool.gpus_per_replica > 0
        if both_gpu and (r.gpus_per_rank < 1 or pool.gpus_per_replica < 1):
            raise ConfigError(
                f"resources.gpus_per_rank={r.gpus_per_rank} and resources.rollout."
                f"gpus_per_replica={pool.gpus_per_replica}: with fractions Ray may put a "
                "rollout replica on a training rank's GPU, where the NCCL weight broadcast "
                "between them cannot run (NCCL refuses two ranks of one communicator on one "
                "GPU); give both whole GPUs, or colocate (resources.rollout.replicas=0)"
            )
        hops.append(
            f"training rank 0 -> {pool.replicas} rollout replica(s): "
            f"{'nccl (different GPUs)' if both_gpu else 'gloo'}"
        )
    settings = getattr(cfg.rollout, cfg.rollout.backend, None)
    if not isinstance(settings, ServerSettings):
        hops.append(
            f"{'replica' if pool.replicas else 'trainer'} -> in-process "
            f"{cfg.rollout.backend} rollout: tensors copied in place"
        )
    elif settings.weight_sync == "disk":
        hops.append(f"-> {cfg.rollout.backend} server: safetensors on disk (weight_sync=disk)")
    else:
        gpu = (pool.gpus_per_replica if pool.replicas else r.gpus_per_rank) > 0
        placement = Placement(
            "cuda" if gpu else "cpu",
            same_device=settings.url is None,
            server_gpus=settings.tensor_parallel_size * settings.data_parallel_size,
        )
        backend = cfg.rollout.backend
        protocol = getattr(ROLLOUT_BACKENDS.get(backend), "protocol_class", None)
        transport = choose_transport(
            f"rollout.{backend}.weight_transport",
            settings.weight_transport,
            placement,
            *((protocol.weight_transports, backend) if protocol else ()),
        )
        how = "auto" if settings.weight_transport == "auto" else "set"
        hops.append(
            f"{'replica' if pool.replicas else 'trainer'} -> {backend} server: "
            f"{transport} ({how}; {placement.describe()})"
        )
    return "weight transport: " + "; ".join(hops)


def check_server_gpus(cfg: PPOConfig) -> None:
    """A server tephra starts on GPUs must get as many GPUs as it spans (tensor x data
    parallel): colocated, one whole GPU per rank of its group of `tensor_parallel_size` ranks
    (the ranks' GPUs are then listed for it at start: `cluster.gpu_placement`); on rollout
    replicas of their own, that many GPUs per replica. CPU runs are not concerned."""
    r, pool = cfg.resources, cfg.resources.rollout
    settings, backend = cfg.rollout.server, cfg.rollout.backend
    if settings is None or settings.url is not None:
        return
    tp, dp = settings.tensor_parallel_size, settings.data_parallel_size
    field = f"rollout.{backend}"
    if pool.replicas:
        if 0 < pool.gpus_per_replica < tp * dp:
            raise ConfigError(
                f"{field}.tensor_parallel_size={tp} x data_parallel_size={dp} = {tp * dp} GPUs "
                f"per server, but resources.rollout.gpus_per_replica={pool.gpus_per_replica:g}: "
                f"each replica's server runs on its replica's GPUs; set "
                f"resources.rollout.gpus_per_replica={tp * dp}"
            )
        return
    if r.gpus_per_rank == 0:
        return
    if dp > 1:
        raise ConfigError(
            f"{field}.data_parallel_size={dp} colocated on GPUs: each colocated server runs on "
            f"the GPUs of its {tp} rank(s) alone, and the ranks already generate data-parallel "
            f"(one server per {tp} ranks); leave data_parallel_size=1 and raise "
            "resources.world_size, or put the rollout on replicas of their own "
            "(resources.rollout.replicas)"
        )
    if tp > 1 and r.gpus_per_rank != 1:
        raise ConfigError(
            f"{field}.tensor_parallel_size={tp} colocated with resources.gpus_per_rank="
            f"{r.gpus_per_rank:g}: a colocated server spans the GPUs of {tp} consecutive ranks, "
            "one whole GPU each; set resources.gpus_per_rank=1"
        )
    if tp > 1 and r.placement == "STRICT_SPREAD":
        raise ConfigError(
            f"{field}.tensor_parallel_size={tp} colocated with resources.placement=STRICT_SPREAD: "
            f"one rank per node leaves no server {tp} GPUs on one node; use PACK or STRICT_PACK"
        )


def check_role_pools(cfg: PPOConfig) -> None:
    """A pool of its own for the reference or critic must have a use and must split the
    step's samples as the actor's ranks do (equal shares that divide into mini-batches)."""
    b = cfg.batch
    uses = {
        "ref": (
            (cfg.needs_reference and not cfg.actor.lora.enabled)
            or cfg.algorithm.distillation.enabled,
            "nothing uses a reference: set actor.objective.use_kl_loss=true or "
            "algorithm.kl_in_reward, and no actor.lora (its reference is the actor "
            "with the adapters off)",
        ),
        "critic": (
            cfg.algorithm.needs("values"),
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} uses no critic",
        ),
        "reward": (
            cfg.reward.reward_model_path is not None
            or cfg.reward.judge.enabled
            or cfg.algorithm.prime.enabled,
            "no reward is model-based: set reward.reward_model_path, reward.judge.model_path "
            "or algorithm.prime.enabled=true (rule scorers and custom functions score where "
            "the samples are generated)",
        ),
    }
    for role, (used, why) in uses.items():
        ranks = getattr(cfg.resources, role).ranks
        if not ranks:
            continue
        if not used:
            raise ConfigError(
                f"resources.{role}.ranks={ranks}, but {why}; set resources.{role}.ranks=0"
            )
        if role == "reward" and not cfg.algorithm.prime.enabled:
            continue  # scoring takes any share of the samples; only PRIME's model trains there
        parallel = (cfg.critic if role == "critic" else cfg.actor).parallel
        try:
            dp = parallel.data_parallel_size(ranks)
        except ConfigError as exc:
            raise ConfigError(
                f"resources.{role}.ranks={ranks}: {exc}; make it a multiple of "
                "the role's tensor x pipeline x context sizes"
            ) from None
        if b.samples_per_step % dp or (b.samples_per_step // dp) % b.mini_batches:
            raise ConfigError(
                f"resources.{role}.ranks={ranks} gives {dp} data-parallel ranks, which the "
                f"step's {b.samples_per_step} samples (in batch.mini_batches={b.mini_batches} "
                "mini-batches) do not split into equal shares; choose a data-parallel size "
                f"that divides {b.samples_per_step // b.mini_batches}"
            )


def check_vision_family(cfg: PPOConfig) -> None:
    """A vision-language `model.path` (its config.json has a `vision_config`) is of a family
    tephra has an adapter for (`tephra.engine_api.multimodal.VISION_FAMILIES`); a named tiny
    model not built yet is one of them."""
    folder = declared_model_folder(cfg.policy_path, cfg.trainer.seed)
    hf_config = declared_hf_config(replace(cfg.model, path=folder))
    if hf_config.get("vision_config") is None:
        return
    model_type = hf_config.get("model_type")
    if family_name(model_type) is None:
        raise ConfigError(
            f"model.path={cfg.model.path!r} is a vision-language model of model_type "
            f"{model_type!r}, which tephra does not support; supported model types (family): "
            f"{supported_model_types()}"
        )


def check_image_support(cfg: PPOConfig) -> None:
    """Images travel through the hf or vllm rollout and the fsdp engine in the sync loop only."""
    what = (
        "data.source=colour_squares" if cfg.data.source == "colour_squares" else "data.images=true"
    )
    r, a = cfg.rollout, cfg.algorithm
    refused = [
        (
            r.backend not in ("hf", "vllm"),
            f"rollout.backend={r.backend!r}: only the hf and vllm backends generate "
            "with images; set rollout.backend=hf or rollout.backend=vllm",
        ),
        (
            cfg.actor.engine != "fsdp",
            f"actor.engine={cfg.actor.engine!r}: only the fsdp engine "
            "trains vision-language models; set actor.engine=fsdp",
        ),
        (
            r.agent_loop == "openai_agent",
            f"rollout.agent_loop={r.agent_loop!r}: a black-box agent's OpenAI endpoint "
            "does not take images; use the environment or tool_agent loop",
        ),
        (
            cfg.trainer.mode != "sync",
            f"trainer.mode={cfg.trainer.mode!r}: images are supported "
            "in the sync mode only; set trainer.mode=sync",
        ),
        (
            cfg.resources.rollout.replicas > 0,
            f"resources.rollout.replicas={cfg.resources.rollout.replicas}: separate rollout "
            "replicas do not take images yet; set resources.rollout.replicas=0",
        ),
        (
            a.needs("values") and cfg.critic.engine != "fsdp",
            f"critic.engine={cfg.critic.engine!r}: only the fsdp engine "
            "trains vision-language critics; set critic.engine=fsdp",
        ),
        (
            a.needs("baselines"),
            f"algorithm.adv_estimator={a.adv_estimator!r} generates greedy "
            "baselines, not supported with images yet; choose e.g. grpo",
        ),
        (
            cfg.actor.parallel.context > 1,
            f"actor.parallel.context={cfg.actor.parallel.context}: Ulysses does not take images "
            "yet; set actor.parallel.context=1",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"{what} (prompts with images): {why}")


def check_engine_support(cfg: PPOConfig, model_folder: str | None = None) -> None:
    """Ask the backend whether it supports the options set (before any process starts).
    `model_folder`: the resolved `model.path` (`prepare` asks again with it, once a named
    model is built); by default its config.json is read where it already exists."""
    a = cfg.algorithm
    if cfg.actor.moe.replays and cfg.rollout.backend != "hf":
        raise ConfigError(
            "actor.moe.routing_replay='rollout' needs the rollout to record each token's "
            f"experts: rollout.backend={cfg.rollout.backend!r} does not (vLLM 0.32 returns "
            "routed experts only from its V2 GPU model runner: the CPU build's runner never "
            "records them; SGLang does not run here); use rollout.backend=hf, or set "
            "actor.moe.routing_replay=off"
        )
    # CPU ranks are told so; GPU ranks may sit on other nodes than this driver's ("auto")
    device = "auto" if cfg.resources.gpus_per_rank > 0 else "cpu"
    roles: list[tuple[str, EngineRoleConfig, str]] = [("actor", cfg.actor, "policy")]
    if a.needs("values"):
        roles.append(("critic", cfg.critic, "value"))
    for section, role_cfg, role in roles:
        engine_cls = get_engine_class(role_cfg.engine)
        # the backend reads the model's config.json where there is one (its shape against the
        # parallel layout); nothing is built or converted here
        model = replace(
            cfg.model, path=model_folder or declared_model_folder(cfg.policy_path, cfg.trainer.seed)
        )
        try:
            engine_cls.check_config(
                role_cfg.engine_config(model, role, 1.0, cfg.trainer.seed, device=device),
                world_size=cfg.resources.world_size,
            )
        except ConfigError as exc:
            raise ConfigError(f"{section}.engine={role_cfg.engine!r}: {exc}") from None
