"""An app's `--help`, answered from a shipped index of its config and its presets' YAML files.

An app's config tree imports the packages that build what it configures (torch, Ray,
transformers: seconds), so `--help` must not import it. `scripts/config_docs.py` writes, beside
docs/config.md and from the same field docstrings (`tephra.core.config_docs.rows`), a JSON index
of every dotted key (type, default, doc) into each app's package; this module reads that index
and the presets' leading comments, and imports nothing beyond the standard library.

    uv run apps/ppo --help             # usage, presets, sections
    uv run apps/ppo --help actor       # the fields of one section (or of `actor.optimizer`)
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from tephra.core.errors import ConfigError, tephra_cause

C = TypeVar("C")

HELP_FLAGS = ("-h", "--help")
PRINT_CONFIG = "--print-config"
DOCS = "docs/config.md"


@dataclass(frozen=True)
class AppHelp:
    """What an app's `--help` shows."""

    command: str
    """How the app is run (`uv run apps/ppo`)."""
    summary: str
    """One paragraph: what the app does with no arguments."""
    preset_dir: Path
    """Folder of the app's `<name>.yaml` presets (each opens with a comment saying what it is)."""
    index: Path
    """The JSON config index `scripts/config_docs.py` writes (`index_rows` of the config)."""
    title: str
    """The heading of this app's part of docs/config.md, named as where to read more."""


def index_rows(rows: list[Any]) -> list[dict[str, str]]:
    """`tephra.core.config_docs.Row`s -> the JSON-ready rows of the index."""
    return [{"key": r.key, "type": r.type, "default": r.default, "doc": r.doc} for r in rows]


def preset_line(path: Path) -> str:
    """The first sentence of a preset's leading comment (its one line in `--help`)."""
    comment = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    text = " ".join(comment).strip()
    if not text:
        return "(no description: the preset opens with no comment)"
    return first_sentence(text)


def first_sentence(doc: str, width: int = 100) -> str:
    """A docstring's first sentence on one line, cut to `width` characters: it ends at a `.`,
    `:` or `;` followed by a space outside brackets (`et al. 2025)` and `(a: b)` do not end it)."""
    text = " ".join(doc.split())
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 and ch in ".:;" and text[i + 1 : i + 2] == " ":
            text = text[:i]
            break
    text = text.rstrip(".:;")
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _rows(app: AppHelp) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = json.loads(app.index.read_text())
    return rows


def _sections(rows: list[dict[str, str]]) -> set[str]:
    """Keys that have keys under them."""
    parents = {r["key"].rsplit(".", 1)[0] for r in rows if "." in r["key"]}
    return {r["key"] for r in rows} & parents


def overview(app: AppHelp) -> str:
    """Usage, the presets and the sections, one line each."""
    rows = _rows(app)
    sections = _sections(rows)
    width = max(len(r["key"]) for r in rows if "." not in r["key"])
    presets = sorted(app.preset_dir.glob("*.yaml"))
    pwidth = max((len(p.stem) for p in presets), default=0)
    out = [
        f"usage: {app.command} [-p PRESET ...] [key=value ...]",
        f"       {app.command} --help [SECTION]",
        f"       {app.command} [-p PRESET ...] [key=value ...] {PRINT_CONFIG}",
        "",
        textwrap.fill(" ".join(app.summary.split()), 92),
        "",
        "Presets are YAML files applied in order (-p NAME, or a path); key=value overrides",
        "come last. --print-config prints the composed config and exits without running.",
        "",
        "presets:",
        *(f"  {p.stem:<{pwidth}}  {preset_line(p)}" for p in presets),
        "",
        f"config sections (`{app.command} --help SECTION` lists a section's keys):",
    ]
    for r in rows:
        if "." in r["key"]:
            continue
        kind = "" if r["key"] in sections else f" [{r['type']} = {r['default']}]"
        out.append(f"  {r['key']:<{width}}  {first_sentence(r['doc'])}{kind}")
    out += ["", f"every key, its type, default and meaning: {DOCS} ({app.title})"]
    return "\n".join(out)


