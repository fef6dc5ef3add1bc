"""The tool registry: each built-in tool class listed by its short name."""

from __future__ import annotations

from tephra.core.registry import Registry
from tephra.episodes.tools.base import Tool
from tephra.episodes.tools.mcp_tools import MCPTool
from tephra.episodes.tools.python_sandbox import PythonTool
from tephra.episodes.tools.search import SearchTool

TOOLS: Registry[type[Tool]] = Registry("tool")
"""Built-in tool classes by short name (`python`, `search`, `mcp`); YAML may use these names
instead of an import path."""
TOOLS.register("python", PythonTool)
TOOLS.register("search", SearchTool)
TOOLS.register("mcp", MCPTool)
