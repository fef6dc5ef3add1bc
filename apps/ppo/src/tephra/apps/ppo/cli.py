"""The `uv run apps/ppo` entry point: `--help` is answered from the shipped config index before
the RL trainer (PPO, GRPO, RLOO, ... chosen by config) is imported (torch, Ray, transformers: seconds)."""

from __future__ import annotations

from pathlib import Path

from tephra.core.app_help import AppHelp, run_app

HERE = Path(__file__).parent

HELP = AppHelp(
    command="uv run apps/ppo",
    summary=(
        "With no arguments: GRPO on the bundled SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic, on CPU, with greedy held-out accuracy before and after; the last line printed is a JSON summary and the run folder (trainer.run_dir) holds metrics.jsonl, summary.json, checkpoints and plots."
    ),
    preset_dir=HERE / "presets",
    index=HERE / "config_index.json",
    title="`uv run apps/ppo`: the RL trainer",
)


def main(argv: list[str] | None = None) -> None:
    run_app(HELP, "tephra.apps.ppo.main", argv)
