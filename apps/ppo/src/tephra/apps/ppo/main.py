"""`uv run apps/ppo [--preset NAME] [key=value ...]`: parse the config and train.

With no arguments: GRPO on SmolLM2-135M-Instruct (bundled) on reasoning-gym basic_arithmetic,
on CPU, with greedy held-out accuracy before and after; the last line printed is a JSON
summary. The loop itself is `tephra.controller.loop.trainer`; assembly `tephra.controller.launch.ppo`.
"""

from __future__ import annotations

import json
import os
import sys
import time

import yaml

from tephra.apps.ppo.cli import HELP
from tephra.apps.ppo.config import check_model_made, parse_config
from tephra.controller.config.tree import PPOConfig
from tephra.controller.launch import ppo
from tephra.core.app_help import answer_help, split_print_config
from tephra.core.errors import tephra_cause
from tephra.core.quiet import quiet_third_party_warnings

__all__ = ["main", "parse_config", "run"]


def run(cfg: PPOConfig) -> dict:
    """`tephra.controller.launch.ppo.run`, after checking that a model folder another command
    writes exists (before Ray starts)."""
    check_model_made(cfg)
    return ppo.run(cfg)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if answer_help(argv, HELP):
        return
    print_only, argv = split_print_config(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_third_party_warnings()
    t0 = time.perf_counter()
    try:
        cfg = parse_config(argv)
        if print_only:
            print(yaml.safe_dump(ppo.config_to_save(cfg), sort_keys=False), end="", flush=True)
            return
        summary = run(cfg)
    except Exception as exc:  # a worker's TephraError arrives wrapped by Ray
        cause = tephra_cause(exc)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C before Ray started: nothing to stop or save
        print("interrupted before training started", file=sys.stderr)
        raise SystemExit(130) from None
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary), flush=True)
    if summary.get("status") == "stopped":  # by SIGINT / SIGTERM: 130 / 143, as a shell says
        raise SystemExit(summary["exit_code"])


if __name__ == "__main__":
    main()
