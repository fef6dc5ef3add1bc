"""Assemble and run the RL trainer from a `PPOConfig`: data, Ray, the worker group, the loop.

    from tephra.controller.launch.ppo import run
    from tephra.controller.config.tree import PPOConfig
    summary = run(PPOConfig(...))

Everything that can be checked is checked before Ray starts: the config validates itself
when built, and `prepare` resolves the model folder, the tools file and the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import ray
import torch
import yaml
from transformers import AutoConfig

from tephra.controller.cluster.dispatch import dispatched_methods
from tephra.controller.cluster.startup import Timeline
from tephra.controller.cluster.stop import StopNow, StopSignal
from tephra.controller.cluster.watchdog import Watchdog, check_stage_names
from tephra.controller.cluster.worker_group import ResourcePool, WorkerGroup, ray_init
from tephra.controller.config.tree import PPOConfig
from tephra.controller.data.code_problems import code_problem_records
from tephra.controller.data.colour_squares import colour_square_rows
from tephra.controller.data.multimodal import load_multimodal_parquet, multimodal_prompt_from_row
from tephra.controller.data.prompts import (
    check_same_data,
    dataset_fingerprint,
    load_hf_dataset,
    load_parquet,
    reasoning_gym_records,
    tokenize_prompts,
)
from tephra.controller.data.swe_tasks import swe_task_records
from tephra.controller.launch.judge_server import JudgeServer, needs_judge_server
from tephra.controller.launch.preflight import (
    check_engine_support,
    resolve_auto_dtypes,
    validate,
    weight_path,
)
from tephra.controller.launch.server_probes import check_server_urls
from tephra.controller.loop.trainer import RunService, Trainer
from tephra.controller.recipes import enabled_recipes
from tephra.controller.run.checkpoints import CheckpointManager
from tephra.controller.run.flops import model_shape
from tephra.controller.run.models import load_tokenizer, named_model_folder, resolve_model_path
from tephra.controller.step.rounds import Prompts
from tephra.controller.workers.rl_worker import RLWorker, colocated_roles
from tephra.controller.workers.rollout_replicas import RolloutReplicas
from tephra.core.config import to_dict
from tephra.core.errors import ConfigError
from tephra.engine_api.multimodal import is_vision_config, supported_model_types
from tephra.episodes.agent import ChatTemplateDelta
from tephra.episodes.environments.remote import served_environment
from tephra.episodes.prompt import Prompt
from tephra.episodes.tools import load_tools
from tephra.rollout.multimodal import VisionProcessor

BUNDLED_TOOLS = Path(__file__).parents[1] / "tools"


def load_records(cfg: PPOConfig) -> tuple[list[Prompt], list[Prompt]]:
    """Training and held-out records of `cfg.data` (rows naming an `agent_name` need
    `rollout.agent_loop`: the batched path runs no episode)."""
    train, val = _load_records(cfg)
    named = next((r.agent_name for r in (*train, *val) if r.agent_name), None)
    if named and not cfg.rollout.uses_agent_loop:
        raise ConfigError(
            f"the data's rows name agent_name={named!r} but rollout.agent_loop is unset, so "
            "no episode would run them; set rollout.agent_loop (the episode of rows without "
            "an agent_name, e.g. single_turn)"
        )
    for recipe in enabled_recipes(cfg):  # e.g. SPIN's chosen responses
        recipe.check_data(cfg, train, "the training data")
    return train, val


def _load_records(cfg: PPOConfig) -> tuple[list[Prompt], list[Prompt]]:
    d = cfg.data
    if d.source == "reasoning_gym":
        return (
            reasoning_gym_records(d.task, d.train_size, d.train_seed, d.task_config, d.instruction),
            reasoning_gym_records(d.task, d.val_size, d.val_seed, d.task_config, d.instruction),
        )

    if d.source == "code_problems":
        return code_problem_records("train", d.train_size), code_problem_records("val", d.val_size)
    if d.source == "swe_tasks":
        return (
            swe_task_records("train", d.train_size, d.swe_tasks),
            swe_task_records("val", d.val_size),
        )
    if not d.train_files:
        raise ConfigError(f"data.source={d.source!r} needs data.train_files to train on")

    def load(spec: str) -> list[Prompt]:
        if d.source == "parquet":
            return load_parquet(spec)
        name, _, split = spec.partition(":")
        return load_hf_dataset(name, split or "train")

    return ([r for f in d.train_files for r in load(f)], [r for f in d.val_files for r in load(f)])


def load_image_prompts(cfg: PPOConfig, model_path: str) -> tuple[Prompts, Prompts, int]:
    """Training and held-out prompts with images (`cfg.data.has_images`), processed with the
    model's image processor; prompts longer than data.max_prompt_tokens (image tokens
    included) are dropped. Returns (train, val, number dropped)."""
    d = cfg.data
    if not is_vision_config(AutoConfig.from_pretrained(model_path)):
        raise ConfigError(
            f"data has images but model.path={cfg.model.path!r} is a text-only "
            "model (its config has no vision_config); use a vision-language "
            f"model of a supported family ({supported_model_types()}; model.path=tiny_vlm "
            "or tiny_llava to test)"
        )
    processor = VisionProcessor.from_pretrained(model_path, d.max_frames)
    if d.source == "colour_squares":
        train = [
            multimodal_prompt_from_row(r, i, "colour_squares", processor)
            for i, r in enumerate(colour_square_rows(d.train_size, d.train_seed))
        ]
        val = [
            multimodal_prompt_from_row(r, i, "colour_squares", processor)
            for i, r in enumerate(colour_square_rows(d.val_size, d.val_seed))
        ]
    else:
        if not d.train_files:
            raise ConfigError("data.images=true needs data.train_files to train on")
        train = [p for f in d.train_files for p in load_multimodal_parquet(f, processor)]
        val = [p for f in d.val_files for p in load_multimodal_parquet(f, processor)]
        videos = sum(1 for p in train + val if p.multimodal and p.multimodal.num_videos)
        if videos and cfg.rollout.backend != "hf":
            # refused here, before Ray starts: the vllm backend takes images, not videos
            raise ConfigError(
                f"{videos} prompts of data.train_files/val_files carry videos; "
                f"rollout.backend={cfg.rollout.backend!r} takes images only: set "
                "rollout.backend=hf for prompts with videos"
            )
    limit, dropped = d.max_prompt_tokens, 0

    def fit(prompts: list) -> Prompts:
        nonlocal dropped
        kept = [p for p in prompts if len(p.prompt_ids) <= limit]
        dropped += len(prompts) - len(kept)
        return Prompts(
            [cast(list[int], p.prompt_ids) for p in kept], kept, [p.multimodal for p in kept]
        )

    return fit(train), fit(val), dropped


def resolve_tools_file(spec: str) -> str:
    """`rollout.tools_file`: a YAML path, or the name of a file bundled in
    tephra/controller/tools/ (`python`: the sandboxed interpreter)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return str(path.resolve())
    bundled = BUNDLED_TOOLS / f"{spec}.yaml"
    if not path.suffix and bundled.is_file():
        return str(bundled)
    known = sorted(p.stem for p in BUNDLED_TOOLS.glob("*.yaml"))
    raise ConfigError(
        f"rollout.tools_file={spec!r}: no such file; give a tools YAML path or one "
        f"of the bundled names {known}"
    )


