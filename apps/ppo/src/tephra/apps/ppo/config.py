"""The PPO app's configuration is the controller's `PPOConfig` (one typed tree composed of the
packages' own configs; see tephra.controller.rl_config). This module adds the app's presets."""

from __future__ import annotations

from pathlib import Path

from tephra.controller.rl_config import PPOConfig
from tephra.core.config import load_config, split_cli

PRESETS = Path(__file__).parent / "presets"


def parse_config(argv: list[str]) -> PPOConfig:
    """`[-p PRESET ...] [key=value ...]` -> a validated `PPOConfig`."""
    presets, overrides = split_cli(argv)
    return load_config(PPOConfig, presets, overrides, preset_dir=PRESETS)


__all__ = ["PRESETS", "PPOConfig", "parse_config"]
