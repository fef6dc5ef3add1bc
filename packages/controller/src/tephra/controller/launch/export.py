"""Turn any saved checkpoint of a run into a Hugging Face folder, after the fact.

    uv run python -m tephra.controller.launch.export runs/ppo/checkpoints/step_20 out/hf [--role critic]
    (roles: actor, critic, prime_rm)
    uv run python -m tephra.controller.launch.export runs/ppo/checkpoints/step_20 out/lora --adapter

The checkpoint's run folder holds the run's `config.yaml`; the engine named there is built on
as many local CPU processes (gloo) as the run had ranks, in the same parallel layout (FSDP
DCP or Megatron, any layout), loads the checkpoint and writes `export_hf` (LoRA merged into
the base weights). The folder loads in transformers and vLLM.

`--adapter` (an actor trained with `actor.lora.rank > 0`, on an engine that declares
`Capability.LORA`) writes the LoRA adapter alone through `Engine.export_adapter`, as peft
saves it (`adapter_config.json`, `adapter_model.safetensors`):
`peft.PeftModel.from_pretrained(base, folder)` over the run's base model gives the merged
export's outputs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from tephra.controller.config.tree import PPOConfig
from tephra.controller.run.checkpoints import check_manifest
from tephra.controller.run.models import resolve_model_path
from tephra.core.config import from_dict
from tephra.core.errors import CheckpointError, TephraError
from tephra.engine_api.capabilities import Capability
from tephra.engine_api.registry import get_engine, get_engine_class
from tephra.engine_api.testing.distributed import run_distributed

ROLES = ("actor", "critic", "prime_rm")
"""The engines a checkpoint may hold (`prime_rm`: PRIME's implicit reward model)."""


def _export_rank(
    cfg: PPOConfig, model_path: str, role: str, checkpoint: str, out: str, adapter: bool = False
) -> str:
    """One rank: build the role's engine as the run did, load the checkpoint, export."""
    torch.set_num_threads(1)
    # PRIME's reward model is built as the actor is (a policy initialised from it)
    section = cfg.critic if role == "critic" else cfg.actor
    model = replace(cfg.model, path=model_path, init_seed=cfg.trainer.seed)
    engine = get_engine(
        section.engine,
        section.engine_config(
            model, "value" if role == "critic" else "policy", 1.0, cfg.trainer.seed, device="cpu"
        ),
    )
    engine.load_checkpoint(Path(checkpoint) / role)
    with engine.eval_mode():
        if adapter:
            engine.export_adapter(out)
        else:
            engine.export_hf(out)
    return out


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, role: str = "actor", adapter: bool = False
) -> Path:
    """Write the `role` engine of `checkpoint` (a `step_<N>` folder) as a HF folder `out`,
    or with `adapter` the actor's LoRA adapter as a peft folder."""
    checkpoint = Path(checkpoint).expanduser().resolve()
    problem = check_manifest(checkpoint) if checkpoint.is_dir() else "no such folder"
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {checkpoint}: {problem}; give a step_<N> folder under a run's checkpoints/"
        )
    if not (checkpoint / role).is_dir():
        raise CheckpointError(
            f"checkpoint {checkpoint} holds no {role!r} state "
            f"(it has: {sorted(p.name for p in checkpoint.iterdir() if p.is_dir())})"
        )
    config_file = checkpoint.parent.parent / "config.yaml"
    if not config_file.exists():
        raise CheckpointError(
            f"{config_file} is missing: the run's config says how the engine "
            "was built (model, backend, parallel layout)"
        )
    cfg = from_dict(PPOConfig, yaml.safe_load(config_file.read_text()))
    if adapter and (
        role != "actor"
        or not cfg.actor.lora.enabled
        or Capability.LORA not in get_engine_class(cfg.actor.engine).capabilities
    ):
        raise CheckpointError(
            f"--adapter writes the LoRA adapter of an actor trained with actor.lora.rank > 0 "
            f"on an engine with LoRA support (e.g. engine=fsdp); asked for role {role!r} of a "
            f"run with actor.engine={cfg.actor.engine!r}, actor.lora.rank="
            f"{cfg.actor.lora.rank}. Export without --adapter for the full (merged) model"
        )
    model_path = resolve_model_path(cfg.policy_path, cfg.trainer.seed)
    out = Path(out).expanduser().resolve()
    run_distributed(
        _export_rank,
        cfg.resources.world_size,
        args=(cfg, model_path, role, str(checkpoint), str(out), adapter),
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tephra.controller.launch.export", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkpoint", help="a step_<N> folder under a run's checkpoints/")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--role", default="actor", choices=list(ROLES))
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="write only the LoRA adapter (peft folder) of a LoRA-trained actor",
    )
    args = parser.parse_args(argv)
    try:
        print(export_checkpoint(args.checkpoint, args.out, args.role, args.adapter))
    except TephraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