@dataclass
class Prepared:
    """What the driver resolved before starting Ray."""

    model_path: str
    tokenizer: Any
    train: Prompts
    val: Prompts
    tools_file: str | None
    run_dir: Path


def prepare(cfg: PPOConfig) -> Prepared:
    """Check the config's sections together (`validate`; a `PPOConfig` built without the
    app's `parse_config` is checked here too), resolve the model, tools and data; tokenise the
    prompts; probe the running servers it names. Fails before Ray starts."""
    validate(cfg)
    check_server_urls(cfg)  # here, not at config load: `--print-config` needs no server
    model_path = resolve_model_path(cfg.policy_path, cfg.trainer.seed)
    if named_model_folder(cfg.policy_path) is not None:
        check_engine_support(cfg, model_path)  # built just now: its shape was not known yet
    tokenizer = load_tokenizer(model_path)
    for recipe in enabled_recipes(cfg):  # e.g. the distillation teacher's tokenizer
        recipe.check_models(cfg, tokenizer)
    r = cfg.rollout
    tools_file = resolve_tools_file(r.tools_file) if r.uses_agent_loop and r.tools_file else None
    render = None
    if r.uses_agent_loop:
        # the prompt as the loop renders it (with the tools' schemas), so that
        # data.max_prompt_tokens bounds the real prompt

        schemas = None
        if tools_file and r.agent.render_tool_schemas:
            schemas = [t.schema() for t in load_tools(tools_file).values()] or None
        render = ChatTemplateDelta(tokenizer, schemas).prompt_ids
    limit = cfg.data.max_prompt_tokens
    if cfg.data.has_images:
        train, val, dropped = load_image_prompts(cfg, model_path)
    else:
        train_rec, val_rec = load_records(cfg)
        train_ids, train_rec, dropped = tokenize_prompts(train_rec, tokenizer, limit, render)
        train, val = Prompts(train_ids, train_rec), Prompts([], [])
        if val_rec:
            val_ids, val_rec, val_dropped = tokenize_prompts(val_rec, tokenizer, limit, render)
            val = Prompts(val_ids, val_rec)
            dropped += val_dropped
    if dropped:
        print(f"dropped {dropped} prompts longer than data.max_prompt_tokens={limit}", flush=True)
    if not train.ids:
        raise ConfigError(
            f"no training prompt is left after dropping those longer than "
            f"data.max_prompt_tokens={limit}; raise it or check data.train_files"
        )
    t = cfg.trainer
    if (t.val_before or t.val_after or t.val_every) and not val.ids:
        raise ConfigError(
            "validation is on but the held-out set is empty; set data.val_files "
            "(or data.val_size) or turn off trainer.val_before/val_after/val_every"
        )
    run_dir = Path(t.run_dir).expanduser().resolve()
    return Prepared(model_path, tokenizer, train, val, tools_file, run_dir)


