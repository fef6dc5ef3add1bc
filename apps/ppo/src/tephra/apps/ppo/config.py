"""The PPO app's configuration is the controller's `PPOConfig` (one typed tree composed of the
packages' own configs; see tephra.controller.config.tree). This module adds the app's presets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from tephra.controller.config.tree import PPOConfig
from tephra.controller.launch.preflight import validate
from tephra.core.config import load_config, split_cli
from tephra.core.errors import ConfigError

PRESETS = Path(__file__).parent / "presets"

MADE_BY = {
    "runs/vlm_warmup/hf": "uv run apps/sft -p vlm_warmup",
    "runs/tool_warmup/hf": "uv run apps/sft -p tool_warmup",
}
"""Model folders that a preset starts from and another command writes (`-p vlm_demo` starts
from the SFT warm-up's export) -> that command."""


def parse_config(argv: list[str]) -> PPOConfig:
    """`[-p PRESET ...] [key=value ...]` -> a validated `PPOConfig` (each section checks
    its own fields as it is built; `validate` checks them together)."""
    presets, overrides = split_cli(argv)
    cfg = load_config(PPOConfig, presets, overrides, preset_dir=PRESETS)
    validate(cfg)
    return cfg


def check_model_made(cfg: PPOConfig) -> None:
    """A missing model folder that another command writes (`MADE_BY`) is an error naming
    that command; the generic error would only say that the folder does not exist."""
    command = MADE_BY.get(os.path.normpath(cfg.model.path or ""))
    # a command is found only for a set path
    if command and not (Path(cast(str, cfg.model.path)) / "config.json").exists():
        raise ConfigError(
            f"model.path={cfg.model.path!r} does not exist yet: it is the model that "
            f"`{command}` writes; run that first (from the same directory), then this again"
        )


__all__ = ["MADE_BY", "PRESETS", "PPOConfig", "check_model_made", "parse_config"]
