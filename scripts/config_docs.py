"""Writes docs/config.md, the reference of the apps' configs, from their field docstrings.

uv run python scripts/config_docs.py           # rewrite docs/config.md
uv run python scripts/config_docs.py --check   # exit 1 when docs/config.md is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from tephra.apps.eval.config import EvalConfig
from tephra.apps.ppo.config import PPOConfig
from tephra.apps.sft.config import SFTConfig
from tephra.core.config_docs import config_reference

OUT = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "uv run python scripts/config_docs.py"

APPS = [
    ("`uv run apps/ppo`: the RL trainer", PPOConfig, "uv run apps/ppo"),
    ("`uv run apps/sft`: supervised fine-tuning", SFTConfig, "uv run apps/sft"),
    ("`uv run apps/eval`: evaluation", EvalConfig, "uv run apps/eval"),
]


def render() -> str:
    """The whole of docs/config.md."""
    head = [
        "# Configuration reference",
        "",
        f"Generated from the config dataclasses' field docstrings by `{COMMAND}`; do not edit",
        "by hand (a test fails when this file is stale). Each app's config is one tree of typed",
        "sections; a key is set in a YAML preset (`-p NAME`) or on the command line as a dotted",
        "`key=value`. Defaults are as written in the source: `auto` values are resolved per",
        "machine when the config loads.",
        "",
    ]
    body = [config_reference(title, cls, command) for title, cls, command in APPS]
    return "\n".join(head) + "\n" + "\n".join(body).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
