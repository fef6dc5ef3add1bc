"""`uv run apps/ppo [--preset NAME] [key=value ...]`: parse the config and train.

With no arguments: GRPO on SmolLM2-135M-Instruct (bundled) on reasoning-gym basic_arithmetic,
on CPU, with greedy held-out accuracy before and after; the last line printed is a JSON
summary. The loop itself is `tephra.controller.loop.trainer`; assembly `tephra.controller.launch.ppo`.
"""

from __future__ import annotations

import os
import sys
import time

from tephra.apps.ppo.cli import HELP
from tephra.apps.ppo.config import check_model_made, parse_config
from tephra.controller.config.tree import PPOConfig
from tephra.controller.launch import ppo
from tephra.core.app_help import app_main
from tephra.core.quiet import quiet_third_party_warnings

__all__ = ["main", "parse_config", "run"]


def run(cfg: PPOConfig) -> dict:
    """`tephra.controller.launch.ppo.run`, after checking that a model folder another command
    writes exists (before Ray starts)."""
    check_model_made(cfg)
    return ppo.run(cfg)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_third_party_warnings()
    t0 = time.perf_counter()

    def timed(cfg: PPOConfig) -> dict:
        summary = run(cfg)
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        return summary

    app_main(sys.argv[1:] if argv is None else argv, HELP, parse_config, ppo.config_to_save, timed)


if __name__ == "__main__":
    main()
