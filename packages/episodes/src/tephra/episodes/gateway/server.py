"""The gateway's HTTP server: one per event loop of a rollout worker, routing each request to
its trajectory by the API key in its headers (`Authorization: Bearer KEY` for the OpenAI
clients, `x-api-key: KEY` for the Anthropic client) or in its path (`/k/KEY/v1/...`, for a
client whose key is one setting of the whole process)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import secrets
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tephra.episodes.gateway import anthropic_messages, openai_chat, openai_responses
from tephra.episodes.gateway.config import GatewayConfig
from tephra.episodes.gateway.session import GatewayRefusal, ServedTurn, TrajectorySession
from tephra.episodes.listening import listening

_EXPIRED_KEPT = 100_000
"""Ended trajectories' keys remembered, so a late call hears 'expired', not 'unknown'."""


@dataclass(frozen=True)
class GatewayAccess:
    """What an agent needs to call the gateway for one trajectory."""

    url: str
    """The server's root, `http://HOST:PORT` (the Anthropic client's `base_url`)."""
    api_key: str
    """This trajectory's key: every call with it extends this trajectory."""

    @property
    def openai_base_url(self) -> str:
        """`base_url` of an OpenAI client (`.../v1`)."""
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """`base_url` of an Anthropic client (it adds `/v1/messages` itself)."""
        return self.url

    @property
    def keyed_openai_base_url(self) -> str:
        """`base_url` of an OpenAI client that carries this trajectory's key in its path
        (`.../k/KEY/v1`): for a client that reads its key from one process-wide setting (an
        environment variable), so that concurrent trajectories cannot each set their own; any
        key it sends in its headers is then ignored."""
        return f"{self.url}/k/{self.api_key}/v1"


ErrorFormat = Callable[[int, str], tuple[int, dict[str, Any]]]


class Gateway:
    """Serves the OpenAI Chat Completions (`/v1/chat/completions`), OpenAI Responses
    (`/v1/responses`) and Anthropic Messages (`/v1/messages`) APIs, streaming or not, for
    every open trajectory session; `open(session)` hands out the session's key."""

    def __init__(self, config: GatewayConfig | None = None) -> None:
        self.config = config or GatewayConfig()
        self.sessions: dict[str, TrajectorySession] = {}
        self.expired: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.url = ""
        routes = {
            "/v1/chat/completions": self._chat,
            "/v1/responses": self._responses,
            "/v1/messages": self._messages,
        }
        self.app = Starlette(
            routes=[Route(path, fn, methods=["POST"]) for path, fn in routes.items()]
            + [Route(f"/k/{{key}}{path}", fn, methods=["POST"]) for path, fn in routes.items()]
        )

    def open(self, session: TrajectorySession) -> GatewayAccess:
        """Register `session`; its key routes calls to it until `close(key)`."""
        key = f"tephra-{secrets.token_urlsafe(24)}"
        self.sessions[key] = session
        return GatewayAccess(self.url, key)

    def close(self, key: str) -> None:
        """End the key's trajectory: later calls with it are refused (401, expired)."""
        session = self.sessions.pop(key, None)
        if session is not None:
            self.expired[key] = session.sample_id
            while len(self.expired) > _EXPIRED_KEPT:
                self.expired.popitem(last=False)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Gateway]:
        """Listen for the body of the `async with` (on `config.host:config.port`)."""
        cfg = self.config
        fix = "set rollout.agent.gateway.port=0 for a free port, or a host address of this machine"
        async with listening(self.app, cfg.host, cfg.port, fix, "rollout.agent.gateway") as url:
            self.url = url
            yield self

    def _session(self, request: Request) -> TrajectorySession | str:
        """The request's session, or why there is none (the 401 message)."""
        header = request.headers.get("authorization", "")
        key = header[len("bearer ") :].strip() if header.lower().startswith("bearer ") else ""
        key = key or request.headers.get("x-api-key", "").strip()
        key = request.path_params.get("key", "") or key  # a keyed path wins over headers
        if not key:
            return (
                "no API key: send the trajectory's key (GatewayAccess.api_key) as "
                "'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            )
        if key in self.sessions:
            return self.sessions[key]
        if key in self.expired:
            return (
                f"API key of trajectory {self.expired[key]!r} has expired: that trajectory "
                "has ended; a new trajectory gets a new key"
            )
        return "unknown API key: use the key the gateway gave this trajectory (api_key)"

    async def _serve(
        self,
        request: Request,
        error: ErrorFormat,
        parse: Callable[[dict[str, Any]], Any],
        render: Callable[[ServedTurn, dict[str, Any]], dict[str, Any]],
        stream: Callable[[ServedTurn, dict[str, Any]], Iterator[str]],
    ) -> Response:
        def refuse(status: int, message: str) -> JSONResponse:
            code, body = error(status, message)
            return JSONResponse(body, status_code=code)

        session = self._session(request)
        if isinstance(session, str):
            return refuse(401, session)
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return refuse(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return refuse(400, "the request body must be a JSON object")
        try:
            turn = await session.complete(parse(body))
        except GatewayRefusal as exc:
            # 400: the clients raise BadRequestError with this message and do not retry
            return refuse(400, str(exc))
        if body.get("stream"):
            return StreamingResponse(stream(turn, body), media_type="text/event-stream")
        return JSONResponse(render(turn, body))

    async def _chat(self, request: Request) -> Response:
        return await self._serve(
            request,
            openai_chat.error,
            openai_chat.parse,
            lambda turn, body: openai_chat.render(turn),
            openai_chat.stream,
        )

    async def _responses(self, request: Request) -> Response:
        return await self._serve(
            request,
            openai_responses.error,
            openai_responses.parse,
            openai_responses.render,
            openai_responses.stream,
        )

    async def _messages(self, request: Request) -> Response:
        return await self._serve(
            request,
            anthropic_messages.error,
            anthropic_messages.parse,
            lambda turn, body: anthropic_messages.render(turn),
            lambda turn, body: anthropic_messages.stream(turn),
        )


class _Shared:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.users = 0
        self.lock = asyncio.Lock()
        self.stack: contextlib.AsyncExitStack | None = None


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, int], _Shared]] = (
    weakref.WeakKeyDictionary()
)
"""Per event loop (a closed loop's entry goes with it), the gateway of each address."""


@contextlib.asynccontextmanager
async def shared_gateway(config: GatewayConfig) -> AsyncIterator[Gateway]:
    """The event loop's gateway for `config`, serving while any trajectory uses it: the
    trajectories of a step share one server (one port), each with its own key."""
    gateways = _SHARED.setdefault(asyncio.get_running_loop(), {})
    shared = gateways.setdefault((config.host, config.port), _Shared(Gateway(config)))
    async with shared.lock:
        if shared.users == 0:
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(shared.gateway.serving())
            shared.stack = stack
        shared.users += 1
    try:
        yield shared.gateway
    finally:
        async with shared.lock:
            shared.users -= 1
            if shared.users == 0 and shared.stack is not None:
                stack, shared.stack = shared.stack, None
                await stack.aclose()
