"""Tools an agent loop can call: the `Tool` contract, YAML loading and the built-ins
(`python` sandbox, `search` over a local corpus, `mcp` server tools)."""

from tephra.rollout.tools.base import (
    TOOLS,
    Tool,
    ToolConfigError,
    ToolError,
    ToolResult,
    close_tools,
)
from tephra.rollout.tools.loading import load_tools
from tephra.rollout.tools.mcp_tools import MCPTool, MCPToolset
from tephra.rollout.tools.python_sandbox import PythonTool, SandboxConfig
from tephra.rollout.tools.search import SearchTool

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
