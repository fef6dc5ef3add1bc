"""The environment server: any registered tephra environment (or one from a file given at
start) served over HTTP, one session per trajectory, for the `remote` environment to reach.

    python -m tephra.episodes.environments.serve --host 127.0.0.1 --port 8100 \\
        [--file path/to/my_env.py:MyEnv] [--tools-file tools.yaml]

Routes (JSON bodies; every route but /health needs `Authorization: Bearer KEY` when the
server has a key, which it must have beyond loopback):

    GET    /health                          {"status": "ok"}
    GET    /v1/environments                 {"environments": [names served]}
    POST   /v1/sessions                     {"session", "environment", "kwargs", "config", "item"}
                                            -> {"session", "observation", "owns_reward",
                                                "tool_schemas", "tool_rewards"}
    POST   /v1/sessions/{id}/step           {"turn": n, "action": text}
                                            -> {"observation", "reward", "done", "info", "images"}
    POST   /v1/sessions/{id}/tool_rewards   {} -> {"tool_rewards": {tool: reward}}
    DELETE /v1/sessions/{id}                -> {"closed": true | false}

Every call can be repeated safely, so the client retries them after a connection error: a
session is created under the client's own id (a repeat answers the first reset's
observation), a step names its turn (a repeat of the last turn answers the stored result),
tool_rewards only reads and closing a closed session answers `closed: false`. Errors answer
`{"error": message}` with 400 (bad body), 401 (key), 404 (unknown environment or session),
409 (a turn out of order), 422 (the environment refused its kwargs) or 500 (the
environment's reset or step raised).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tephra.core.config import from_dict
from tephra.core.errors import ConfigError, RegistryError
from tephra.episodes.agent.base import AgentLoopConfig
from tephra.episodes.environments import wire
from tephra.episodes.environments.base import Environment, EnvironmentFactory
from tephra.episodes.environments.registry import ENVIRONMENTS, get_environment
from tephra.episodes.environments.remote import KEY_ENV
from tephra.episodes.listening import listening
from tephra.episodes.tools.base import Tool
from tephra.episodes.tools.loading import load_tools
from tephra.rollout.base import is_loopback

NOT_SERVED = frozenset({"remote"})
"""Registered names the server does not serve (a remote environment behind a remote one)."""


def served_names(files: list[str]) -> list[str]:
    """What a server started with `files` serves: every registered name but `remote`, and
    the file specs."""
    return sorted(set(ENVIRONMENTS.names()) - NOT_SERVED) + list(files)


@dataclass
class _Session:
    env: Environment
    created: dict[str, Any]
    """The answer of the reset (repeated to a repeated create)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    turn: int = 0
    """Model turns answered so far."""
    last: dict[str, Any] | None = None
    """The answer of turn `turn` (repeated to a repeated step)."""
    used: float = field(default_factory=time.monotonic)


