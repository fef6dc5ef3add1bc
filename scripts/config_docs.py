"""Writes docs/config.md, the reference of the apps' configs, from their field docstrings, and
each app's `config_index.json` (the same rows, read by the app's `--help` without importing it).

uv run python scripts/config_docs.py           # rewrite docs/config.md and the indexes
uv run python scripts/config_docs.py --check   # exit 1 when one of them is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tephra.apps.eval.config import EvalConfig
from tephra.apps.ppo.config import DEFAULT_PRESET, PPOConfig
from tephra.apps.sft.config import SFTConfig
from tephra.core.app_help import index_rows
from tephra.core.config import read_preset
from tephra.core.config_docs import Row, config_reference, rows, with_app_defaults

OUT = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "uv run python scripts/config_docs.py"

APPS = [
    ("`uv run apps/ppo`: the RL trainer", PPOConfig, "uv run apps/ppo"),
    ("`uv run apps/sft`: supervised fine-tuning", SFTConfig, "uv run apps/sft"),
    ("`uv run apps/eval`: evaluation", EvalConfig, "uv run apps/eval"),
]


def dotted(values: dict[str, Any], sections: set[str], prefix: str = "") -> dict[str, Any]:
    """A nested preset -> dotted key -> value (its leaves): a mapping under a config section
    is walked into, a mapping-valued field (`data.task_config`) is one value."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and f"{prefix}{key}" in sections:
            out.update(dotted(value, sections, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def app_rows(cls: type, command: str) -> list[Row]:
    """The rows of one app's config; apps/ppo shows the defaults of its `default` preset (laid
    under every run) where they differ from the library's."""
    if command != "uv run apps/ppo":
        return rows(cls)
    where = "apps/ppo's `default` preset (the embedded demo)"
    all_rows = rows(cls)
    sections = {r.key.rsplit(".", 1)[0] for r in all_rows if "." in r.key}
    return with_app_defaults(all_rows, dotted(read_preset(DEFAULT_PRESET), sections), where)


def index_path(command: str) -> Path:
    """Where app `uv run apps/NAME` keeps its config index (inside its package)."""
    name = command.rsplit("/", 1)[-1]
    return (
        OUT.parent.parent / "apps" / name / "src" / "tephra" / "apps" / name / "config_index.json"
    )


def render_index(cls: type, command: str) -> str:
    """The JSON config index of one app."""
    return json.dumps(index_rows(app_rows(cls, command)), indent=1) + "\n"


def outputs() -> dict[Path, str]:
    """Every generated file -> its current text."""
    out = {OUT: render()}
    for _, cls, command in APPS:
        out[index_path(command)] = render_index(cls, command)
    return out


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
    body = [
        config_reference(title, cls, command, app_rows(cls, command))
        for title, cls, command in APPS
    ]
    return "\n".join(head) + "\n" + "\n".join(body).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    files = outputs()
    if "--check" in argv:
        stale = [
            path for path, text in files.items() if not path.exists() or path.read_text() != text
        ]
        for path in stale:
            print(f"{path} is stale; regenerate it with `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
