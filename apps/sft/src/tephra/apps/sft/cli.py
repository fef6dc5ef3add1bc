"""The `uv run apps/sft` entry point: `--help` is answered from the shipped config index before
supervised fine-tuning is imported (torch, Ray, transformers: seconds)."""

from __future__ import annotations

from pathlib import Path

from tephra.core.app_help import AppHelp, run_app

HERE = Path(__file__).parent

HELP = AppHelp(
    command="uv run apps/sft",
    summary=(
        "Supervised fine-tuning on chats: the loss is the mean negative log-likelihood of the assistant tokens. With no arguments it fine-tunes the bundled SmolLM2-135M-Instruct; the presets warm up the models that apps/ppo presets start from."
    ),
    preset_dir=HERE / "presets",
    index=HERE / "config_index.json",
    title="`uv run apps/sft`: supervised fine-tuning",
)


def main(argv: list[str] | None = None) -> None:
    run_app(HELP, "tephra.apps.sft.main", argv)
