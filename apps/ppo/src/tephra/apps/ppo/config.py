"""The PPO app's configuration is the controller's `PPOConfig` (one typed tree composed of the
packages' own configs; see tephra.controller.config.tree). This module adds the app's presets,
and its defaults: the `default` preset (the embedded demo) stands under every run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

from tephra.controller.config.tree import PPOConfig
from tephra.controller.launch.preflight import validate
from tephra.core.config import from_dict, load_config, read_preset, split_cli
from tephra.core.errors import ConfigError

PRESETS = Path(__file__).parent / "presets"

DEFAULT_PRESET = PRESETS / "default.yaml"
"""The app's defaults over the library's neutral ones: the embedded demo (SmolLM2, 36 steps,
lr 3e-5). Every run starts from it; `-p` presets and overrides go over it."""

MADE_BY = {
    "runs/vlm_warmup/hf": "uv run apps/sft -p vlm_warmup",
    "runs/tool_warmup/hf": "uv run apps/sft -p tool_warmup",
}
"""Model folders that a preset starts from and another command writes (`-p vlm_demo` starts
from the SFT warm-up's export) -> that command."""


def app_defaults() -> PPOConfig:
    """The library's `PPOConfig` under the app's `default` preset: what `uv run apps/ppo`
    runs with no arguments (a fresh instance each call)."""
    return from_dict(PPOConfig, read_preset(DEFAULT_PRESET))


def load(presets: list[str], overrides: list[str]) -> PPOConfig:
    """The app's defaults <- presets (in order) <- overrides, each section checked as it is
    built (a preset's section keeps what the default preset set in it and changes what it
    names, as over a library default)."""
    return load_config(PPOConfig, presets, overrides, preset_dir=PRESETS, base=app_defaults())


def parse_config(argv: list[str]) -> PPOConfig:
    """`[-p PRESET ...] [key=value ...]` -> a validated `PPOConfig` (each section checks
    its own fields as it is built; `validate` checks them together)."""
    presets, overrides = split_cli(argv)
    cfg = load(presets, overrides)
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


__all__ = [
    "DEFAULT_PRESET",
    "MADE_BY",
    "PRESETS",
    "PPOConfig",
    "app_defaults",
    "check_model_made",
    "load",
    "parse_config",
]
