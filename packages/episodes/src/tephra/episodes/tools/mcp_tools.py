"""The `mcp` tools: every tool of a Model Context Protocol server, called with the `mcp` SDK.

One YAML entry names a server (a command to start over stdio, or the URL of a streamable-HTTP
server); loading it lists the server's tools and exposes each as a `Tool` with the server's
schema. The connection lives on a background thread with its own event loop, so the tools can
be called from any event loop (the trainer's, a test's) and are opened once, not per call.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

from tephra.episodes.tools.base import Tool, ToolConfigError, ToolError, ToolResult

CLOSE_GRACE_S = 10.0
"""Seconds `close` waits for the session to end (the SDK closes the server's stdin, then
SIGTERMs and SIGKILLs its process group within ~4 s), before and after cancelling it."""

_OPEN: weakref.WeakSet[MCPToolset] = weakref.WeakSet()
"""Toolsets with a live connection; closed at interpreter exit, because their thread is a
daemon and a stdio server runs in a session of its own, which nothing else would stop."""


@atexit.register
def _close_open_toolsets() -> None:
    for toolset in list(_OPEN):
        toolset.close()


def _own_children() -> dict[int, tuple[int, list[str]]]:
    """pid -> (process group, argv) of this process's children (Linux /proc; empty
    elsewhere)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name, in parentheses, may hold spaces: fields follow the last ')'
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[1]) != os.getpid():
                continue
            argv = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(fields[2]), argv.split("\0")[:-1])
    return out


