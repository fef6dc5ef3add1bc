"""The `python` tool: model-written code run in a sandbox.

Isolation, layer by layer (each one is tested in tests/test_tools_python_sandbox.py):
- namespaces (`unshare` from util-linux): a new network namespace (only a downed loopback, so
  no connection can be opened, not even to 127.0.0.1), a new PID namespace whose init is our
  bootstrap (when it exits the kernel kills every process left in the namespace, which is how
  daemonised children that called setsid and forked are removed), a new mount namespace;
- filesystem: the call's working directory is bind-mounted on /tmp, and /var/tmp, /dev/shm,
  /run/lock get a small private tmpfs, so the world-writable places of the host are not
  reachable; as root the code runs under a fresh unprivileged uid so everything the host owns is
  read-only to it; the interpreter and site-packages are bind-mounted read-only under
  /mnt/tephra (the host's may sit under a 0700 home);
- a scrubbed environment (only PATH, HOME, LANG, thread pins), never the parent's;
- `setrlimit` in the child: RLIMIT_CPU (then SIGXCPU), RLIMIT_AS (memory; allocations fail with
  MemoryError), RLIMIT_NPROC (processes of its uid: stops fork bombs; root ignores it, hence
  the uid switch), RLIMIT_FSIZE (file size), RLIMIT_NOFILE;
- the host side caps output (reads at most `max_output_bytes`, then kills) and wall time,
  killing the whole process group (and so the namespace) when either is exceeded.
Without working namespaces the tool refuses to start, unless `allow_network=True` says that a
weaker sandbox (process group + rlimits only) is acceptable.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tephra.engine_api.errors import ConfigError
from tephra.rollout.tools.base import TOOLS, Tool, ToolError, ToolResult

# Runs as init (PID 1) of the new PID namespace, as root of the mount namespace: mounts, then
# forks the code's process, drops to the sandbox uid with rlimits set, and exits with the
# child's status (128 + signal for a signal), which makes the kernel kill every process left.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 2, 4, 4096, 16384
def mount(src, tgt, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s on %s: %s" % (src, tgt, os.strerror(err)))
try:
    if cfg["mounts"]:
        # interpreter binds first: its files may live under /tmp or /var/tmp (a checkout
        # there), which the private mounts below hide
        mount("tmpfs", "/mnt", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for src, tgt in cfg["binds"]:
            os.makedirs(tgt)
            mount(src, tgt, None, MS_BIND | MS_REC)
        mount(cfg["workdir"], "/tmp", None, MS_BIND | MS_REC)
        for d in ("/var/tmp", "/dev/shm", "/run/lock"):
            if os.path.isdir(d):
                mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=1777" % cfg["tmpfs_bytes"])
except OSError as exc:
    os.write(2, ("sandbox setup failed: %s\n" % exc).encode())
    os._exit(125)
pid = os.fork()
if pid == 0:
    try:
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        os.chdir(cfg["cwd"])
        os.execve(cfg["python"], [cfg["python"], "-I", "-c", cfg["wrapper"], *cfg["site_dirs"]], cfg["env"])
    except BaseException as exc:
        os.write(2, ("sandbox setup failed: %r\n" % (exc,)).encode())
        os._exit(125)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
if not cfg["mounts"]:
    # no PID namespace: take the code's process group down ourselves
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
os._exit(code if code >= 0 else 128 - code)
"""

