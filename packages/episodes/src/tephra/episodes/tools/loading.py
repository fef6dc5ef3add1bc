"""Tools declared in YAML.

A tools file is a list of entries, each `{class: "pkg.module:Class" | "<registered name>",
config: {...}}`; or a mapping with key `tools:` holding that list. Errors name the file, the
entry index and what to fix.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml

from tephra.episodes.tools.base import Tool, ToolConfigError
from tephra.episodes.tools.registry import TOOLS


def import_object(path: str, where: str) -> Any:
    """Import `module.sub:Attr`; `where` prefixes error messages."""
    if ":" not in path:
        raise ToolConfigError(
            f"{where}: class {path!r} is neither a registered tool ({', '.join(TOOLS.names())}) "
            f"nor an import path of the form 'package.module:ClassName'"
        )
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolConfigError(
            f"{where}: cannot import module {module_name!r} of class {path!r}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ToolConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}") from exc


def build_tool(spec: dict[str, Any], where: str) -> list[Tool]:
    """Build the tool(s) of one entry (an `mcp` entry exposes every tool of its server)."""
    if not isinstance(spec, dict) or "class" not in spec:
        raise ToolConfigError(
            f"{where}: expected a mapping with key 'class' (and optional 'config'); got {spec!r}"
        )
    unknown = set(spec) - {"class", "config"}
    if unknown:
        raise ToolConfigError(
            f"{where}: unknown keys {sorted(unknown)}; an entry has only 'class' and 'config'"
        )
    class_path = spec["class"]
    config = spec.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: 'config' must be a mapping; got {type(config).__name__}")
    cls = TOOLS.get(class_path) if class_path in TOOLS else import_object(class_path, where)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ToolConfigError(
            f"{where}: {class_path!r} is not a subclass of tephra.episodes.tools.Tool"
        )
    try:
        built = cls.from_config(config)
    except Exception as exc:
        raise ToolConfigError(f"{where}: building {class_path!r} failed: {exc}") from exc
    return list(built) if isinstance(built, list | tuple) else [built]


def load_tools(path: str | Path) -> dict[str, Tool]:
    """Read a tools YAML file and build its tools, keyed by tool name (names must be unique)."""
    path = Path(path)
    if not path.is_file():
        raise ToolConfigError(f"tools file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"tools file {str(path)!r} is not valid YAML: {exc}") from exc
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise ToolConfigError(
            f"tools file {str(path)!r}: expected a list of {{class, config}} entries (or a 'tools:' key "
            f"holding one); got {type(data).__name__}"
        )
    tools: dict[str, Tool] = {}
    for index, spec in enumerate(data):
        where = f"tools file {str(path)!r}, entry {index}"
        for tool in build_tool(spec, where):
            if not tool.name:
                raise ToolConfigError(f"{where}: tool {type(tool).__name__} has an empty name")
            if tool.name in tools:
                raise ToolConfigError(
                    f"{where}: tool name {tool.name!r} is already used by an earlier entry"
                )
            tools[tool.name] = tool
    return tools
