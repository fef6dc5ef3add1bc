"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout under `path`:
    *.distcp, .metadata   model and optimizer state, sharded (DCP; reshardable)
    tephra_meta.json      what model it belongs to (parameter names, shapes, trainable),
                          step and scheduler state (rank 0 writes)
    rng/rank{r}.pt        each rank's RNG states (CPU, CUDA) for a bitwise resume
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tephra.engine_api.errors import CheckpointError

META = "tephra_meta.json"


def fingerprint(model: nn.Module) -> dict[str, list]:
    """Parameter name -> [global shape, trainable]: what a checkpoint must match."""
    return {n: [list(p.shape), bool(p.requires_grad)] for n, p in model.named_parameters()}


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    device: torch.device,
) -> None:
    rank = dist.get_rank()
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:
        _restart_step_counts(optimizer, optim_sd)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
    (path / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(device), path / "rng" / f"rank{rank}.pt")
    if rank == 0:
        meta = {
            "params": fingerprint(model),
            "step": step,
            "scheduler": scheduler.state_dict(),
            "world_size": dist.get_world_size(),
        }
        (path / META).write_text(json.dumps(meta, indent=1))
    dist.barrier()


def _restart_step_counts(optimizer: torch.optim.Optimizer, optim_sd: dict) -> None:
    """Undo the step count of the state DCP's `get_state_dict` makes for an optimizer that
    has not stepped (it runs one step with zero gradients and lr 0 to create the state): the
    moments stay 0, but a step count of 1 changed Adam's bias correction of the first real
    step, so training from a checkpoint saved before any step differed from training on."""
    states = [*optimizer.state.values(), *optim_sd.get("state", {}).values()]
    for state in states:
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def _check_same_model(path: Path, model: nn.Module) -> dict:
    meta_file = path / META
    if not meta_file.is_file():
        what = "does not exist" if not path.exists() else f"has no {META}"
        raise CheckpointError(
            f"checkpoint {str(path)!r} {what}; pass a folder written by save_checkpoint"
        )
    meta = json.loads(meta_file.read_text())
    saved, ours = meta["params"], fingerprint(model)
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    changed = sorted(n for n in set(ours) & set(saved) if saved[n] != ours[n])
    if missing or extra or changed:
        detail = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {extra[:3]}"
            if extra
            else f"{changed[0]}: saved [shape, trainable] {saved[changed[0]]}, "
            f"this model {ours[changed[0]]}"
        )
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written for another model ({detail}; "
            f"{len(missing)} missing, {len(extra)} unexpected, {len(changed)} different "
            "parameters); load it into an engine built from the same model and LoRA config"
        )
    return meta


def load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
) -> int:
    """Restore everything `save` wrote; returns the step count."""
    meta = _check_same_model(path, model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        # DCP loads in place: into the tensors (and values) of model_sd and optim_sd
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except Exception as exc:  # DCP raises many types; the path is what people need
        raise CheckpointError(f"checkpoint {str(path)!r} could not be loaded: {exc}") from exc
    scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    dist.barrier()
    return int(meta["step"])