def kill_process_groups(pgids: list[int]) -> None:
    """SIGKILL each process group that still exists (a server and every child it started)."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already (the SDK's shutdown stopped it), or not ours


class MCPToolset:
    """A connection to one MCP server.

    transport: `stdio` (start `command` with `args`, talk over its stdin/stdout) or `http`
    (streamable HTTP at `url`). `include` keeps only the listed tool names; `prefix` is put
    before every tool name (two servers with a `search` tool). `timeout_s` bounds each call.
    """

    def __init__(
        self,
        transport: str = "stdio",
        command: str | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        url: str | None = None,
        include: list[str] | None = None,
        prefix: str = "",
        timeout_s: float = 60.0,
        server_log: str | None = None,
    ) -> None:
        if transport not in ("stdio", "http"):
            raise ToolConfigError(
                f"mcp: transport={transport!r}; choose 'stdio' (with command) or 'http' (with url)"
            )
        if transport == "stdio" and not command:
            raise ToolConfigError(
                "mcp: transport 'stdio' needs `command` (and optional `args`) to start the server"
            )
        if transport == "http" and not url:
            raise ToolConfigError(
                "mcp: transport 'http' needs `url` (e.g. http://127.0.0.1:8000/mcp)"
            )
        self.transport, self.command, self.args, self.env, self.url = (
            transport,
            command,
            list(args or []),
            env,
            url,
        )
        self.include, self.prefix, self.timeout_s, self.server_log = (
            include,
            prefix,
            timeout_s,
            server_log,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: Any = None
        self._closed: asyncio.Event | None = None
        self._served: Future | None = None
        self._listed: list[Any] = []
        self._shut = False  # closed by its owner: no reconnecting
        self._task: asyncio.Task | None = None
        self._ended = threading.Event()  # `_serve` has left the SDK's context managers
        self._server_groups: list[int] = []
        """Process groups of the stdio server (it starts in a session of its own)."""

    def describe(self) -> str:
        return (
            f"{self.command} {' '.join(self.args)}" if self.transport == "stdio" else str(self.url)
        )

    def start(self) -> list[Any]:
        """Connect (once) and return the server's tool descriptions."""
        if self._shut:
            raise ToolError(
                f"mcp: the connection to {self.describe()} was closed; "
                "load the tools again to use the server"
            )
        if self._thread is not None:
            return self._listed
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tephra-mcp", daemon=True
        )
        self._thread.start()
        _OPEN.add(self)
        self._ended.clear()
        ready: Future = Future()
        self._served = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        try:
            self._listed = ready.result(timeout=self.timeout_s)
        except Exception as exc:
            self._disconnect()
            raise ToolError(
                f"mcp: could not connect to the server ({self.transport}: {self.describe()}): {exc!r}"
            ) from exc
        return self._listed

    async def _serve(self, ready: Future) -> None:
        # One task enters and leaves the SDK's context managers (anyio requires it), and
        # keeps the session open until `close`.
        # the mcp SDK (anyio, pydantic, httpx) loads only when an MCP tool is used
        from mcp import ClientSession, StdioServerParameters

        self._closed = asyncio.Event()
        self._task = asyncio.current_task()
        before = _own_children()
        try:
            if self.transport == "stdio":
                from mcp.client.stdio import stdio_client  # optional: mcp, as above

                log = open(self.server_log or os.devnull, "a")  # noqa: SIM115 (closed below)
                params = StdioServerParameters(
                    command=cast(str, self.command), args=self.args, env=self.env
                )
                transport = stdio_client(params, errlog=log)
            else:
                from mcp.client.streamable_http import streamable_http_client  # optional: mcp

                log = None
                transport = streamable_http_client(cast(str, self.url))
            try:
                async with transport as streams, ClientSession(streams[0], streams[1]) as session:
                    # the server was just started, in a group of its own: remember the group,
                    # to kill it whatever happens to the session. Looked for again once it
                    # answered: on a busy machine the child may not have run `exec` yet at
                    # the first look (its argv still this process's)
                    argv = [self.command, *self.args]

                    def started_groups() -> list[int]:
                        return [
                            p
                            for p, (g, a) in _own_children().items()
                            if p not in before and g == p and a == argv
                        ]

                    self._server_groups = started_groups()
                    await session.initialize()
                    self._server_groups = sorted({*self._server_groups, *started_groups()})
                    listed = (await session.list_tools()).tools
                    self._session = session
                    ready.set_result(listed)
                    await self._closed.wait()
            finally:
                if log is not None:
                    log.close()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise
        finally:
            self._ended.set()

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Call tool `name` on the server from any event loop."""
        if self._session is None:
            self.start()
        future = asyncio.run_coroutine_threadsafe(
            self._session.call_tool(name, arguments), cast(asyncio.AbstractEventLoop, self._loop)
        )
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            future.cancel()
            return ToolResult(
                "", error=f"mcp tool {name!r} did not answer within {self.timeout_s} s"
            )
        except Exception as exc:
            # a dead server fails every later call at once (no hang): the model sees the
            # error, and the message says where to look
            return ToolResult(
                "",
                error=f"mcp tool {name!r} failed: {exc} (server: "
                f"{self.describe()}; if it exited, see its log: server_log)",
            )
        parts = [
            getattr(c, "text", None) or f"[{getattr(c, 'type', 'content')}]"
            for c in (result.content or [])
        ]
        text = "\n".join(parts)
        if getattr(result, "is_error", False):
            return ToolResult("", error=text or f"mcp tool {name!r} reported an error")
        return ToolResult(text)

    def tools(self) -> list[MCPTool]:
        listed = self.start()
        names = [t.name for t in listed]
        if self.include is not None:
            missing = sorted(set(self.include) - set(names))
            if missing:
                raise ToolConfigError(
                    f"mcp: include lists {missing}, which the server does not have; it has {names}"
                )
        return [
            MCPTool(
                self, t.name, self.prefix + t.name, t.description or "", dict(t.input_schema or {})
            )
            for t in listed
            if self.include is None or t.name in self.include
        ]

    def close(self) -> None:
        """Close the session, stop the server's process (stdio) and the thread; later calls
        are errors. Idempotent."""
        self._shut = True
        self._disconnect()

    def _disconnect(self) -> None:
        if self._loop is None:
            return
        _OPEN.discard(self)
        started = self._task is not None
        if self._closed is not None and self._session is not None:
            self._loop.call_soon_threadsafe(self._closed.set)  # a clean end of the session
            self._ended.wait(CLOSE_GRACE_S)
        if self._served is not None and not self._ended.is_set():
            # stuck (a server that never answered `initialize`, or a call that never returns):
            # cancelling runs the SDK's shutdown, which stops the server's process group
            self._served.cancel()
            if started:
                self._ended.wait(CLOSE_GRACE_S)
        kill_process_groups(self._server_groups)  # whatever the SDK's shutdown left running
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_GRACE_S)
        self._loop.close()
        self._loop = self._thread = self._session = self._served = self._task = None
        self._server_groups = []


class MCPTool(Tool):
    """One tool of an MCP server. In YAML, `class: mcp` with the `MCPToolset` arguments as
    config expands into one `MCPTool` per server tool."""

    def __init__(
        self, toolset: MCPToolset, remote_name: str, name: str, description: str, parameters: dict
    ) -> None:
        self.toolset = toolset
        self.remote_name = remote_name
        self.name = name
        self.description = description
        self.parameters = parameters or {"type": "object", "properties": {}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> list[MCPTool]:  # type: ignore[override]
        try:
            toolset = MCPToolset(**config)
        except TypeError as exc:
            raise ToolConfigError(f"mcp: bad config keys {sorted(config)}: {exc}") from exc
        return toolset.tools()

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return await self.toolset.call(self.remote_name, arguments)

    def close(self) -> None:
        """Close the server connection (and stop a stdio server's process). The tools of one
        server share it, so closing one closes it for all (later calls are errors)."""
        self.toolset.close()