def check_resumed_data(cfg: PPOConfig, p: Prepared) -> None:
    """Refuse, before Ray starts, to resume a checkpoint over other training prompts than it
    was saved on (unless `trainer.accept_changed_data`)."""
    t = cfg.trainer
    latest = CheckpointManager(p.run_dir / "checkpoints").resolve(t.resume, t.resume_from)
    if latest is None or t.accept_changed_data:
        return
    saved = CheckpointManager(p.run_dir / "checkpoints").load_trainer_state(latest)["loader"]
    check_same_data(saved, dataset_fingerprint(p.train.ids), len(p.train.ids), str(latest))


def config_to_save(cfg: Any) -> dict:
    """An app's config as written to its run folder or printed by `--print-config`: a server's
    explicit key is a secret and is redacted (`auto` and none are kept)."""
    saved = to_dict(cfg)
    for server in ("vllm", "sglang"):
        if "rollout" in saved and saved["rollout"][server]["api_key"] not in (None, "auto"):
            saved["rollout"][server]["api_key"] = "<redacted: pass it on the command line>"
    remote = saved.get("rollout", {}).get("agent", {}).get("environment_kwargs", {})
    if remote.get("api_key") is not None:
        remote["api_key"] = "<redacted: pass it on the command line>"
    return saved


def run(cfg: PPOConfig) -> dict:  # noqa: PLR0915 (older than the limit; to split)
    """Train as `cfg` says; returns the summary dict."""
    clock = Timeline()
    torch.set_num_threads(1)  # the driver only moves batches; the workers compute
    check_stage_names(cfg.trainer.watchdog, dispatched_methods(RLWorker) | {"generate_scored"})
    p = prepare(cfg)
    check_resumed_data(cfg, p)
    clock.lap("prepare")  # model folder, tokenizer, data
    p.run_dir.mkdir(parents=True, exist_ok=True)
    (p.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_save(cfg), sort_keys=False))
    cfg = resolve_auto_dtypes(cfg)
    print(
        f"compute dtypes: actor {cfg.actor.precision.param_dtype}, rollout {cfg.rollout.dtype}",
        flush=True,
    )
    print(weight_path(cfg), flush=True)
    clock.lap("dtypes")
    r = cfg.resources
    owns_ray = not ray.is_initialized()
    ray_init(r.ray_address, r.num_cpus, dashboard=r.ray_dashboard)
    clock.lap("ray")
    stop = StopSignal()
    try:
        with stop.installed():
            return train(cfg, p, clock, stop)
    except StopNow:  # a second signal at start-up: the groups were killed on the way out
        return stopped_summary(stop, p.run_dir)
    finally:
        if stop.requested and owns_ray:
            # the process is about to exit on the signal: Ray's own exit hook would run
            # too late to stop its daemons and workers before the caller looks for them
            ray.shutdown()


