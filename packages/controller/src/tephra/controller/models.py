"""Resolving `model.path`: the bundled SmolLM2, a tiny test model, or a user folder."""

from __future__ import annotations

from pathlib import Path

from tephra.engine_api.errors import ConfigError


def resolve_model_path(path: str, seed: int = 0) -> str:
    """`smollm2` -> the converted SmolLM2 folder; `tiny` -> a tiny random Qwen2 with a
    ChatML tokenizer (built once under the cache); anything else must be an HF folder."""
    if path == "smollm2":
        from tephra.controller.smollm2 import smollm2_folder

        return str(smollm2_folder())
    if path == "tiny":
        from tephra.controller.smollm2 import cache_root
        from tephra.rollout.testing import build_tiny_model

        folder = cache_root() / f"tiny-qwen2-seed{seed}"
        if not (folder / "config.json").exists():
            build_tiny_model(folder, seed=seed)
        return str(folder)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model.path={path!r}: folder does not exist; give a local Hugging Face folder "
            "(config.json, weights, tokenizer), or `smollm2` for the bundled model")
    if not (folder / "config.json").exists():
        raise ConfigError(
            f"model.path={path!r} has no config.json; it must be a Hugging Face model folder "
            "(save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder))")
    return str(folder)


def count_parameters(path: str) -> int:
    """Parameters of the model at `path`, counted on the meta device (no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
