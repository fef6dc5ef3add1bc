"""The `remote` environment: a tephra environment served by another process or host
(`python -m tephra.episodes.environments.serve`), reached over HTTP with one session per
trajectory, with a deadline on every call and retries after connection errors; and
`EnvironmentServerProcess`, which starts such a server as a child process and stops it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import certifi
import httpx

from tephra.core.config import to_dict
from tephra.core.errors import ConfigError, TephraError
from tephra.episodes.environments import wire
from tephra.episodes.environments.base import Environment, StepResult
from tephra.rollout.backends.server_process import ServerProcess
from tephra.rollout.base import is_loopback

if TYPE_CHECKING:
    from tephra.episodes.agent.base import AgentLoopConfig
    from tephra.episodes.prompt import Prompt
    from tephra.episodes.tools.base import Tool

REMOTE_FIELD = "rollout.agent.environment_kwargs"
KEY_ENV = "TEPHRA_ENVIRONMENT_SERVER_KEY"
"""Environment variable the server reads its key from (kept off its command line)."""
SERVE_MODULE = "tephra.episodes.environments.serve"


class RemoteEnvironmentError(TephraError, RuntimeError):
    """A call to an environment server failed: unreachable after the retries, past its
    deadline, or answered with an error (the server's message). One line; the environment
    guard turns it into an environment error of the trajectory."""


class ServerUnreachable(RemoteEnvironmentError):
    """A call's connection errors outlasted its retries (the server is down, or not there)."""


@dataclass(frozen=True)
class RemoteSettings:
    """`rollout.agent.environment_kwargs` of the `remote` environment."""

    environment: str
    """The served environment: a name the server serves (its registered environments, and
    the `path.py:Class` files it was started with)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The served environment's own keyword arguments (its `environment_kwargs`)."""
    url: str | None = None
    """A running server's base URL (`http://host:port`); several comma-separated: each
    trajectory's session stays on one, chosen by its sample id (the next one when that one
    cannot be reached at the session's creation). None: the run (apps/ppo)
    starts one for its duration and stops it at the end."""
    api_key: str | None = None
    """The key of the server at `url` (sent as `Authorization: Bearer`), needed when it was
    started with one. For a server the run starts: the key it gets (None: one made per run
    when `host` is beyond loopback, none on loopback)."""
    host: str = "127.0.0.1"
    """Address the server the run starts listens on: loopback by default; `0.0.0.0` for
    rollout workers on other nodes (the URL then names the driver's node, and a key is made)."""
    port: int = 0
    """Port of the server the run starts (0: a free one)."""
    request_timeout_s: float = 60.0
    """Deadline of one call (a session's reset, a step, ...) once connected, in seconds; on
    expiry the call fails (not retried: the environment is slow, not the network) and the
    trajectory is an environment error. The loop's `turn_timeout_s` /
    `trajectory_timeout_s` still bound the turn and the trajectory."""
    connect_timeout_s: float = 5.0
    """Deadline of opening a connection, in seconds (a connection that times out is retried)."""
    retries: int = 4
    """Retries of a call after a connection error (refused, reset, closed mid-answer), with
    exponential backoff. Every call of the protocol may be repeated safely (sessions carry
    the client's id, steps their turn number), so every call is retried, except `close`."""
    retry_backoff_s: float = 0.25
    """Wait before the first retry in seconds, doubled for each next one (0.25: the default
    four retries wait 0.25 + 0.5 + 1 + 2 = 3.75 s in all, long enough for a restarting
    server's port, short enough that a dead server drops its trajectories within seconds)."""
    startup_timeout_s: float = 120.0
    """Seconds the server the run starts may take to listen (its imports take a few)."""
    max_restarts: int = 3
    """Restarts of the server the run starts, when it dies, over the whole run (on the same
    host, port and key: the workers keep its URL); each is logged with the dead server's log
    tail and counted in `environment_server/restarts`. 0: never restarted. A server given by
    `url` is never restarted (the run did not start it)."""

    @property
    def urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in (self.url or "").split(",") if u.strip()]

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> RemoteSettings:
        """Checked settings; errors name the field and the fix (called when the config loads,
        before any process starts)."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ConfigError(
                f"{REMOTE_FIELD} has {unknown}, which the `remote` environment does not take; "
                f"it takes {names} (the served environment's own arguments go in "
                f"{REMOTE_FIELD}.kwargs)"
            )
        environment = kwargs.get("environment")
        if not isinstance(environment, str) or not environment or environment == "remote":
            raise ConfigError(
                f"{REMOTE_FIELD}.environment={environment!r}: name the environment the server "
                "runs, e.g. rollout.agent.environment_kwargs.environment=answer_check (a "
                "registered name other than `remote`, or path/to/file.py:Class)"
            )
        if not isinstance(kwargs.get("kwargs", {}), dict):
            raise ConfigError(
                f"{REMOTE_FIELD}.kwargs={kwargs['kwargs']!r} must be a mapping: the served "
                "environment's keyword arguments"
            )
        settings = cls(**kwargs)
        settings._check()
        return settings

    def _check(self) -> None:
        if self.url is not None:
            urls = self.urls
            if not urls:
                raise ConfigError(f"{REMOTE_FIELD}.url is empty; give http://host:port or omit it")
            for url in urls:
                parts = urlsplit(url)
                try:
                    port_ok = parts.port is None or 0 < parts.port < 65536
                except ValueError:
                    port_ok = False
                if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
                    raise ConfigError(
                        f"{REMOTE_FIELD}.url={self.url!r}: {url!r} is not an http(s) URL of a "
                        "server; write e.g. http://10.0.0.5:8100 (or omit url: the run starts "
                        "a server)"
                    )
        for name in ("request_timeout_s", "connect_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"{REMOTE_FIELD}.{name}={getattr(self, name)!r} must be > 0 (seconds)"
                )
        if self.max_restarts < 0:
            raise ConfigError(
                f"{REMOTE_FIELD}.max_restarts={self.max_restarts!r} must be >= 0 (0: a server "
                "the run starts is not restarted when it dies)"
            )
        if self.retries < 0 or self.retry_backoff_s < 0:
            raise ConfigError(
                f"{REMOTE_FIELD}.retries={self.retries!r} and retry_backoff_s="
                f"{self.retry_backoff_s!r} must be >= 0"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{REMOTE_FIELD}.port={self.port!r} must be in 0..65535 (0: free)")
        if self.api_key is not None and not str(self.api_key).strip():
            raise ConfigError(f"{REMOTE_FIELD}.api_key is empty: give the key, or omit it")


def check_remote_server(kwargs: dict[str, Any], timeout_s: float = 5.0) -> None:
    """Each server at `url` answers and serves `environment`, else a ConfigError naming the
    field, the URL and what it serves (run before any process starts)."""
    s = RemoteSettings.from_kwargs(kwargs)
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    for url in s.urls:
        try:
            response = httpx.get(f"{url}/v1/environments", headers=headers, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ConfigError(
                f"{REMOTE_FIELD}.url={s.url!r}: nothing answers at {url} within {timeout_s:g} s "
                f"({type(exc).__name__}: {exc}); start the server there (python -m "
                f"{SERVE_MODULE}), correct the URL, or omit url to let the run start one"
            ) from None
        served = response.json().get("environments") if response.status_code == 200 else None
        if not isinstance(served, list):
            raise ConfigError(
                f"{REMOTE_FIELD}.url={s.url!r}: {url}/v1/environments answered HTTP "
                f"{response.status_code} {response.text[:200]!r}, not a tephra environment "
                "server's list (a wrong key? set environment_kwargs.api_key)"
            )
        if s.environment not in served:
            raise ConfigError(
                f"{REMOTE_FIELD}.environment={s.environment!r} is not served at {url}, which "
                f"serves {served}; name one of those, or start the server with --file "
                "path.py:Class for a file environment"
            )


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client: building one per client (httpx's default) reads
    the CA bundle each time, ~0.1 s, per trajectory."""
    return ssl.create_default_context(cafile=certifi.where())


