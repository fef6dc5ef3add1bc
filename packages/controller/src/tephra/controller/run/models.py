"""Resolving `model.path`: the bundled SmolLM2, a tiny test model, or a user folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tephra.controller.data.smollm2 import FOLDER_NAME as SMOLLM2_FOLDER
from tephra.controller.data.smollm2 import smollm2_folder
from tephra.core import cache_root
from tephra.engine_api.errors import ConfigError
from tephra.rollout.multimodal import build_tiny_vlm
from tephra.rollout.testing import build_tiny_model


def resolve_model_path(path: str, seed: int = 0) -> str:
    """`smollm2` -> the converted SmolLM2 folder; `tiny` -> a tiny random Qwen2 with a
    ChatML tokenizer, `tiny_vlm` -> a tiny random Qwen2-VL, `tiny_qwen2_5_vl` -> a tiny random
    Qwen2.5-VL, `tiny_llava` -> a tiny random LLaVA (each built once under the cache); anything
    else must be an HF folder."""
    if path == "smollm2":
        return str(smollm2_folder())
    if path == "tiny":
        folder = named_model_folder(path, seed)
        assert folder is not None  # a named model
        if not (folder / "config.json").exists():
            build_tiny_model(folder, seed=seed)
        return str(folder)
    if path in TINY_VLMS:
        folder = named_model_folder(path, seed)
        assert folder is not None  # a named model
        if not (folder / "preprocessor_config.json").exists():  # written last
            build_tiny_vlm(folder, seed=seed, family=TINY_VLMS[path])
        return str(folder)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model.path={path!r}: folder does not exist; give a local Hugging Face folder "
            "(config.json, weights, tokenizer), or `smollm2` for the bundled model"
        )
    if not (folder / "config.json").exists():
        raise ConfigError(
            f"model.path={path!r} has no config.json; it must be a Hugging Face model folder "
            "(save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder))"
        )
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(
            f"model.path={path!r} has no weights (none of {list(WEIGHT_FILES)}); save the model "
            "there with model.save_pretrained(folder), or point model.path at a complete folder"
        )
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise ConfigError(
                f"model.path={path!r}: {weights.name} {problem}; the copy or download was cut "
                "short: copy the file again (or save the model again with "
                "model.save_pretrained(folder))"
            )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build a 1-token tokenizer from the config alone, silently
        raise ConfigError(
            f"model.path={path!r} has no tokenizer (none of {list(TOKENIZER_FILES)}); save one "
            "there with tokenizer.save_pretrained(folder)"
        )
    return str(folder)


def named_model_folder(path: str, seed: int = 0) -> Path | None:
    """The cache folder a named model (`smollm2`, `tiny`, `tiny_vlm`, `tiny_qwen2_5_vl`,
    `tiny_llava`) is built into, which
    may not exist yet; None for any other `model.path`."""
    folders = {
        "smollm2": SMOLLM2_FOLDER,
        "tiny": f"tiny-qwen2-seed{seed}",
        "tiny_vlm": f"tiny-qwen2-vl-seed{seed}",
        "tiny_qwen2_5_vl": f"tiny-qwen2.5-vl-seed{seed}",
        "tiny_llava": f"tiny-llava-seed{seed}",
    }
    return cache_root() / folders[path] if path in folders else None


TINY_VLMS = {"tiny_vlm": "qwen2_vl", "tiny_qwen2_5_vl": "qwen2_5_vl", "tiny_llava": "llava"}
"""Named tiny vision-language models -> the `build_tiny_vlm` family each is built as."""


def declared_model_folder(path: str, seed: int = 0) -> str:
    """Where `model.path`'s config.json is read from while the config loads, building nothing:
    a named model's cache folder (absent before its first use), else `path` itself."""
    return str(named_model_folder(path, seed) or Path(path).expanduser())


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be loaded, from its header and size alone (cheap for
    any size), or None: a truncated file, a header that is not safetensors'."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + n > size:
                return f"has {size} bytes, less than its header needs"
            header = json.loads(f.read(n))
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return "does not start with a safetensors header"
    if size < 8 + n + end:
        return f"has {size} bytes, but its header says {8 + n + end} (truncated)"
    return None


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: str) -> Any:
    """The model folder's tokenizer, with a pad token and a chat template (the prompts are
    chat-formatted); a tokenizer without a template is a `ConfigError`."""
    # transformers takes seconds to import and the config checks import this module
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer of model.path={model_path!r} has no chat template, and prompts are "
            "chat-formatted; use an instruct model, or add one (a chat_template.jinja file in "
            "the folder, or tokenizer.chat_template = ... then tokenizer.save_pretrained)"
        )
    check_vocab_size(model_path, len(tokenizer))
    return tokenizer


def check_vocab_size(model_path: str, tokenizer_size: int) -> None:
    """Refuse a model whose config.json `vocab_size` (or `text_config.vocab_size`) is below
    the tokenizer's size: its embedding has no row for the tokenizer's last ids, and the first
    such token would fail inside a worker (an index error on the embedding)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.exists():  # resolve_model_path names a missing config.json
        return
    config = json.loads(config_file.read_text())
    field_name, vocab = "vocab_size", config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), dict):
        field_name, vocab = "text_config.vocab_size", config["text_config"].get("vocab_size")
    if isinstance(vocab, int) and vocab < tokenizer_size:
        raise ConfigError(
            f"model.path={model_path!r}: config.json has {field_name}={vocab}, below the "
            f"tokenizer's {tokenizer_size} tokens (ids {vocab}..{tokenizer_size - 1} have no "
            "embedding row); give the model its own tokenizer, or resize its embeddings "
            "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) so that "
            f"{field_name} >= {tokenizer_size}"
        )
