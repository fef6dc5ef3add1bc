"""The HTTP layer: the Tinker API's routes on a starlette app, the API key check, and the
long-poll of futures (`retrieve_future` waits up to `POLL_SECONDS` for the result, then
answers `try_again` and the SDK asks again)."""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tephra.apps.serve import wire
from tephra.apps.serve.errors import UserError
from tephra.apps.serve.service import Service

POLL_SECONDS = 20.0
PROTOBUF = "application/x-protobuf"

CLIENT_CONFIG = {
    # plain httpx on the client: the server speaks HTTP/1.1 on loopback
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}

SERVED = (
    "get_server_capabilities",
    "healthz",
    "client/config",
    "client/dynamic_config",
    "create_session",
    "session_heartbeat",
    "telemetry",
    "create_model",
    "get_info",
    "forward_backward",
    "optim_step",
    "save_weights",
    "load_weights",
    "training_runs/{id}/checkpoints",
    "save_weights_for_sampler",
    "create_sampling_session",
    "asample",
    "retrieve_future",
)
"""The routes under /api/v1 this server answers; every other one is refused by name."""

Handler = Callable[[Request], Awaitable[Response]]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message, "error": message}, status_code=status)


# the route table: one short closure per route over `service` (each is simple on its own)
def build_app(service: Service, api_key: str) -> Starlette:  # noqa: C901
    """The ASGI app serving `service`, for clients that send `X-API-Key: api_key`."""

    def json_call(fn: Callable[[dict], dict]) -> Handler:
        async def handle(request: Request) -> Response:
            body = await request.json() if await request.body() else {}
            try:
                return JSONResponse(await asyncio.to_thread(fn, body))
            except UserError as e:
                return _error(400, str(e))

        return handle

    async def capabilities(request: Request) -> Response:
        return JSONResponse(service.capabilities())

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def client_config(request: Request) -> Response:
        return JSONResponse(CLIENT_CONFIG)

    async def dynamic_config(request: Request) -> Response:
        return JSONResponse({})

    async def create_session(request: Request) -> Response:
        return JSONResponse(
            {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:12]}"}
        )

    async def heartbeat(request: Request) -> Response:
        return JSONResponse({"type": "session_heartbeat"})

    async def telemetry(request: Request) -> Response:
        return JSONResponse({"status": "accepted"})

    async def forward_backward(request: Request) -> Response:
        body = await request.body()
        try:
            call = wire.read_forward_backward(body, request.headers.get("content-encoding"))
            return JSONResponse(service.forward_backward(call))
        except UserError as e:
            return _error(400, str(e))

    async def retrieve_future(request: Request) -> Response:
        body = await request.json()
        future = service.futures.get(body.get("request_id", ""))
        if future is None:
            return _error(404, f"retrieve_future: request_id={body.get('request_id')!r} unknown")
        try:
            kind, value = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), POLL_SECONDS
            )
        except TimeoutError:
            return JSONResponse({"type": "try_again", "queue_state": "active"})
        except UserError as e:
            return JSONResponse({"error": str(e), "category": "user"})
        except Exception as e:  # the engine failed: the client sees why, the server goes on
            return JSONResponse({"error": f"{type(e).__name__}: {e}", "category": "server"})
        if kind == "proto":
            return Response(value, media_type=PROTOBUF)
        return JSONResponse(value)

    async def list_checkpoints(request: Request) -> Response:
        try:
            run = request.path_params["model_id"]
            return JSONResponse(await asyncio.to_thread(service.list_checkpoints, run))
        except UserError as e:
            return _error(400, str(e))

    async def refuse(request: Request) -> Response:
        name = request.path_params["name"]
        return _error(
            400,
            f"{name}: this call is not served by tephra serve (it serves "
            f"{', '.join(SERVED)}); see the tephra-app-serve README",
        )

    routes = [
        Route("/api/v1/get_server_capabilities", capabilities, methods=["GET"]),
        Route("/api/v1/healthz", healthz, methods=["GET"]),
        Route("/api/v1/client/config", client_config, methods=["POST"]),
        Route("/api/v1/client/dynamic_config", dynamic_config, methods=["POST"]),
        Route("/api/v1/create_session", create_session, methods=["POST"]),
        Route("/api/v1/session_heartbeat", heartbeat, methods=["POST"]),
        Route("/api/v1/telemetry", telemetry, methods=["POST"]),
        Route("/api/v1/create_model", json_call(service.create_model), methods=["POST"]),
        Route("/api/v1/get_info", json_call(service.get_info), methods=["POST"]),
        Route("/api/v1/forward_backward", forward_backward, methods=["POST"]),
        Route("/api/v1/optim_step", json_call(service.optim_step), methods=["POST"]),
        Route("/api/v1/save_weights", json_call(service.save_weights), methods=["POST"]),
        Route("/api/v1/load_weights", json_call(service.load_weights), methods=["POST"]),
        Route(
            "/api/v1/training_runs/{model_id}/checkpoints",
            list_checkpoints,
            methods=["GET"],
        ),
        Route(
            "/api/v1/save_weights_for_sampler",
            json_call(service.save_weights_for_sampler),
            methods=["POST"],
        ),
        Route(
            "/api/v1/create_sampling_session",
            json_call(service.create_sampling_session),
            methods=["POST"],
        ),
        Route("/api/v1/asample", json_call(service.sample), methods=["POST"]),
        Route("/api/v1/retrieve_future", retrieve_future, methods=["POST"]),
        Route("/api/v1/{name:path}", refuse, methods=["GET", "POST", "PUT", "DELETE"]),
    ]
    expected = api_key.encode()

    class CheckKey(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: Handler) -> Response:
            given = request.headers.get("x-api-key", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "invalid API key: send the key the server was started with")
            return await call_next(request)

    return Starlette(routes=routes, middleware=[Middleware(CheckKey)])
