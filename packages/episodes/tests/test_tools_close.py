"""`Tool.close` and `close_tools`: a closed MCP stdio tool's server process is gone, the
python tool's leftover working directories are removed, the search index is dropped, and one
failing tool does not keep the others open."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tephra.episodes.testing import CALC_MCP_SERVER
from tephra.episodes.tools import (
    MCPToolset,
    PythonTool,
    SearchTool,
    Tool,
    ToolError,
    ToolResult,
    close_tools,
)
from tephra.rollout.testing import live_processes


def test_closed_mcp_stdio_tool_stops_its_server_process(tmp_path):
    server = tmp_path / "close_server.py"
    server.write_text(CALC_MCP_SERVER)
    tools = MCPToolset(command=sys.executable, args=[str(server)], timeout_s=30).tools()
    assert [t.name for t in tools] == ["add", "neg"]
    assert asyncio.run(tools[0].execute("i", {"a": 2, "b": 3})).text == "5"
    (pid,) = live_processes(str(server))
    assert pid != os.getpid()
    close_tools(tools)  # both tools share the connection: closed once
    assert live_processes(str(server)) == []
    tools[0].close()  # a second close is harmless
    with pytest.raises(ToolError, match="connection to .*close_server.py was closed"):
        asyncio.run(tools[1].execute("i", {"a": 1}))
    assert live_processes(str(server)) == []  # and did not start a new server


def test_python_tool_close_removes_unreleased_working_directories(tmp_path):
    tool = PythonTool(workdir_root=str(tmp_path))

    async def trajectories():
        for name in ("a", "b", "c"):
            await tool.create(name)
        await tool.release("b")

    asyncio.run(trajectories())
    assert len(list(tmp_path.iterdir())) == 2
    tool.close()
    assert list(tmp_path.iterdir()) == []
    tool.close()


def test_search_tool_close_drops_the_index(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "Paris is in France"}) + "\n")
    tool = SearchTool(str(corpus), top_k=1)
    assert [hit[0] for hit in tool.search("Paris")] == ["a"]
    tool.close()
    assert tool.retriever is None and tool.texts == []
    with pytest.raises(ToolError, match="search tool 'search' was closed"):
        tool.search("Paris")


class Counted(Tool):
    """Counts its closes; `fail` makes close raise."""

    description = "test tool"

    def __init__(self, name: str, fail: bool = False):
        self.name, self.fail, self.closes = name, fail, 0

    async def execute(self, instance_id, arguments):
        return ToolResult("")

    def close(self):
        self.closes += 1
        if self.fail:
            raise RuntimeError("disk gone")


class Plain(Tool):
    name = "plain"

    async def execute(self, instance_id, arguments):
        return ToolResult("")


def test_close_tools_closes_each_once_and_names_the_failures():
    first, broken, last = Counted("first"), Counted("broken", fail=True), Counted("last")
    with pytest.raises(
        ToolError, match=r"closing tools failed: broken: RuntimeError\('disk gone'\)"
    ):
        close_tools([first, broken, first, last])
    assert (first.closes, broken.closes, last.closes) == (1, 1, 1)
    assert Plain().close() is None  # the base class holds nothing


SILENT_SERVER = """
import time
# starts a child of its own (as servers that spawn helpers do), then never answers `initialize`
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "silent-helper"])
time.sleep(600)
"""


def _gone_within(marker: str, seconds: float) -> list[int]:
    """Pids with `marker` in their command line still alive after up to `seconds` (a
    generous bound: the SDK's shutdown takes ~2-4 s)."""
    deadline = time.monotonic() + seconds
    while (alive := live_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_mcp_server_that_never_answers_is_stopped_with_its_children(tmp_path):
    server = tmp_path / "silent_server.py"
    server.write_text(SILENT_SERVER.replace("silent-helper", f"{tmp_path}-helper"))
    toolset = MCPToolset(command=sys.executable, args=[str(server)], timeout_s=1)
    try:
        with pytest.raises(ToolError, match="could not connect to the server"):
            toolset.tools()
    finally:
        toolset.close()
    # the failed connect cancelled its task and killed the server's process group: the
    # server and the helper it started are gone, with no one having to exit
    assert _gone_within(str(server), 15) == []
    assert _gone_within(f"{tmp_path}-helper", 15) == []


def test_app_that_exits_leaves_no_mcp_server_behind(tmp_path):
    """What `uv run apps/ppo` with a silent MCP server did: report the failure and exit,
    leaving the server running (it sits in a session of its own). Also a connected server
    whose owner never called `close`."""
    silent, calc = tmp_path / "silent_server.py", tmp_path / "calc_server.py"
    silent.write_text(SILENT_SERVER.replace("silent-helper", f"{tmp_path}-helper"))
    calc.write_text(CALC_MCP_SERVER)
    app = textwrap.dedent(f"""
        import sys
        from tephra.episodes.tools import MCPToolset, ToolError
        kept = MCPToolset(command=sys.executable, args=[{str(calc)!r}], timeout_s=30).tools()
        try:
            MCPToolset(command=sys.executable, args=[{str(silent)!r}], timeout_s=1).tools()
        except ToolError as exc:
            print("error:", exc)
            sys.exit(2)
    """)
    done = subprocess.run([sys.executable, "-c", app], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "could not connect to the server" in done.stdout
    for marker in (str(silent), f"{tmp_path}-helper", str(calc)):
        assert _gone_within(marker, 15) == [], marker


def test_mcp_server_left_running_by_the_sdk_is_killed_with_its_group(tmp_path, monkeypatch):
    """Should the SDK's shutdown not stop the server (here: made a no-op), `close` still
    kills its process group after the grace period."""
    import mcp.client.stdio

    from tephra.episodes.tools import mcp_tools

    async def leave_it_running(process):
        return None

    monkeypatch.setattr(mcp.client.stdio, "_stop_server_process", leave_it_running)
    monkeypatch.setattr(mcp_tools, "CLOSE_GRACE_S", 1.0)
    server = tmp_path / "calc_server.py"
    server.write_text(CALC_MCP_SERVER)
    toolset = MCPToolset(command=sys.executable, args=[str(server)], timeout_s=30)
    assert [t.name for t in toolset.tools()] == ["add", "neg"]
    assert len(live_processes(str(server))) == 1
    toolset.close()
    assert _gone_within(str(server), 15) == []
