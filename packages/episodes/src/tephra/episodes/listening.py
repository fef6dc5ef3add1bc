"""One asyncio HTTP listener for the episodes package's servers (the gateway, the environment
server): a bound socket with TCP_NODELAY, uvicorn serving an ASGI app on it inside the
caller's event loop, and the URL a client on this machine reaches it at."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from tephra.core.errors import ConfigError


@contextlib.asynccontextmanager
async def listening(
    app: Any, host: str, port: int, fix: str, field: str = ""
) -> AsyncIterator[str]:
    """Serve `app` on `host:port` (0: a free port) for the body of the `async with`; yields
    its URL (a wildcard host is shown as 127.0.0.1). A port that cannot be bound is a
    `ConfigError` naming `field` (the config section, when there is one) and ending with
    `fix`. The caller owns the process's signals."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so; with proto 0
    # every answer waited out the client's delayed ACK (44 ms per call, measured)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"{field}: " if field else ""
        raise ConfigError(f"{where}cannot listen on {host}:{port} ({exc}); {fix}") from exc
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    )
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
            await asyncio.sleep(0.005)
        yield f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 5.0)
        except TimeoutError:
            task.cancel()
        sock.close()
