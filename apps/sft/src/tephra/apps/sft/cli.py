"""The `uv run apps/sft` entry point: `--help` is answered from the shipped config index before
supervised fine-tuning is imported (torch, Ray, transformers: seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

from tephra.core.app_help import AppHelp, answer_help

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
    argv = sys.argv[1:] if argv is None else argv
    if answer_help(argv, HELP):
        return
    # imported here, not at the top: it loads torch and Ray, which --help must not wait for
    from tephra.apps.sft.main import main as run_app

    run_app(argv)


if __name__ == "__main__":
    main()