def _answer(body: dict[str, Any], status: int = 200) -> Response:
    return Response(wire.dumps(body), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _answer({"error": message}, status)


def _raised(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


class EnvironmentServer:
    """The ASGI app (`self.app`) serving the environments: registered names and `files`
    (`path.py:Class`, imported here, so a broken file fails the start), with the tools of
    `tools_file` for the `tool` environment. Sessions idle for `idle_timeout_s` are closed
    (a client that died never closes its own)."""

    def __init__(
        self,
        files: list[str] | None = None,
        tools_file: str | None = None,
        api_key: str | None = None,
        idle_timeout_s: float = 3600.0,
    ) -> None:
        self.factories: dict[str, EnvironmentFactory] = {
            spec: get_environment(spec) for spec in files or []
        }
        self.names = served_names(list(self.factories))
        self.tools: dict[str, Tool] = load_tools(tools_file) if tools_file else {}
        self.api_key = api_key
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, _Session] = {}
        self.creating: dict[str, asyncio.Lock] = {}
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/environments", self._environments, methods=["GET"]),
                Route("/v1/sessions", self._create, methods=["POST"]),
                Route("/v1/sessions/{session}/step", self._step, methods=["POST"]),
                Route("/v1/sessions/{session}/tool_rewards", self._tool_rewards, methods=["POST"]),
                Route("/v1/sessions/{session}", self._close, methods=["DELETE"]),
            ]
        )

    def factory(self, name: str) -> EnvironmentFactory:
        if name in self.factories:
            return self.factories[name]
        if name in NOT_SERVED or name not in ENVIRONMENTS.names():
            raise RegistryError(
                f"unknown environment {name!r}: this server serves {self.names} (a file "
                "environment is served when the server starts with --file path.py:Class)"
            )
        return ENVIRONMENTS.get(name)

    def _refused(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        header = request.headers.get("authorization", "")
        key = header[len("bearer ") :].strip() if header.lower().startswith("bearer ") else ""
        if not key:
            return _error(
                401, "no key: send 'Authorization: Bearer KEY' (environment_kwargs.api_key)"
            )
        if not secrets.compare_digest(key.encode(), self.api_key.encode()):
            return _error(401, "wrong key: use the key the server was started with")
        return None

    async def _body(self, request: Request) -> dict[str, Any] | Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        return body

    async def _health(self, request: Request) -> Response:
        return _answer({"status": "ok"})

    async def _environments(self, request: Request) -> Response:
        refused = self._refused(request)
        return refused or _answer({"environments": self.names})

    async def _create(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        sid = body.get("session")
        if not isinstance(sid, str) or not sid:
            return _error(400, "field 'session' (the client's id of the session) is missing")
        await self._close_idle()
        lock = self.creating.setdefault(sid, asyncio.Lock())
        async with lock:  # a repeated create waits for the first, then answers its reset
            if sid in self.sessions:
                return _answer(self.sessions[sid].created)
            try:
                return await self._new_session(sid, body)
            finally:
                self.creating.pop(sid, None)

    async def _new_session(self, sid: str, body: dict[str, Any]) -> Response:
        name = body.get("environment")
        if not isinstance(name, str) or not name:
            return _error(400, f"field 'environment' is missing; this server serves {self.names}")
        try:
            factory = self.factory(name)
        except RegistryError as exc:
            return _error(404, str(exc))
        try:
            item = wire.item_from_json(body.get("item") or {})
            config = from_dict(AgentLoopConfig, body.get("config") or {}, "config")
        except (ConfigError, TypeError, ValueError) as exc:
            return _error(400, f"environment {name!r}: bad session body: {_raised(exc)}")
        try:
            env = factory(self.tools, config, **dict(body.get("kwargs") or {}))
        except Exception as exc:
            return _error(422, f"environment {name!r} refused its kwargs: {_raised(exc)}")
        try:
            observation = await env.reset(item)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await env.close()
            return _error(500, f"environment {name!r} raised in reset: {_raised(exc)}")
        created = {
            "session": sid,
            "observation": observation,
            "owns_reward": bool(env.owns_reward),
            "tool_schemas": env.tool_schemas(),
            # whether tool_rewards is worth a call (the base class's answers {})
            "tool_rewards": type(env).tool_rewards is not Environment.tool_rewards,
        }
        self.sessions[sid] = _Session(env, created)
        return _answer(created)

    def _session(self, request: Request) -> _Session | Response:
        sid = request.path_params["session"]
        session = self.sessions.get(sid)
        if session is None:
            return _error(
                404,
                f"unknown session {sid!r} (closed, idle for over {self.idle_timeout_s:g} s, "
                "or the server restarted since it was created)",
            )
        session.used = time.monotonic()
        return session

    async def _step(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        session = self._session(request)
        if isinstance(session, Response):
            return session
        turn, action = body.get("turn"), body.get("action")
        if not isinstance(turn, int) or not isinstance(action, str):
            return _error(400, "a step needs 'turn' (int, from 1) and 'action' (the model's text)")
        async with session.lock:
            if turn == session.turn and session.last is not None:
                return _answer(session.last)  # a repeat: the client lost the first answer
            if turn != session.turn + 1:
                return _error(
                    409, f"turn {turn} out of order: the session has answered {session.turn}"
                )
            try:
                result = await session.env.step(action)
            except Exception as exc:
                return _error(500, f"environment raised in step at turn {turn}: {_raised(exc)}")
            session.turn, session.last = turn, wire.result_to_json(result)
            return _answer(session.last)

    async def _tool_rewards(self, request: Request) -> Response:
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        session = self._session(request)
        if isinstance(session, Response):
            return session
        try:
            rewards = await session.env.tool_rewards()
        except Exception as exc:
            return _error(500, f"environment raised in tool_rewards: {_raised(exc)}")
        return _answer({"tool_rewards": rewards})

    async def _close(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        session = self.sessions.pop(request.path_params["session"], None)
        if session is None:
            return _answer({"closed": False})
        try:
            await session.env.close()
        except Exception as exc:
            return _error(500, f"environment raised in close: {_raised(exc)}")
        return _answer({"closed": True})

    async def _close_idle(self) -> None:
        now = time.monotonic()
        for sid in [s for s, x in self.sessions.items() if now - x.used > self.idle_timeout_s]:
            session = self.sessions.pop(sid)
            with contextlib.suppress(Exception):
                await session.env.close()

    async def close_all(self) -> None:
        """Close every open session (the server is stopping)."""
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            with contextlib.suppress(Exception):
                await session.env.close()

    @contextlib.asynccontextmanager
    async def serving(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """Listen on `host:port` (0: a free port) for the body of the `async with`; yields the
        URL. On the way out the open sessions are closed."""
        try:
            async with listening(self.app, host, port, "use --port 0 for a free port") as url:
                yield url
        finally:
            await self.close_all()


async def _parent_gone(pid: int) -> None:
    """Returns once process `pid` (the run that started the server) is gone, however it
    ended (a SIGKILLed driver runs no clean-up of its own)."""
    while True:
        await asyncio.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass  # alive, another user's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tephra.episodes.environments.serve",
        description="Serve tephra environments over HTTP, one session per trajectory.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: a free one)")
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH.py:CLASS",
        help="also serve this Environment subclass from a file, by this spec (repeatable)",
    )
    parser.add_argument("--tools-file", help="tools YAML of the `tool` environment")
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=3600.0,
        help="close a session unused for this long (a client that died never closes it)",
    )
    parser.add_argument("--ready-file", help="write the server's URL here once it listens")
    parser.add_argument("--parent-pid", type=int, help="stop when this process is gone")
    parser.add_argument(
        "--remove-on-exit", help="a folder to delete when the server exits (its starter's)"
    )
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace, api_key: str | None) -> None:
    server = EnvironmentServer(args.file, args.tools_file, api_key, args.idle_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server.serving(args.host, args.port) as url:
        print(f"serving environments {server.names} at {url}", flush=True)
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(url)
            tmp.replace(args.ready_file)  # whole, or not at all
        waits: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
        if args.parent_pid:
            waits.append(asyncio.create_task(_parent_gone(args.parent_pid)))
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    api_key = os.environ.get(KEY_ENV) or None
    if api_key is None and not is_loopback(args.host):
        print(
            f"--host {args.host} lets other machines open sessions; set a key in ${KEY_ENV} "
            "(clients send it as environment_kwargs.api_key), or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    try:
        asyncio.run(_serve(args, api_key))
    except (ConfigError, RegistryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.remove_on_exit:
            shutil.rmtree(args.remove_on_exit, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    # the sessions are closed and the folder removed; what is left is the interpreter tearing
    # down torch's and transformers' modules (2.5-7.6 s measured here), which a starter
    # waiting in stop() would sit through: run the exit hooks (an MCP tool's servers are
    # stopped by one) and leave
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