class RemoteEnvironment(Environment):
    """One session per trajectory on an environment server (`serve`): `reset` creates it
    (the served environment built with `kwargs`, the loop's config and the item, and reset),
    `step` sends the model's turn, `close` ends it. Whether the rewards are the sample's
    (`owns_reward`) and the tool schemas are the served environment's."""

    def __init__(
        self,
        tools: dict[str, Tool] | None = None,
        config: AgentLoopConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tools, config, **kwargs)
        self.settings = RemoteSettings.from_kwargs(kwargs)
        if not self.settings.urls:
            raise ConfigError(
                f"{REMOTE_FIELD}.url is not set: apps/ppo starts a server when it is omitted; "
                "elsewhere start one (python -m tephra.episodes.environments.serve, or "
                "EnvironmentServerProcess) and give its URL"
            )
        self.url = self.settings.urls[0]
        self.client: httpx.AsyncClient | None = None
        self.session: str | None = None
        self.turn = 0
        self.schemas: list[dict[str, Any]] | None = None
        self.has_tool_rewards = True
        self.requests = 0
        """HTTP requests sent, retries included."""

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        """Open the session on the server the sample id picks; one that cannot be reached
        (after the retries) passes the session on to the next of `url`'s servers."""
        s = self.settings
        urls = s.urls
        first = zlib.crc32(item.sample_id.encode()) % len(urls)
        # unique even where a sample id repeats (a re-run item): a repeated create with it is
        # the same session
        self.session = f"{item.sample_id}-{secrets.token_hex(6)}"
        body = {
            "session": self.session,
            "environment": s.environment,
            "kwargs": s.kwargs,
            "config": to_dict(self.config) if self.config is not None else {},
            "item": wire.item_to_json(item),
        }
        for url in urls[first:] + urls[:first]:
            self.url = url
            self.client = httpx.AsyncClient(
                base_url=url,
                timeout=httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s),
                headers={"Authorization": f"Bearer {s.api_key}"} if s.api_key else {},
                verify=_tls(),
            )
            try:
                created = await self._call("POST", "/v1/sessions", body)
                break
            except ServerUnreachable:
                if url == urls[first - 1]:  # the last one tried
                    raise
                await self.client.aclose()
        self.owns_reward = bool(created["owns_reward"])
        self.schemas = created.get("tool_schemas")
        self.has_tool_rewards = bool(created.get("tool_rewards", True))
        return list(created["observation"])

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        answer = await self._call(
            "POST", f"/v1/sessions/{self.session}/step", {"turn": self.turn, "action": action}
        )
        return wire.result_from_json(answer)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.schemas

    async def tool_rewards(self) -> dict[str, float]:
        if not self.has_tool_rewards:  # the served environment has none: no round trip
            return {}
        answer = await self._call("POST", f"/v1/sessions/{self.session}/tool_rewards", {})
        return {k: float(v) for k, v in answer["tool_rewards"].items()}

    async def close(self) -> None:
        """End the session: one attempt, its failure ignored (a server that is down lost the
        session with it; a live one that missed the call closes it when idle)."""
        client, self.client = self.client, None
        if client is None:
            return
        try:
            if self.session is not None:
                with contextlib.suppress(RemoteEnvironmentError):
                    await self._call("DELETE", f"/v1/sessions/{self.session}", None, client, 0)
        finally:
            await client.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        client: httpx.AsyncClient | None = None,
        retries: int | None = None,
    ) -> dict[str, Any]:
        """The server's answer to one call; a connection error (refused, reset, closed
        mid-answer, a connect timeout) is retried `retries` times with doubling waits."""
        client = client or self.client
        assert client is not None, "reset opens the session"
        s = self.settings
        retries = s.retries if retries is None else retries
        where = f"remote environment {s.environment!r} at {self.url}: {method} {path}"
        start = time.monotonic()
        for attempt in range(retries + 1):
            self.requests += 1
            try:
                response = await client.request(
                    method,
                    path,
                    content=None if body is None else wire.dumps(body),
                    headers={"Content-Type": "application/json"},
                )
            except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
                raise RemoteEnvironmentError(
                    f"{where}: no answer within request_timeout_s={s.request_timeout_s:g} s "
                    f"({type(exc).__name__}); the environment is slower than that: raise "
                    f"{REMOTE_FIELD}.request_timeout_s"
                ) from exc
            except httpx.TransportError as exc:
                if attempt < retries:
                    await asyncio.sleep(s.retry_backoff_s * 2**attempt)
                    continue
                raise ServerUnreachable(
                    f"{where}: {type(exc).__name__} ({exc or 'connection failed'}) after "
                    f"{attempt + 1} attempt(s) over {time.monotonic() - start:.1f} s; is the "
                    "server running? (retries: environment_kwargs.retries)"
                ) from exc
            return self._answer(response, where)
        raise AssertionError("unreachable")  # the loop returns or raises

    @staticmethod
    def _answer(response: httpx.Response, where: str) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code != 200:
            message = data.get("error") if isinstance(data, dict) else None
            raise RemoteEnvironmentError(
                f"{where}: HTTP {response.status_code}: {message or repr(response.text[:200])}"
            )
        if not isinstance(data, dict):
            raise RemoteEnvironmentError(f"{where}: the answer is not a JSON object")
        return data


