"""Test helpers of the episodes package: a small MCP server script."""

from __future__ import annotations

CALC_MCP_SERVER = '''
from mcp.server.mcpserver import MCPServer
server = MCPServer("calc")

@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@server.tool()
def neg(a: int) -> int:
    """Negate an integer."""
    return -a

if __name__ == "__main__":
    server.run("stdio")
'''
"""An MCP stdio server script with two tools (`add`, `neg`): write it to a file and start it
with `sys.executable` (tests of MCP tools and of their shutdown)."""