def section(app: AppHelp, name: str) -> str:
    """The keys under section `name` (a dotted prefix): type, default and doc of each."""
    rows = _rows(app)
    sections = _sections(rows)
    if name not in sections:
        top = sorted(s for s in sections if "." not in s)
        close = [s for s in sorted(sections) if s.endswith("." + name) or s.startswith(name)]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"--help {name}: no config section of that name{hint} (sections: "
            f"{', '.join(top)}; a nested one is dotted, e.g. actor.optimizer)"
        )
    head = next(r for r in rows if r["key"] == name)
    out = [f"{name}: {' '.join(head['doc'].split())}", ""]
    for r in rows:
        if not r["key"].startswith(name + "."):
            continue
        marker = "  (section)" if r["key"] in sections else ""
        out.append(f"{r['key']}: {r['type']} = {r['default']}{marker}")
        if r["doc"]:
            out.append(textwrap.indent(textwrap.fill(" ".join(r["doc"].split()), 88), "    "))
    out += ["", f"set one with `{app.command} {name}.KEY=VALUE`; all keys: {DOCS}"]
    return "\n".join(out)


def answer_help(argv: list[str], app: AppHelp, out: TextIO | None = None) -> bool:
    """Print the help `argv` asks for (`-h`/`--help [SECTION]`) and return True; else False."""
    flags = [i for i, a in enumerate(argv) if a in HELP_FLAGS]
    if not flags:
        return False
    rest = argv[flags[0] + 1 :]
    wanted = rest[0] if rest and not rest[0].startswith("-") and "=" not in rest[0] else None
    try:
        text = overview(app) if wanted is None else section(app, wanted)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(text, file=out or sys.stdout, flush=True)
    return True


def run_app(help: AppHelp, module: str, argv: list[str] | None = None) -> None:
    """An app's entry point: `--help` answered here, else `module`'s `main(argv)` imported and
    run (by name, so that torch and Ray load only once help had its chance)."""
    argv = sys.argv[1:] if argv is None else argv
    if answer_help(argv, help):
        return
    importlib.import_module(module).main(argv)


def split_print_config(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether `--print-config` was given, argv without it)."""
    return PRINT_CONFIG in argv, [a for a in argv if a != PRINT_CONFIG]


def app_main(
    argv: list[str],
    app: AppHelp,
    parse: Callable[[list[str]], C],
    to_save: Callable[[C], dict[str, Any]],
    run: Callable[[C], dict[str, Any]],
    show: Callable[[dict[str, Any]], Any] = lambda summary: summary,
) -> None:
    """The body every app's `main` shares: `--help` answered; `--print-config` prints the
    composed config (`to_save(cfg)` as YAML) and exits; else `run(cfg)` and its summary printed
    as one JSON line (`show(summary)`: the part of it the app prints).

    Failures a person can fix (a `TephraError`, also one a Ray worker raised) print one line,
    `error: ...`, and exit 2, without a traceback. Ctrl-C where the run does not handle it
    (while the config loads, data is read or Ray starts; apps/eval throughout) exits 130 with
    one line. A run a signal stopped returns a summary with `"status": "stopped"` and its `exit_code` (130 for SIGINT,
    143 for SIGTERM, as a shell reports a job a signal ended): the app exits with that code
    after printing it."""
    if answer_help(argv, app):
        return
    print_only, argv = split_print_config(argv)
    try:
        cfg = parse(argv)
        if print_only:
            import yaml  # noqa: PLC0415 (--help above reads no YAML library)

            print(yaml.safe_dump(to_save(cfg), sort_keys=False), end="", flush=True)
            return
        summary = run(cfg)
    except Exception as exc:  # a worker's TephraError arrives wrapped by Ray
        cause = tephra_cause(exc)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C where the app has no stop of its own (start-up, eval)
        print("interrupted (Ctrl-C)", file=sys.stderr)
        raise SystemExit(130) from None
    print(json.dumps(show(summary)), flush=True)
    if summary.get("status") == "stopped":
        raise SystemExit(summary["exit_code"])


__all__ = [
    "AppHelp",
    "answer_help",
    "app_main",
    "first_sentence",
    "index_rows",
    "overview",
    "preset_line",
    "run_app",
    "section",
    "split_print_config",
]