_LIVE: set[EnvironmentServerProcess] = set()


class EnvironmentServerProcess:
    """An environment server started as a child process (`python -m
    tephra.episodes.environments.serve`, in its own process group), listening once the
    constructor returns (`url`). `stop()` ends it and removes its folder; so does this
    process's exit, and the server ends itself within a second of this process dying, a
    SIGKILL included: nothing is left behind."""

    def __init__(
        self,
        files: list[str] | tuple[str, ...] = (),
        tools_file: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tephra-environment-server-"))
        self.log_path = Path(log_path) if log_path else self.folder / "server.log"
        ready = self.folder / "url"
        command = [sys.executable, "-m", SERVE_MODULE, "--host", host, "--port", str(port)]
        command += ["--ready-file", str(ready), "--parent-pid", str(os.getpid())]
        command += ["--remove-on-exit", str(self.folder)]
        for spec in files:
            command += ["--file", spec]
        if tools_file:
            command += ["--tools-file", str(tools_file)]
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        if api_key:
            env[KEY_ENV] = api_key
        # its own process group, output to the log (the generation servers' launcher)
        self.server = ServerProcess("environment", command, env, str(self.log_path))
        _LIVE.add(self)
        deadline = time.monotonic() + startup_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited with status {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"did not listen within {startup_timeout_s:g} s"
                )
                tail = self.log_tail()
                self.stop()
                raise RemoteEnvironmentError(f"the environment server {why}; its log:\n{tail}")
            time.sleep(0.05)
        self.url = ready.read_text()

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.server.proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        return self.server.log_tail(lines)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (the server closes its sessions), SIGKILL after `grace_s`; idempotent."""
        _LIVE.discard(self)
        self.server.kill(grace_s)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> EnvironmentServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SupervisedServer:
    """A run's environment server kept up: a thread watches the child process and, when it
    dies, starts it again on the same port (with the same files, key and log, which the new
    one appends to), at most `max_restarts` times; each death is printed with the dead
    server's log tail. Trajectories in flight on the dead server fail (their sessions died
    with it) and are the run's environment errors; `wait_ready()` holds the next step until a
    restart in progress is done, so later steps open their sessions on the new server."""

    def __init__(self, start: Callable[[int], EnvironmentServerProcess], max_restarts: int) -> None:
        self.start = start
        self.server = start(0)
        self.url = self.server.url
        self.port = urlsplit(self.url).port or 0
        self.max_restarts = max_restarts
        self.restarts = 0
        """Restarts done (successful starts after a death)."""
        self.deaths = 0
        self.up = threading.Event()
        self.up.set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="environment-server", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            status = self.server.proc.poll()
            if status is None:
                continue
            self.up.clear()
            self.deaths += 1
            tail = self.server.log_tail()
            self.server.stop()
            if self.deaths > self.max_restarts:
                print(
                    f"environment server {self.url} (pid {self.server.pid}) died with status "
                    f"{status}; not restarted ({self.max_restarts} restarts done, "
                    f"{REMOTE_FIELD}.max_restarts): its trajectories fail from now on. "
                    f"Its log's tail:\n{tail}",
                    flush=True,
                )
                self.up.set()
                return
            print(
                f"environment server {self.url} (pid {self.server.pid}) died with status "
                f"{status}; restarting it ({self.deaths} of {self.max_restarts}). Its log's "
                f"tail:\n{tail}",
                flush=True,
            )
            try:
                self.server = self.start(self.port)
            except RemoteEnvironmentError as exc:
                print(f"environment server {self.url}: the restart failed: {exc}", flush=True)
                self.up.set()
                return
            self.restarts += 1
            print(f"environment server: {self.url} (pid {self.server.pid}, restarted)", flush=True)
            self.up.set()

    def wait_ready(self) -> None:
        """Return once no restart is in progress (at once while the server is up)."""
        self.up.wait()

    def metrics(self) -> dict[str, float]:
        return {"environment_server/restarts": float(self.restarts)}

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.server.stop()


WIDE_HOSTS = ("0.0.0.0", "::")
"""Listen addresses that are no address to connect to: the URL names the node instead."""


@contextlib.contextmanager
def served_environment(
    agent: AgentLoopConfig,
    tools_file: str | None = None,
    log_path: str | Path | None = None,
    node_address: str | None = None,
) -> Iterator[tuple[AgentLoopConfig, SupervisedServer | None]]:
    """`(agent, None)`, unless its environment is `remote` without a `url`: then a server
    is started for the body of the `with` (serving `environment_kwargs.environment`, with
    `tools_file`), kept up by a `SupervisedServer` (restarted when it dies, up to
    `max_restarts` times), and `agent` comes back with the server's URL and key in its
    `environment_kwargs`; the server is stopped on the way out. `node_address` is this
    machine's address for other nodes (used when `host` is `0.0.0.0` or `::`)."""
    if agent.environment != "remote" or agent.environment_kwargs.get("url"):
        yield agent, None
        return
    s = RemoteSettings.from_kwargs(agent.environment_kwargs)
    key = s.api_key
    if key is None and not is_loopback(s.host):
        key = secrets.token_urlsafe(32)  # in memory only: the workers get it with the config
    is_file = ":" in s.environment and s.environment.rsplit(":", 1)[0].endswith(".py")
    files = [s.environment] if is_file else []

    def start(port: int) -> EnvironmentServerProcess:
        return EnvironmentServerProcess(
            files, tools_file, s.host, port or s.port, key, log_path, s.startup_timeout_s
        )

    supervised = SupervisedServer(start, s.max_restarts)
    try:
        url = supervised.url
        if s.host in WIDE_HOSTS and node_address:
            url = url.replace("127.0.0.1", node_address, 1)
        kwargs = {**agent.environment_kwargs, "url": url, "api_key": key}
        print(f"environment server: {url} (pid {supervised.server.pid}, for the run)", flush=True)
        yield replace(agent, environment_kwargs=kwargs), supervised
    finally:
        supervised.stop()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=2.0)
