"""Turn any saved checkpoint of a run into a Hugging Face folder, after the fact.

    uv run python -m tephra.controller.export runs/ppo/checkpoints/step_20 out/hf [--role critic]
    uv run python -m tephra.controller.export runs/ppo/checkpoints/step_20 out/lora --adapter

The checkpoint's run folder holds the run's `config.yaml`; the engine named there is built on
as many local CPU processes (gloo) as the run had ranks, in the same parallel layout (FSDP
DCP or Megatron, any layout), loads the checkpoint and writes `export_hf` (LoRA merged into
the base weights). The folder loads in transformers and vLLM.

`--adapter` (an actor trained with `actor.lora.rank > 0`) writes the LoRA adapter alone, as
peft saves it (`adapter_config.json`, `adapter_model.safetensors`):
`peft.PeftModel.from_pretrained(base, folder)` over the run's base model gives the merged
export's outputs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from tephra.controller.checkpoints import check_manifest
from tephra.core.config import from_dict
from tephra.core.errors import CheckpointError, TephraError


def _export_rank(
    cfg, model_path: str, role: str, checkpoint: str, out: str, adapter: bool = False
) -> str:
    """One rank: build the role's engine as the run did, load the checkpoint, export."""
    import torch

    from tephra.engine_api.registry import get_engine

    torch.set_num_threads(1)
    section = cfg.actor if role == "actor" else cfg.critic
    model = replace(cfg.model, path=model_path, init_seed=cfg.trainer.seed)
    engine = get_engine(
        section.engine,
        section.engine_config(
            model, "policy" if role == "actor" else "value", 1.0, cfg.trainer.seed, device="cpu"
        ),
    )
    engine.load_checkpoint(Path(checkpoint) / role)
    with engine.eval_mode():
        if adapter:
            _write_adapter(engine, section.lora, model_path, Path(out))
        else:
            engine.export_hf(out)
    return out


def _write_adapter(engine, lora_cfg, base_path: str, out: Path) -> None:
    """The LoRA matrices in peft's file layout (collective: every rank gathers, rank 0
    writes). Keys: `base_model.model.<module>.lora_A.weight` (peft drops the adapter name)."""
    import torch.distributed as dist
    from peft import LoraConfig
    from safetensors.torch import save_file

    from tephra.engine_fsdp import lora
    from tephra.engine_fsdp.weights import _full

    state, targets = {}, set()
    for name, param in engine.hf_model.named_parameters():
        if lora.is_adapter_param(name):
            full = _full(param, engine.device).float().cpu().contiguous()
            state["base_model.model." + name.replace(f".{lora.ADAPTER}.", ".")] = full
            targets.add(name.split(".lora_")[0].rsplit(".", 1)[-1])
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        # the modules that hold adapters, by name ("all-linear" would be re-resolved on load)
        LoraConfig(
            r=lora_cfg.rank,
            lora_alpha=lora_cfg.alpha,
            lora_dropout=lora_cfg.dropout,
            target_modules=sorted(targets),
            base_model_name_or_path=base_path,
            task_type="CAUSAL_LM",
        ).save_pretrained(str(out))
    dist.barrier()


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, role: str = "actor", adapter: bool = False
) -> Path:
    """Write the `role` engine of `checkpoint` (a `step_<N>` folder) as a HF folder `out`,
    or with `adapter` the actor's LoRA adapter as a peft folder."""
    from tephra.controller.models import resolve_model_path
    from tephra.controller.rl_config import PPOConfig
    from tephra.engine_api.testing.distributed import run_distributed

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
    if adapter and (role != "actor" or not cfg.actor.lora.enabled or cfg.actor.engine != "fsdp"):
        raise CheckpointError(
            f"--adapter writes the LoRA adapter of an actor trained with engine=fsdp and "
            f"actor.lora.rank > 0; asked for role {role!r} of a run with actor.engine="
            f"{cfg.actor.engine!r}, actor.lora.rank={cfg.actor.lora.rank}. Export without "
            "--adapter for the full (merged) model"
        )
    model_path = resolve_model_path(cfg.model.path, cfg.trainer.seed)
    out = Path(out).expanduser().resolve()
    run_distributed(
        _export_rank,
        cfg.resources.world_size,
        args=(cfg, model_path, role, str(checkpoint), str(out), adapter),
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tephra.controller.export", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkpoint", help="a step_<N> folder under a run's checkpoints/")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--role", default="actor", choices=["actor", "critic"])
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
