"""Sharded checkpoints (one file per rank) and Hugging Face export.

Layout of a checkpoint folder:
    meta.json               model shape, parallel sizes and world size (written by rank 0)
    rank_00000.pt ...       each rank's model shards, its slice of the float32 master weights
                            and AdamW moments (the distributed optimizer's), lr schedule, RNG
Resuming needs the same parallel layout (the slices follow the data-parallel size and the
gradient-buffer layout); the state restored is bit-identical, so the next step is too.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import transformers

from tephra.engine_api.errors import CheckpointError
from tephra.engine_megatron import hf_conversion as conv
from tephra.engine_megatron.safetensors_stream import SafetensorsWriter
from tephra.engine_megatron.weight_export import HFStream, ShardedModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tephra.engine_megatron.distributed_optimizer import DistributedAdamW


class CheckpointedModel(ShardedModel, Protocol):
    """What checkpoints read of a `MegatronEngine` (which imports this module)."""

    hf_config: PretrainedConfig
    optimizer: DistributedAdamW
    tokenizer_path: str | None


def _meta(engine: CheckpointedModel) -> dict[str, Any]:
    return {
        "format": "tephra-megatron-v2",
        "shape": dataclasses.asdict(engine.shape),
        "role": engine.config.model.role,
        "param_dtype": engine.config.precision.param_dtype,
        "parallel": dataclasses.asdict(engine.config.parallel),
        "world_size": dist.get_world_size(),
        "lora": dataclasses.asdict(engine.config.lora),
    }


def save(engine: CheckpointedModel, path: Path) -> None:
    rank = dist.get_rank()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / "meta.json").write_text(json.dumps(_meta(engine), indent=1))
    dist.barrier()
    state = {
        "model": [c.state_dict() for c in engine.chunks],
        "optimizer": engine.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    torch.save(state, path / f"rank_{rank:05d}.pt")
    dist.barrier()


def load(engine: CheckpointedModel, path: Path) -> None:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (meta.json is missing)")
    meta = json.loads(meta_file.read_text())
    expected = json.loads(json.dumps(_meta(engine)))  # as stored (tuples become lists)
    # shape fields added since a checkpoint was written hold their defaults for it
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(engine.shape)
        if f.default is not dataclasses.MISSING
    }
    stored = meta.get("shape") or {}
    meta["shape"] = json.loads(
        json.dumps({**{k: v for k, v in defaults.items() if k not in stored}, **stored})
    )
    for key in ("format", "shape", "role", "param_dtype", "parallel", "world_size", "lora"):
        if meta.get(key) != expected[key]:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written for {key}={meta.get(key)!r}, but this "
                f"engine has {key}={expected[key]!r}; load it with the same model and layout"
            )
    shard = path / f"rank_{dist.get_rank():05d}.pt"
    if not shard.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no shard {shard.name}")
    state = torch.load(shard, weights_only=False)
    for chunk, sd in zip(engine.chunks, state["model"]):
        chunk.load_state_dict(sd)
    try:
        engine.optimizer.load_state_dict(state["optimizer"])
    except ValueError as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r}, {shard.name}: {err}; load it with the same model and layout"
        ) from err
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    dist.barrier()


def export_hf(engine: CheckpointedModel, path: Path) -> None:
    """rank 0 writes config, `model.safetensors` and tokenizer (when known); every rank takes
    part in the streamed gather (`weight_export.HFStream` to rank 0), so no rank holds more
    than its own shards and one tensor in flight, and rank 0 writes each tensor as it comes."""
    stream = HFStream(engine, dest=0, per_expert=True)
    entries = stream.names()
    rank = dist.get_rank()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        cfg = engine.hf_config
        if engine.config.model.role == "value":
            data = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
            cfg = transformers.AutoConfig.for_model(**{**data, "num_labels": 1})
            with torch.device("meta"):
                model = transformers.AutoModelForTokenClassification.from_config(cfg)
        else:
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(cfg)
        expected = conv.checkpoint_format(dict(model.state_dict()))
        if getattr(cfg, "tie_word_embeddings", False):
            expected.pop("lm_head.weight", None)
        # the critic head has no bias; transformers' token-classification head does
        extra = {"score.bias": torch.zeros(1)} if "score.bias" in expected else {}
        names = {n for n, _, _ in entries} | set(extra)
        if names != set(expected):
            raise CheckpointError(
                f"export_hf: weights {sorted(set(expected) - names)[:5]} were not produced, "
                f"{sorted(names - set(expected))[:5]} are not the model's"
            )
        cfg.save_pretrained(path)
        if model.can_generate():
            model.generation_config.save_pretrained(path)
        entries += [(n, tuple(t.shape), t.dtype) for n, t in extra.items()]
        with SafetensorsWriter(path / "model.safetensors", entries) as out:
            for name, tensor in extra.items():
                out.write(name, tensor)
            for name, tensor in stream:
                out.write(name, tensor)
        if engine.tokenizer_path:
            try:
                tok = transformers.AutoTokenizer.from_pretrained(engine.tokenizer_path)
                tok.save_pretrained(path)
            except (OSError, ValueError):
                pass  # a folder without a tokenizer: config and weights are still complete
    else:
        for _ in stream:  # take part in the transfers
            pass
    dist.barrier()
