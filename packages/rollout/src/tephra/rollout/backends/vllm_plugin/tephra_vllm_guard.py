"""An ASGI middleware for the vLLM server that demands the run's key on every route but /health.

vLLM's own `--api-key` guards only `/v1`-style routes, leaving the dev routes tephra enables
(`/sleep`, `/collective_rpc`, the weight-transfer routes) open; a server listening beyond
loopback is started with `--middleware tephra_vllm_guard.RequireKey` and the key in
`TEPHRA_SERVER_API_KEY` (never on the command line, where `ps` shows it). Imports nothing but
the standard library, so it loads in the server's own environment.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

OPEN_PATHS = frozenset({"/health"})
"""Answered without the key: the client's and the launcher's liveness probe."""


class RequireKey:
    """Refuse (401) any HTTP request and close any websocket without `Authorization: Bearer <key>`."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get("TEPHRA_SERVER_API_KEY", "")
        if not key:
            raise RuntimeError("TEPHRA_SERVER_API_KEY is empty: refusing to serve without a key")
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b'{"error": "Unauthorized: this server needs the run\'s API key"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
