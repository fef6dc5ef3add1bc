"""Tools an agent loop can call: the `Tool` contract, YAML loading and the built-ins
(`python` sandbox, `search` over a local corpus, `mcp` server tools)."""

from tephra.episodes.tools.base import (
    Tool,
    ToolConfigError,
    ToolError,
    ToolResult,
    close_tools,
)
from tephra.episodes.tools.loading import load_tools
from tephra.episodes.tools.mcp_tools import MCPTool, MCPToolset
from tephra.episodes.tools.python_sandbox import PythonTool, SandboxConfig
from tephra.episodes.tools.registry import TOOLS
from tephra.episodes.tools.search import SearchTool

__all__ = [
    "MCPTool",
    "MCPToolset",
    "PythonTool",
    "SandboxConfig",
    "SearchTool",
    "TOOLS",
    "Tool",
    "ToolConfigError",
    "ToolError",
    "ToolResult",
    "close_tools",
    "load_tools",
]
