"""Full, Hugging Face-named weights out of a sharded model: buckets for the rollout engine,
a transformers folder on disk, and a LoRA adapter alone as a peft folder.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from tephra.engine_api.adapters import PEFT_PREFIX
from tephra.engine_api.config import LoraConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp import lora

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    # a vision-language model's image processor: without it the export cannot read images
    "preprocessor_config.json",
    "processor_config.json",
)


def _full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Gather a sharded parameter (collective) into a full tensor on `device`."""
    t = t.detach()
    if isinstance(t, DTensor):
        if t.device != device:  # offloaded shards: gather on the mesh's device
            moved = t.to(device)
            assert isinstance(moved, DTensor)  # `to` keeps a DTensor a DTensor
            t = moved
        return t.full_tensor()
    return t.to(device)


def _tied(model: PreTrainedModel) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def iter_full_weights(
    model: PreTrainedModel, device: torch.device, untie_word_embeddings: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, full tensor)` for every parameter and persistent buffer, in module order,
    with LoRA merged: W + (alpha / rank) * B @ A, computed in float32.

    Every rank must consume the whole iterator (each tensor is gathered collectively).
    """
    params = dict(model.named_parameters())
    for name, param in params.items():
        if lora.is_adapter_param(name):
            continue
        full = _full(param, device)
        pair = lora.adapter_names(name)
        if pair is not None:
            a, b = (_full(params[n], device).float() for n in pair)
            full = (full.float() + lora.lora_scaling(model, name) * (b @ a)).to(full.dtype)
        name = lora.base_name(name)
        yield name, full
        if untie_word_embeddings and _tied(model) and param is model.get_input_embeddings().weight:
            yield "lm_head.weight", full.clone()
    for mod_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name in module._non_persistent_buffers_set:
                continue
            yield (
                lora.base_name(f"{mod_name}.{buf_name}" if mod_name else buf_name),
                _full(buf, device),
            )


def buckets(
    items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` into lists of about `bucket_bytes` (a tensor larger than the
    budget is a bucket on its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def write_hf_folder(
    path: Path, model: PreTrainedModel, device: torch.device, tokenizer_dir: str | None
) -> None:
    """Write `config.json`, `model.safetensors` (and the tokenizer and image processor files)
    that transformers loads into the same architecture. Collective: every rank gathers, rank 0 writes."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {}
    for name, t in iter_full_weights(model, device, untie_word_embeddings=False):
        if rank == 0:
            state[name] = t.cpu().contiguous()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]
        config.use_cache = True  # the engine turns the KV cache off for training only
        config.save_pretrained(path)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(path)
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / fname
                if src.is_file():
                    shutil.copy2(src, path / fname)
    if dist.is_initialized():
        dist.barrier()


def adapter_tensors(model: PreTrainedModel, device: torch.device) -> dict[str, torch.Tensor]:
    """The full LoRA matrices, float32 on the CPU, named as peft saves them
    (`base_model.model.<module>.lora_A.weight`: peft drops the adapter name). Collective:
    every rank gathers and receives every matrix."""
    state = {}
    for name, param in model.named_parameters():
        if lora.is_adapter_param(name):
            full = _full(param, device).float().cpu().contiguous()
            state[PEFT_PREFIX + name.replace(f".{lora.ADAPTER}.", ".")] = full
    return state


def load_adapter_tensors(
    model: PreTrainedModel, tensors: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Copy full LoRA matrices, named as `adapter_tensors` names them, into the (sharded)
    adapter parameters; a `ConfigError` names a missing, unexpected or misshapen matrix
    before anything is written. Every rank passes the whole set and keeps its own shard."""
    params = {
        PEFT_PREFIX + name.replace(f".{lora.ADAPTER}.", "."): param
        for name, param in model.named_parameters()
        if lora.is_adapter_param(name)
    }
    missing, extra = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
    if missing or extra:
        raise ConfigError(
            f"load_adapter_weights(): the adapter lacks {len(missing)} of this engine's LoRA "
            f"matrices {missing[:2]} and has {len(extra)} it does not have {extra[:2]}; pass "
            "an adapter from an engine of the same model and lora.target_modules"
        )
    for name, param in params.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ConfigError(
                f"load_adapter_weights(): {name} has shape {tuple(tensors[name].shape)}, this "
                f"engine's {tuple(param.shape)}; pass an adapter of the same model and lora.rank"
            )
    with torch.no_grad():
        for name, param in params.items():
            full = tensors[name].to(dtype=param.dtype)
            if isinstance(param, DTensor):
                mesh_device = torch.device(param.device_mesh.device_type)
                shard = distribute_tensor(full.to(mesh_device), param.device_mesh, param.placements)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)


def _peft_targets(model: PreTrainedModel, adapted: set[str]) -> list[str]:
    """peft's `target_modules` for the modules named in `adapted`: a module's last name part
    (`q_proj`) where every module of that last name is adapted, its full name otherwise. peft
    adapts each module whose name ends in a target, so a vision-language model's `0` (the
    merger's `mlp.0`, also `layers.0`) or a language model's `q_proj` beside a frozen CLIP
    tower's `q_proj` would adapt other modules on load, or fail there."""
    leaves: dict[str, set[str]] = {}
    for name, _ in model.named_modules():
        if ".lora_" not in name and not name.endswith(".base_layer"):
            leaves.setdefault(name.rsplit(".", 1)[-1], set()).add(name)
    targets = set()
    for name in adapted:
        leaf = name.rsplit(".", 1)[-1]
        targets.add(leaf if leaves.get(leaf, set()) <= adapted else name)
    return sorted(targets)


def write_adapter_folder(
    path: Path, model: PreTrainedModel, device: torch.device, cfg: LoraConfig, base_path: str | None
) -> None:
    """Write the LoRA matrices in peft's file layout (`adapter_model.safetensors`, keys as
    `adapter_tensors` names them) and its `adapter_config.json`. Collective: every rank gathers, rank 0 writes."""
    # imported here: peft takes seconds to import and only LoRA runs need it
    from peft import LoraConfig as PeftLoraConfig

    rank = dist.get_rank() if dist.is_initialized() else 0
    state = adapter_tensors(model, device)
    targets = _peft_targets(model, {name[len(PEFT_PREFIX) :].split(".lora_")[0] for name in state})
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        # the modules that hold adapters, by name ("all-linear" would be re-resolved on load)
        PeftLoraConfig(
            r=cfg.rank,
            # peft annotates lora_alpha `int` but divides it (scaling = lora_alpha / r)
            lora_alpha=cfg.alpha,  # type: ignore[arg-type]
            lora_dropout=cfg.dropout,
            target_modules=sorted(targets),
            base_model_name_or_path=base_path,
            task_type="CAUSAL_LM",
        ).save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()