def stopped_summary(stop: StopSignal, run_dir: Path) -> dict:
    """The summary of a run a second signal stopped before its loop began (at start-up),
    written to `run_dir/summary.json`."""
    summary = {
        **stop.summary(0, None),
        "run_dir": str(run_dir),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def train(cfg: PPOConfig, p: Prepared, clock: Timeline, stop: StopSignal) -> dict:
    """The run's servers (the environment server of a `remote` environment without a URL,
    the judge server, when it needs them), the worker groups built on the Ray session and
    the loop run; they are torn down however it ends."""
    with served_environment(
        cfg.rollout.agent,
        p.tools_file,
        p.run_dir / "environment_server.log",
        ray.util.get_node_ip_address(),
    ) as (agent, environment_server):
        services: list[RunService] = [environment_server] if environment_server else []
        if agent is not cfg.rollout.agent:
            cfg = replace(cfg, rollout=replace(cfg.rollout, agent=agent))
            clock.lap("environment_server")
        if not needs_judge_server(cfg):
            return train_groups(cfg, p, clock, stop, services)
        judge = JudgeServer(cfg)
        print(f"judge server: {judge.url} (one for the run)", flush=True)
        clock.lap("judge_server")
        try:
            return train_groups(judge.cfg, p, clock, stop, services)
        finally:
            judge.close()


def train_groups(  # noqa: PLR0915 (one builder per group; they share the closures' state)
    cfg: PPOConfig,
    p: Prepared,
    clock: Timeline,
    stop: StopSignal,
    services: list[RunService] | None = None,
) -> dict:
    """The worker groups built on the Ray session and the loop run; they are torn down
    however it ends. `services`: the run's servers the loop waits for and reports (the
    environment server it keeps up)."""
    r = cfg.resources
    # one watchdog for every group: deadlines per (group, stage), the step set by the Trainer
    watchdog = Watchdog(cfg.trainer.watchdog)
    pool = ResourcePool(
        r.world_size,
        r.cpus_per_rank,
        r.gpus_per_rank,
        strategy=r.placement,
        retain_freed_memory=r.retain_freed_memory,
        memory_per_rank_gb=r.memory_per_rank_gb,
    )

    # the reference, critic and model-based rewards on pools of their own
    # (resources.ref / critic / reward .ranks > 0)
    role_pools = {
        role: ResourcePool(
            s.ranks,
            s.cpus_per_rank,
            s.gpus_per_rank,
            strategy=r.placement,
            name=role,
            retain_freed_memory=r.retain_freed_memory,
        )
        for role in ("ref", "critic", "reward")
        if (s := getattr(r, role)).ranks
    }
    reward_actors: list = []
    """The reward pool's ranks (`resources.reward`) that score the generated samples; set by
    `make_role_groups`, which runs before the groups that generate (and again on recovery)."""

    def make_group() -> WorkerGroup:
        return WorkerGroup(
            RLWorker,
            pool,
            {
                "cfg": cfg,
                "model_path": p.model_path,
                "tools_file": p.tools_file,
                "roles": colocated_roles(cfg),
                "reward_actors": list(reward_actors) or None,
            },
            name="rl",
            watchdog=watchdog,
        )

    def make_role_groups() -> dict[str, WorkerGroup]:
        groups: dict[str, WorkerGroup] = {}
        try:
            for role, role_pool in role_pools.items():
                groups[role] = WorkerGroup(
                    RLWorker,
                    role_pool,
                    {"cfg": cfg, "model_path": p.model_path, "roles": (role,)},
                    name=role,
                    watchdog=watchdog,
                )
        except BaseException:
            for group in groups.values():
                group.shutdown(grace_s=0)
            raise
        reward_actors[:] = groups["reward"].workers if "reward" in groups else []
        return groups

    def make_replicas() -> RolloutReplicas:
        return RolloutReplicas(
            cfg, p.model_path, p.tools_file, watchdog, reward_actors=list(reward_actors) or None
        )

    try:
        # the role groups first: the groups that generate send their samples to the reward
        # pool's ranks
        role_groups = make_role_groups() if role_pools else {}
        trainer = Trainer(
            cfg,
            make_group(),
            p.tokenizer,
            p.train,
            p.val,
            p.run_dir,
            model_shape(p.model_path),
            0.0,
            make_group=make_group,
            make_replicas=make_replicas if r.rollout.replicas else None,
            make_role_groups=make_role_groups if role_pools else None,
            role_groups=role_groups,
            stop=stop,
            services=services,
        )
    except BaseException:
        for each in (pool, *role_pools.values()):
            each.release()
        raise
    clock.lap("workers")  # Ray actors started, engines and rollout built, weights loaded
    summary: dict | None = None
    try:
        trainer.peak_flops = trainer.measure_peak_flops()
        clock.lap("peak_flops")
        nodes = len(set(trainer.wg.node_ids()))
        trainer.startup = clock.summary()
        # inside `workers`: the slowest rank's own phases (its process start and imports,
        # then its engines and rollout), not added to the total
        rank = trainer.wg.startup_phases()
        trainer.startup.update({f"worker_{k}": v for k, v in rank.items()})
        phases = ", ".join(f"{name} {sec:.1f}" for name, sec in clock.phases.items())
        worker = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in rank.items())
        print(
            f"start-up {trainer.startup['total_s']:.1f} s: {phases} (the slowest worker: {worker})",
            flush=True,
        )
        summary = trainer.fit()
        summary["nodes"] = nodes
    finally:
        try:
            # after a second signal the ranks may be mid-stage: killed, not asked to close
            trainer.close_group(at_once=stop.immediate)
        except StopNow:  # a second signal while the groups close: killed instead
            trainer.close_group(at_once=True)
            if summary is None:  # not from the loop's end: the caller reports the stop
                raise
            summary["immediate"] = True  # the loop's summary stands, its close cut short
            (p.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        finally:
            for each in (pool, *role_pools.values()):
                each.release()
    return summary
