"""A generation server run as a child process in its own process group.

The server lives in another Python environment (vLLM pins its own torch), so it is started
with that environment's interpreter, its output goes to a log file, and every failure
(exits during start-up, never becomes healthy, dies later) becomes a `RolloutError` that ends
with the last lines of that log. `kill()` ends the whole group (vLLM spawns engine workers).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tephra.rollout.base import RolloutError, ServerDiedError

_LIVE: set[ServerProcess] = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`ServerProcess(name, command, env, log_path)` starts the server at once."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: str) -> None:
        self.name = name
        self.command = command
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if not Path(command[0]).exists() and "/" in command[0]:
            raise RolloutError(
                f"{name}: the server's python {command[0]!r} does not exist; build the "
                "environment with `bash scripts/build_vllm_env.sh` or set the backend's "
                "`python` setting"
            )
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== tephra starting: {' '.join(command)}\n".encode())
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _LIVE.add(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def failure(self, what: str) -> RolloutError:
        """The error for `what` happened; a `ServerDiedError` once the process has exited."""
        code = self.proc.poll()
        state = f"exit code {code}" if code is not None else "still running"
        error = ServerDiedError if code is not None and what == "died" else RolloutError
        return error(
            f"{self.name} server {what} ({state}; log {self.log_path}). Last lines:\n"
            f"{self.log_tail()}"
        )

    def wait_healthy(self, url: str, timeout_s: float, health_path: str = "/health") -> None:
        """Poll `url + health_path` until it answers 200; raise at once if the process exits,
        and after `timeout_s` seconds (killing the server) if it never becomes healthy."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.failure("exited during start-up")
            try:
                if httpx.get(url + health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        error = self.failure(
            f"was not healthy at {url}{health_path} after {timeout_s:.0f} s "
            "(raise startup_timeout_s if it is just slow)"
        )
        self.kill()
        raise error

    def kill(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`. Idempotent."""
        _LIVE.discard(self)
        if self.proc.poll() is not None:
            self._kill_group(signal.SIGKILL)  # orphaned workers of a dead leader
            return
        self._kill_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _kill_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        server.kill(grace_s=3.0)
