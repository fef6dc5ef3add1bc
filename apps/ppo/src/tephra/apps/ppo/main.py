"""`uv run apps/ppo [--preset NAME] [key=value ...]`: assemble the parts and train.

With no arguments: GRPO on SmolLM2-135M-Instruct (bundled) on reasoning-gym basic_arithmetic,
on CPU, with greedy held-out accuracy before and after; the last line printed is a JSON
summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tephra.apps.ppo.config import PPOConfig
from tephra.core.config import load_config, split_cli
from tephra.controller.data import (
    PromptRecord,
    load_hf_dataset,
    load_parquet,
    reasoning_gym_records,
    tokenize_prompts,
)
from tephra.engine_api.errors import ConfigError, TephraError

PRESETS = Path(__file__).parent / "presets"
TOOLS = Path(__file__).parent / "tools"


def parse_config(argv: list[str]) -> PPOConfig:
    presets, overrides = split_cli(argv)
    return load_config(PPOConfig, presets, overrides, preset_dir=PRESETS)


def load_records(cfg: PPOConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    d = cfg.data
    if d.source == "reasoning_gym":
        if d.train_seed == d.val_seed:
            raise ConfigError("data.train_seed and data.val_seed must differ, or the held-out "
                              "items are training items")
        return (reasoning_gym_records(d.task, d.train_size, d.train_seed, d.task_config, d.instruction),
                reasoning_gym_records(d.task, d.val_size, d.val_seed, d.task_config, d.instruction))
    if d.source in ("parquet", "hf"):
        if not d.train_files:
            raise ConfigError(f"data.source={d.source!r} needs data.train_files")

        def load(spec: str) -> list[PromptRecord]:
            if d.source == "parquet":
                return load_parquet(spec)
            name, _, split = spec.partition(":")
            return load_hf_dataset(name, split or "train")

        train = [r for f in d.train_files for r in load(f)]
        val = [r for f in d.val_files for r in load(f)]
        return train, val
    raise ConfigError(f"data.source={d.source!r}: choose reasoning_gym, parquet or hf")


def resolve_tools_file(spec: str) -> str:
    """`rollout.tools_file`: a YAML path, or the name of a file bundled in tephra/apps/ppo/tools/."""
    path = Path(spec).expanduser()
    if path.is_file():
        return str(path.resolve())
    bundled = TOOLS / f"{spec}.yaml"
    if not path.suffix and bundled.is_file():
        return str(bundled)
    known = sorted(p.stem for p in TOOLS.glob("*.yaml"))
    raise ConfigError(f"rollout.tools_file={spec!r}: no such file; give a tools YAML path or one "
                      f"of the bundled names {known}")


def tool_schemas(cfg: PPOConfig) -> list[dict] | None:
    """OpenAI function schemas of the configured tools, as the chat template receives them
    (None when there are no tools or `rollout.render_tool_schemas` is off)."""
    r = cfg.rollout
    if not r.tools_file or not r.render_tool_schemas:
        return None
    from tephra.rollout.tools import load_tools

    # Built here only for their schemas (and to report a bad file before any worker starts).
    return [t.schema() for t in load_tools(resolve_tools_file(r.tools_file)).values()] or None


def engine_configs(cfg: PPOConfig, model_path: str):
    from tephra.engine_api.config import (
        EngineConfig,
        LoraConfig,
        MicroBatchConfig,
        ModelConfig,
        OptimizerConfig,
        PrecisionConfig,
        SchedulerConfig,
    )

    def make(role: str, lr: float) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(path=model_path, role=role,
                              gradient_checkpointing=cfg.model.gradient_checkpointing,
                              init_seed=cfg.trainer.seed),
            optimizer=OptimizerConfig(lr=lr, weight_decay=cfg.actor.weight_decay,
                                      grad_clip=cfg.actor.grad_clip),
            scheduler=SchedulerConfig(warmup_steps=cfg.actor.warmup_steps),
            micro_batch=MicroBatchConfig(max_tokens_per_microbatch=cfg.batch.max_tokens_per_microbatch,
                                         use_packing=cfg.actor.use_packing),
            precision=PrecisionConfig(param_dtype=cfg.model.dtype),
            lora=LoraConfig(rank=cfg.model.lora_rank if role == "policy" else 0,
                            alpha=cfg.model.lora_alpha),
            temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
            compute_entropy=True, seed=cfg.trainer.seed, device="auto")

    actor = make("policy", cfg.actor.lr)
    critic = make("value", cfg.critic.lr) if cfg.algorithm.adv_estimator == "gae" else None
    return actor, critic


def build_spec(cfg: PPOConfig, model_path: str):
    from tephra.algos import ActorObjectiveConfig, CriticObjectiveConfig, PolicyLossConfig
    from tephra.controller.rl_worker import RLWorkerSpec
    from tephra.rollout.agent import AgentLoopConfig
    from tephra.rollout.base import HFSettings, RolloutConfig

    a, r = cfg.algorithm, cfg.rollout
    actor, critic = engine_configs(cfg, model_path)
    reference = "none"
    if a.kl_coef > 0:
        reference = "lora_base" if cfg.model.lora_rank > 0 else "engine"
    return RLWorkerSpec(
        engine=cfg.actor.engine, actor=actor, critic=critic,
        rollout_backend=cfg.rollout.backend,
        rollout=RolloutConfig(model_path=model_path, dtype=cfg.rollout.dtype,
                              max_model_len=cfg.data.max_prompt_tokens + r.response_budget + 8,
                              seed=cfg.trainer.seed,
                              hf=HFSettings(max_batch_rows=cfg.rollout.max_batch_rows)),
        reference=reference,
        actor_objective=ActorObjectiveConfig(
            policy_loss=a.policy_loss, policy=PolicyLossConfig(clip_ratio=a.clip_ratio,
                                                                 clip_ratio_high=a.clip_ratio_high),
            loss_agg_mode=a.loss_agg_mode, entropy_coeff=a.entropy_coeff,
            use_kl_loss=a.kl_coef > 0, kl_loss_coef=a.kl_coef, kl_loss_type=a.kl_loss_type),
        critic_objective=CriticObjectiveConfig(cliprange_value=cfg.critic.cliprange_value)
        if critic is not None else None,
        mini_batches=cfg.batch.mini_batches, epochs=cfg.batch.epochs, seed=cfg.trainer.seed,
        agent_loop=r.agent_loop or None,
        agent_config=AgentLoopConfig(
            max_turns=r.max_turns, max_response_tokens=r.max_response_tokens,
            max_tool_response_chars=r.max_tool_response_chars,
            render_tool_schemas=r.render_tool_schemas) if r.uses_agent_loop else None,
        tools_file=resolve_tools_file(r.tools_file) if r.uses_agent_loop and r.tools_file else None,
        agent_max_in_flight=r.max_in_flight)


def run(cfg: PPOConfig) -> dict:
    """Train as `cfg` says; returns the summary dict."""
    import torch
    from transformers import AutoTokenizer

    from tephra.apps.ppo.models import count_parameters, resolve_model_path
    from tephra.apps.ppo.trainer import Prompts, Trainer, measure_peak_flops
    from tephra.controller.rl_worker import RLWorker
    from tephra.controller.worker_group import ResourcePool, WorkerGroup, ray_init

    torch.set_num_threads(1)  # the driver only moves batches; the workers compute
    model_path = resolve_model_path(cfg.model.path, cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_rec, val_rec = load_records(cfg)
    render = None
    if cfg.rollout.uses_agent_loop:
        # the prompt as the loop renders it (with the tools' schemas), so that
        # data.max_prompt_tokens bounds the real prompt
        from tephra.rollout.agent import ChatTemplateDelta

        render = ChatTemplateDelta(tokenizer, tool_schemas(cfg)).prompt_ids

    def tokenize(records, tok, limit):
        return tokenize_prompts(records, tok, limit, render)

    train_ids, train_rec, dropped = tokenize(train_rec, tokenizer, cfg.data.max_prompt_tokens)
    val = Prompts([], [])
    if val_rec:
        val_ids, val_rec, val_dropped = tokenize(val_rec, tokenizer, cfg.data.max_prompt_tokens)
        val = Prompts(val_ids, val_rec)
        dropped += val_dropped
    if dropped:
        print(f"dropped {dropped} prompts longer than data.max_prompt_tokens="
              f"{cfg.data.max_prompt_tokens}", flush=True)
    if (cfg.trainer.val_before or cfg.trainer.val_after or cfg.trainer.val_every) and not val.ids:
        raise ConfigError("validation is on but the held-out set is empty; set data.val_files "
                          "(or data.val_size) or turn off trainer.val_before/val_after/val_every")
    run_dir = Path(cfg.trainer.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    import yaml

    from tephra.core.config import to_dict

    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    r = cfg.resources
    ray_init(r.ray_address, r.num_cpus)
    pool = ResourcePool(r.world_size, r.cpus_per_rank, r.gpus_per_rank)
    wg = WorkerGroup(RLWorker, pool, {"spec": build_spec(cfg, model_path)}, name="rl")
    try:
        peak = measure_peak_flops() * max(1.0, r.cpus_per_rank) * r.world_size
        trainer = Trainer(cfg, wg, tokenizer, Prompts(train_ids, train_rec), val, run_dir,
                          count_parameters(model_path), peak)
        return trainer.fit()
    finally:
        try:
            wg.close()
        finally:
            wg.shutdown()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    try:
        cfg = parse_config(argv)
        summary = run(cfg)
    except TephraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
