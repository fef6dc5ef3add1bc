"""Weights handed to a server process through a shared folder of safetensors files.

Tied embeddings: after a reload, vLLM keeps the old output head of a model whose head is
tied to its input embedding. So a tied model is served from an untied copy
(`tie_word_embeddings: false`, `lm_head.weight` = a copy of the embedding), and every update
carries `lm_head.weight` (the embedding again when the trainer exports only that).

Renamed weights: a protocol may serve a model whose weight names the server reads differently
(vLLM 0.32 wants a LLaVA's CLIP tower as `vision_tower.vision_model.*`, transformers 5 saves
`vision_tower.*`); the served copy and every update then carry the server's names.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tephra.engine_api.adapters import LoraAdapter
from tephra.rollout.base import RolloutError

HEAD = "lm_head.weight"
EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "model.embed_in.weight")
BUCKET_BYTES = 2 * 1024**3
"""Largest safetensors file written per update (bounds the copy held in memory)."""


def is_tied(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text_config = config.get("text_config", config)
    return bool(text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def untied_copy(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Copy a tied model to `out_dir` with an explicit `lm_head.weight` and an untied config."""
    return served_copy(model_dir, out_dir, untie=True)


def served_copy(
    model_dir: str | Path,
    out_dir: str | Path,
    untie: bool,
    rename: Callable[[str], str] | None = None,
) -> Path:
    """Copy a model to `out_dir` as a server loads it: untied (`untie`: an explicit
    `lm_head.weight` and an untied config) and its weights renamed by `rename`."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise RolloutError(
            f"{model_dir} holds no *.safetensors weights; save the model with "
            "save_pretrained(safe_serialization=True)"
        )
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensors[rename(key) if rename else key] = f.get_tensor(key)
    if untie:
        embed = next((k for k in EMBEDDINGS if k in tensors), None)
        if embed is None:
            raise RolloutError(
                f"{model_dir}: tied model without a known embedding name {EMBEDDINGS}; "
                "save it untied (tie_word_embeddings=False) for the server backend"
            )
        tensors.setdefault(HEAD, tensors[embed].clone())
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for item in model_dir.iterdir():
        if (
            item.is_file()
            and not item.name.endswith(".safetensors")
            and item.name != ("model.safetensors.index.json")
        ):
            shutil.copy2(item, out_dir / item.name)
    if untie:
        config = json.loads((out_dir / "config.json").read_text())
        config["tie_word_embeddings"] = False
        if "text_config" in config:
            config["text_config"]["tie_word_embeddings"] = False
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def clip_tower_names(name: str) -> str:
    """A LLaVA weight name as vLLM 0.32 loads it: the CLIP tower under `vision_model.`
    (`model.vision_tower.encoder.x` -> `model.vision_tower.vision_model.encoder.x`); names
    that have it already, and every other weight, unchanged."""
    head, sep, rest = name.partition("vision_tower.")
    if not sep or rest.startswith("vision_model.") or (head and not head.endswith(".")):
        return name
    return f"{head}{sep}vision_model.{rest}"


def write_update(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    dtype: torch.dtype,
    config_from: str | Path,
    add_untied_head: bool,
) -> Path:
    """Write (name, tensor) pairs as safetensors files (at most `BUCKET_BYTES` each) plus the
    model's config.json into the empty folder `out_dir`; returns `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    shutil.copy2(Path(config_from) / "config.json", out_dir / "config.json")
    bucket: dict[str, torch.Tensor] = {}
    size, part = 0, 0
    seen_head, embedding = False, None

    def flush() -> None:
        nonlocal bucket, size, part
        if bucket:
            save_file(
                bucket, str(out_dir / f"model-{part:05d}.safetensors"), metadata={"format": "pt"}
            )
            part += 1
            bucket, size = {}, 0

    for name, tensor in named_tensors:
        tensor = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        seen_head |= name == HEAD
        if name in EMBEDDINGS:
            embedding = tensor
        bucket[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= BUCKET_BYTES:
            flush()
    if add_untied_head and not seen_head and embedding is not None:
        bucket[HEAD] = embedding.clone()
    flush()
    return out_dir


def write_adapter(adapter: LoraAdapter, folder: Path, base_model_path: str | None) -> Path:
    """`adapter` as peft saves it: `adapter_model.safetensors` (its peft-named A and B
    matrices) and `adapter_config.json` (rank, alpha, target modules): the folder vLLM's and
    SGLang's adapter loaders read."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().cpu().contiguous() for n, t in adapter.tensors.items()}
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = adapter.config_dict(base_model_path)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