# Runs as the sandbox uid: make the bound site-packages importable, then run main.py as __main__.
_WRAPPER = r"""
import site, sys
for d in sys.argv[1:]:
    site.addsitedir(d)
sys.argv = ["main.py"]
sys.path.insert(0, "")
with open("main.py") as f:
    src = f.read()
exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""

_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass
class SandboxConfig:
    """Limits of one sandboxed run. Defaults suit short maths snippets on a small machine."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    cpu_time_s: int = 5
    """CPU seconds per process (RLIMIT_CPU); SIGXCPU at the limit, SIGKILL one second later."""
    memory_mb: int = 512
    """Address-space limit per process in MiB (RLIMIT_AS). Python itself needs ~30 MiB;
    libraries such as numpy reserve more address space than they use, so keep >= 256."""
    max_processes: int = 16
    """Processes (and threads) the code's uid may have at once (RLIMIT_NPROC)."""
    max_file_size_mb: int = 16
    """Largest file the code may write, in MiB (RLIMIT_FSIZE); also the size of the private
    tmpfs on /var/tmp and /dev/shm."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 65536
    """Bytes of stdout + stderr read before the run is killed as too chatty."""
    max_concurrent: int = 4
    """Sandboxes one tool object runs at once (further calls wait): protects small hosts."""
    allow_network: bool = False
    """Run without a network namespace. False (default): the tool refuses to start where no
    network namespace can be created. True: no network isolation, and where namespaces are
    missing entirely, a weaker sandbox (process group + rlimits, no PID namespace)."""
    python: str | None = None
    """Interpreter for the code; defaults to the one running tephra (its site-packages are
    importable, e.g. sympy or numpy when installed)."""
    uid_base: int = 100000
    """When run as root, each sandbox instance gets a random uid in [uid_base, uid_base+10^6):
    unprivileged, owns nothing on the host, and makes RLIMIT_NPROC count only its processes."""
    workdir_root: str | None = None
    """Where per-instance working directories are created (default: the system temp dir)."""

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "cpu_time_s",
            "memory_mb",
            "max_processes",
            "max_file_size_mb",
            "max_open_files",
            "max_output_bytes",
            "max_concurrent",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"python tool: {name}={getattr(self, name)!r} must be > 0")
        if self.memory_mb < 64:
            raise ConfigError(
                f"python tool: memory_mb={self.memory_mb} is below what Python needs to start; use >= 64"
            )


@dataclass
class SandboxRun:
    """Outcome of one run: outputs (capped), exit status and why it failed (None when it did not)."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    wall_s: float
    output_bytes: int


@cache
def _unshare_works(flags: tuple[str, ...]) -> str | None:
    """None when `unshare <flags> true` runs here, else the reason it does not."""
    exe = shutil.which("unshare")
    if exe is None:
        return "the `unshare` program (util-linux) is not installed"
    try:
        done = subprocess.run(
            [exe, *flags, "--", "true"], capture_output=True, timeout=10, text=True
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare {' '.join(flags)}` failed: {exc}"
    if done.returncode != 0:
        return f"`unshare {' '.join(flags)}` failed: {done.stderr.strip() or done.returncode}"
    return None


def _unshare_flags(allow_network: bool) -> list[str]:
    flags = [
        "--fork",
        "--kill-child",
        "--pid",
        "--mount-proc",
        "--mount",
        "--propagation",
        "private",
    ]
    if not allow_network:
        flags.append("--net")
    if os.geteuid() != 0:
        # unprivileged: a user namespace gives the capabilities the mounts need
        flags += ["--user", "--map-root-user"]
    return flags


def _describe_exit(code: int, stderr: str, cfg: SandboxConfig) -> str | None:
    if code == 0:
        return None
    if code == 125 and "sandbox setup failed" in stderr:
        return stderr.strip().splitlines()[-1]
    if code > 128:
        sig = code - 128
        name = (
            signal.Signals(sig).name
            if sig in signal.Signals._value2member_map_
            else f"signal {sig}"
        )
        if sig == signal.SIGXCPU:
            return f"CPU-time limit of {cfg.cpu_time_s} s exceeded (killed by SIGXCPU)"
        if sig == signal.SIGSEGV:
            return "crashed with SIGSEGV (stack overflow, e.g. from too deep recursion)"
        if sig == signal.SIGXFSZ:
            return f"file-size limit of {cfg.max_file_size_mb} MiB exceeded (SIGXFSZ)"
        return f"killed by {name}"
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"exited with status {code}: {last}" if last else f"exited with status {code}"


class PythonSandbox:
    """Runs code under `SandboxConfig`; `check()` first decides which isolation is possible."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.flags = _unshare_flags(config.allow_network)
        reason = _unshare_works(tuple(self.flags))
        if reason is None:
            self.namespaced = True
        elif config.allow_network:
            self.namespaced = False
        else:
            raise ToolError(
                f"python tool: cannot isolate the network: {reason}. Install util-linux and run where "
                f"namespaces are allowed, or set allow_network: true in the tool's config to run "
                f"without network isolation (and without a PID namespace)"
            )
        # one semaphore per event loop: an asyncio.Semaphore binds to the loop it first waits in,
        # and callers may run several loops over the tool's life (asyncio.run per step)
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        python = os.path.realpath(config.python or sys.executable)
        prefix = (
            os.path.realpath(sys.base_prefix)
            if config.python is None
            else os.path.dirname(os.path.dirname(python))
        )
        site_dirs = list(
            dict.fromkeys(
                os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")
            )
        )
        if config.python is not None:
            site_dirs = []
        if self.namespaced:
            self.binds = [(prefix, "/mnt/tephra/python")] + [
                (d, f"/mnt/tephra/site{i}") for i, d in enumerate(site_dirs)
            ]
            self.python = "/mnt/tephra/python/" + os.path.relpath(python, prefix)
            self.site_dirs = [tgt for _, tgt in self.binds[1:]]
        else:
            self.binds, self.python, self.site_dirs = [], python, site_dirs

    def new_uid(self) -> int | None:
        """A fresh unprivileged uid when we can switch (root), else None (keep ours)."""
        if os.geteuid() != 0 or not self.namespaced:
            return None
        return self.config.uid_base + secrets.randbelow(1_000_000)

    def _bootstrap_config(self, workdir: str, uid: int | None) -> dict[str, Any]:
        c = self.config
        cpu = int(c.cpu_time_s)
        mem = c.memory_mb * 2**20
        fsize = c.max_file_size_mb * 2**20
        return {
            "mounts": self.namespaced,
            "workdir": workdir,
            "cwd": "/tmp" if self.namespaced else workdir,
            "tmpfs_bytes": fsize,
            "binds": self.binds,
            "uid": uid,
            "python": self.python,
            "site_dirs": self.site_dirs,
            "wrapper": _WRAPPER,
            "env": dict(_SANDBOX_ENV, HOME="/tmp" if self.namespaced else workdir),
            "rlimits": [
                ("RLIMIT_CPU", cpu, cpu + 1),
                ("RLIMIT_AS", mem, mem),
                ("RLIMIT_NPROC", c.max_processes, c.max_processes),
                ("RLIMIT_FSIZE", fsize, fsize),
                ("RLIMIT_NOFILE", c.max_open_files, c.max_open_files),
                ("RLIMIT_CORE", 0, 0),
            ],
        }

    async def run(self, code: str, workdir: str, uid: int | None) -> SandboxRun:
        """Write `code` to workdir/main.py and run it; never raises for anything the code does."""
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        if uid is not None:
            for root, dirs, files in os.walk(workdir):
                for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                    os.lchown(name, uid, uid)
        boot = [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _BOOTSTRAP,
            json.dumps(self._bootstrap_config(workdir, uid)),
        ]
        cmd = (
            [shutil.which("unshare") or "unshare", *self.flags, "--", *boot]
            if self.namespaced
            else boot
        )
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.config.max_concurrent)
        async with self._semaphores[loop]:
            return await self._run_capped(cmd)

    async def _run_capped(self, cmd: list[str]) -> SandboxRun:
        cap = self.config.max_output_bytes
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
        total = 0
        overflow = timed_out = False

        def kill_group() -> None:
            # Kill the namespace's init first: `unshare` then reaps it only after the kernel has
            # removed every process of the namespace, so `proc.wait()` returning means all are
            # gone. The process-group kill is the backstop (and the whole story without a PID
            # namespace).
            if self.namespaced:
                try:
                    children = (
                        Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                    )
                except OSError:
                    children = []
                for child in children:
                    try:
                        os.kill(int(child), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            else:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        async def pump(stream: asyncio.StreamReader, key: str) -> None:
            # Reads to EOF even past the cap (discarding): the transport closes itself only
            # once both pipes are drained and the process has exited.
            nonlocal total, overflow
            while chunk := await stream.read(65536):
                bufs[key] += chunk[: max(0, cap - total)]
                total += len(chunk)
                if total > cap and not overflow:
                    overflow = True
                    kill_group()

        pumps = [
            asyncio.ensure_future(pump(proc.stdout, "out")),
            asyncio.ensure_future(pump(proc.stderr, "err")),
        ]
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.gather(*pumps, proc.wait())), self.config.timeout_s
            )
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                kill_group()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            # every writer is dead now, so the pipes reach EOF promptly
            _, pending = await asyncio.wait(pumps, timeout=10)
            for task in pending:
                task.cancel()
        stdout = bufs["out"].decode(errors="replace")
        stderr = bufs["err"].decode(errors="replace")
        code = proc.returncode
        if timed_out:
            error = f"wall-time limit of {self.config.timeout_s} s exceeded; the process group was killed"
        elif overflow:
            error = f"output limit of {cap} bytes exceeded; the process group was killed"
        else:
            error = _describe_exit(code, stderr, self.config)
        return SandboxRun(stdout, stderr, code, error, time.monotonic() - start, total)


@TOOLS.register("python")
class PythonTool(Tool):
    """Runs Python code in the sandbox and returns what it printed.

    Each trajectory (instance) has its own working directory that persists across its calls,
    so files written in one call can be read in the next; the interpreter state does not.
    """

    name = "python"
    description = (
        "Run a Python 3 program and return its standard output and errors. Use print() to see "
        "values. No network access; the working directory is private to this conversation."
    )
    parameters = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The complete Python program to run."}
        },
        "required": ["code"],
    }

    def __init__(self, name: str = "python", **config: Any) -> None:
        self.name = name
        known = {f for f in SandboxConfig.__dataclass_fields__}
        unknown = set(config) - known
        if unknown:
            raise ConfigError(
                f"python tool: unknown config keys {sorted(unknown)}; known: {sorted(known)}"
            )
        self.config = SandboxConfig(**config)
        self.sandbox = PythonSandbox(self.config)
        self._instances: dict[str, tuple[str, int | None]] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        if instance_id in self._instances:
            return
        workdir = tempfile.mkdtemp(prefix="tephra-sandbox-", dir=self.config.workdir_root)
        self._instances[instance_id] = (workdir, self.sandbox.new_uid())

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("", error="argument 'code' (a string holding the program) is missing")
        if instance_id not in self._instances:
            await self.create(instance_id)
        workdir, uid = self._instances[instance_id]
        run = await self.sandbox.run(code, workdir, uid)
        text = run.stdout + (run.stderr if run.stderr else "")
        metrics = {"wall_s": run.wall_s, "output_bytes": float(run.output_bytes)}
        return ToolResult(text, error=run.error, metrics=metrics)

    async def release(self, instance_id: str) -> None:
        entry = self._instances.pop(instance_id, None)
        if entry is not None:
            shutil.rmtree(entry[0], ignore_errors=True)

    def close(self) -> None:
        """Remove the working directories of trajectories never released (no sandbox process
        outlives its call, so there is nothing else to stop)."""
        for workdir, _ in self._instances.values():
            shutil.rmtree(workdir, ignore_errors=True)
        self._instances.clear()

    def describe(self) -> dict[str, Any]:
        return {"namespaced": self.sandbox.namespaced, **asdict(self.config)}


__all__ = ["PythonSandbox", "PythonTool", "SandboxConfig", "SandboxRun"]
