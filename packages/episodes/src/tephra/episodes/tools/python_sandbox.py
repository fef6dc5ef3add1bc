"""The `python` tool: model-written code run in a sandbox.

One sandbox for both kinds of caller, root or an ordinary user; each layer is tested in
tests/test_tools_python_sandbox.py, and the test file runs again as an unprivileged user:
- namespaces (`unshare` from util-linux): network (only a downed loopback: no connection, not
  even to 127.0.0.1, and no abstract Unix socket of the host), PID (its init is
  `sandbox_init.py`; when it exits the kernel kills every process left, daemons included),
  mount, UTS (host name `sandbox`) and IPC (SysV objects die with the call; the init sets the
  namespace's limits low: few, small message queues and semaphore sets, shared memory capped
  at the call's memory limit). An ordinary user gets them inside a user namespace of their own;
- a new root (`pivot_root`): only the system folders (`/usr`, `/lib`, ...), the interpreter and
  its site-packages, read-only and nosuid, a minimal `/dev` and `/etc`, the namespace's own
  `/proc` (which hides the init), and the trajectory's folder on `/tmp`, the one writable place
  besides small private tmpfs on `/var/tmp`, `/dev/shm`, `/run/lock`. The caller's home, the
  repository, host sockets and every other host path do not exist inside;
- the code runs as a non-root uid without capabilities: as root a fresh unprivileged uid per
  trajectory; as an ordinary user uid 1000 of a nested user namespace (mapped to the caller);
- a seccomp filter (libseccomp), the same in both modes: mounts, namespaces, keyrings, bpf,
  perf, ptrace, io_uring, userfaultfd, modify_ldt, memfd_create, memfd_secret, setting the
  personality, sockets other than Unix, IPv4, IPv6 and route netlink, and changing another
  process's limits or scheduling are refused;
- rlimits per process (CPU, address space, processes, file size, open files), an aggregate
  memory limit for the whole call (resident memory of all its processes plus the pages of its
  tmpfs folders and SysV shared memory; and a memory cgroup per call where the host lets us
  make one), wall time and output caps on the host side;
- a folder quota enforced during the call: as root the trajectory's folder is a tmpfs of
  `disk_quota_mb`; otherwise the init mounts such a tmpfs on the call's `/tmp`, fills it from
  the trajectory's folder and copies it back after the call, once every process of the call
  is gone. The calls of one trajectory run one at a time, so no host-side walk of its folder
  ever runs beside its code, and the walks run in a thread, off the event loop;
- the program travels through a pipe: the host never opens a path the code could have planted.
Where a layer cannot be had the tool refuses to start with a message naming what is missing,
unless `accept_missing` names it. The package README's security table says what each
protection relies on, for root and for an ordinary user.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, cast

from tephra.core.errors import ConfigError
from tephra.episodes.tools.base import Tool, ToolError, ToolResult
from tephra.episodes.tools.folder_tree import empty_tree, remove_tree, tree_usage
from tephra.episodes.tools.memory_cgroup import MemoryCgroup, parent_cgroup

_INIT = str(Path(__file__).with_name("sandbox_init.py"))

# What the code may not call (EPERM), beyond namespace flags of clone, clone3 (ENOSYS) and
# setting the personality, which sandbox_init.py adds: mounts and namespaces (no nested user
# namespace to mount in), kernel surfaces code has no use for and that served exploits
# (Docker's default profile refuses the io_uring, userfaultfd and modify_ldt calls too), and
# memfd files, whose pages no process's resident memory would count.
SECCOMP_DENIED = (
    "mount",
    "umount",
    "umount2",
    "unshare",
    "setns",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "open_tree",
    "move_mount",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "modify_ldt",
    "memfd_create",
    "memfd_secret",
    "open_by_handle_at",
)
# the uid the code has inside its user namespace when the caller is not root
SANDBOX_UID = 1000
# the call's IPC namespace (/proc/sys/...), beside the shared-memory caps set from
# `total_memory_mb`: 8 message queues of 16 KiB (a queue holds at most as many messages as
# bytes, so about 12 MiB of kernel memory in the worst case; Linux's defaults allow 32000
# queues), 32 semaphore sets of 32, and few POSIX queues (their bytes bounded by
# RLIMIT_MSGQUEUE)
IPC_LIMITS = {
    "kernel/msgmni": 8,
    "kernel/msgmnb": 16384,
    "kernel/msgmax": 8192,
    "kernel/sem": "32 1024 32 32",  # per set, in all, per semop call, sets
    "kernel/shmmni": 64,
    "fs/mqueue/queues_max": 8,
    "fs/mqueue/msg_max": 10,
    "fs/mqueue/msgsize_max": 8192,
}
# bytes of POSIX message queues (RLIMIT_MSGQUEUE), under Linux's default of 800 KiB
_MSGQUEUE_BYTES = 1 << 19
# protections a host may lack, which `accept_missing` can name to run without them
WEAKER_MODES = ("namespaces", "seccomp")
_PRIVATE_TMPFS = ("/var/tmp", "/dev/shm", "/run/lock")
# the kernel's limit (a memory cgroup, where the host gives one) sits this far above
# `total_memory_mb`, for the init's own memory: the sampled limit, with its clearer message,
# normally speaks first, and the cgroup stops what sampling cannot see or is too slow for
_CGROUP_SLACK = 32 * 2**20

# Runs as the sandbox uid: read the program from stdin (the host never writes a file the code
# could have replaced), make the bound site-packages importable, run it as __main__.
_WRAPPER = r"""
import os, site, sys
chunks = []
while chunk := os.read(0, 1 << 16):
    chunks.append(chunk)
src = b"".join(chunks).decode()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
for d in sys.argv[1:]:
    site.addsitedir(d)
sys.argv = ["main.py"]
sys.path.insert(0, "")
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
    total_memory_mb: int = 1024
    """Resident memory of all the call's processes together, in MiB; past it every process of
    the call is killed (needs the PID namespace; `memory_mb` still bounds each process)."""
    disk_quota_mb: int = 64
    """Size of the trajectory's folder in MiB: a tmpfs of this size (its pages count as the
    call's memory too)."""
    max_files: int = 4096
    """Files and folders the trajectory's folder may hold (the tmpfs's inodes)."""
    max_output_bytes: int = 65536
    """Bytes of stdout + stderr read before the run is killed as too chatty."""
    max_concurrent: int = 4
    """Sandboxes one tool object runs at once (further calls wait): protects small hosts."""
    allow_network: bool = False
    """Run without a network namespace (the code can reach the network and the host's
    abstract Unix sockets). False (default): every call gets a network namespace of its own."""
    accept_missing: list[str] = field(default_factory=list)
    """Protections this host may lack that you accept running without, by name: 'namespaces'
    (no unshare allowed: then only rlimits, a process group and the scrubbed environment; the
    code sees the host's files and network) or 'seccomp' (libseccomp not installed: no system
    call filter). Empty (default): the tool refuses to start, naming what is missing."""
    python: str | None = None
    """Interpreter for the code; defaults to the one running tephra (its site-packages are
    importable, e.g. sympy or numpy when installed)."""
    uid_base: int = 100000
    """When run as root, each sandbox instance gets a random uid in [uid_base, uid_base+10^6):
    unprivileged, owns nothing on the host, and makes RLIMIT_NPROC count only its processes."""
    workdir_root: str | None = None
    """Where per-instance working directories are created (default: the system temp dir).
    As an ordinary user each call copies the folder in and out (a few metadata operations
    per entry): a tmpfs such as /dev/shm keeps that cheap for folders with many entries."""

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
            "total_memory_mb",
            "disk_quota_mb",
            "max_files",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"python tool: {name}={getattr(self, name)!r} must be > 0")
        unknown = sorted(set(self.accept_missing) - set(WEAKER_MODES))
        if unknown:
            raise ConfigError(
                f"python tool: accept_missing={self.accept_missing!r}: {unknown} "
                f"are not protections one can do without; choose from "
                f"{list(WEAKER_MODES)}"
            )
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


@cache
def _libseccomp() -> str | None:
    """Path of libseccomp's shared library, or None where it is not installed."""
    return ctypes.util.find_library("seccomp")


def _unshare_flags(allow_network: bool) -> list[str]:
    flags = [
        "--fork",
        "--kill-child",
        "--pid",
        "--mount-proc",
        "--mount",
        "--propagation",
        "private",
        "--ipc",
        "--uts",
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
    """Runs code under `SandboxConfig`; the constructor decides what isolation this host
    gives and refuses to start without a protection that `accept_missing` does not name."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.flags = _unshare_flags(config.allow_network)
        reason = _unshare_works(tuple(self.flags))
        self.namespaced = reason is None
        if reason is not None and "namespaces" not in config.accept_missing:
            raise ToolError(
                f"python tool: cannot create the sandbox's namespaces: {reason}. Run where "
                f"util-linux's unshare may create {'user, ' if os.geteuid() else ''}PID, mount, "
                f"IPC and network namespaces (for an ordinary user: unprivileged user namespaces "
                f"enabled, e.g. sysctl kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu), "
                f"or set accept_missing: [namespaces] in the tool's config to run with rlimits and "
                f"a process group only (the code then sees the host's files and network)"
            )
        self.seccomp = _libseccomp()
        if self.seccomp is None and "seccomp" not in config.accept_missing:
            raise ToolError(
                "python tool: libseccomp is not installed, so no system call filter can be "
                "loaded. Install it (Debian/Ubuntu: apt install libseccomp2; Fedora: dnf install "
                "libseccomp), or set accept_missing: [seccomp] in the tool's config to run "
                "without the filter"
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

    @property
    def identity(self) -> str:
        """How the code is kept from the caller's rights: 'switch_uid' (root: a fresh
        unprivileged uid), 'user_namespace' (an ordinary user: uid 1000 of a nested user
        namespace) or 'none' (no namespaces, accepted by name: the caller's own uid)."""
        if not self.namespaced:
            return "none"
        return "switch_uid" if os.geteuid() == 0 else "user_namespace"

    def new_uid(self) -> int | None:
        """A fresh unprivileged uid when we can switch (root), else None (keep ours)."""
        if self.identity != "switch_uid":
            return None
        return self.config.uid_base + secrets.randbelow(1_000_000)

    def _bootstrap_config(self, workdir: str, uid: int | None) -> dict[str, Any]:
        c = self.config
        cpu = int(c.cpu_time_s)
        mem = c.memory_mb * 2**20
        fsize = c.max_file_size_mb * 2**20
        counted = [d for d in _PRIVATE_TMPFS if os.path.isdir(d)]
        # the call's /tmp is a tmpfs in both modes (the host's, or the init's copy): its pages
        # are memory
        mounted = os.path.ismount(workdir)
        if self.namespaced:
            counted.append("/tmp")
        memory = c.total_memory_mb * 2**20
        page = os.sysconf("SC_PAGE_SIZE")
        hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)[1]
        msgqueue = _MSGQUEUE_BYTES if hard == resource.RLIM_INFINITY else min(hard, _MSGQUEUE_BYTES)
        return {
            "namespaced": self.namespaced,
            "identity": self.identity,
            "code_uid": uid if uid is not None else SANDBOX_UID,
            "seccomp": self.seccomp,
            "seccomp_denied": SECCOMP_DENIED,
            "total_memory_bytes": c.total_memory_mb * 2**20,
            "counted_tmpfs": counted,
            "private_tmpfs": [d for d in _PRIVATE_TMPFS if os.path.isdir(d)],
            "workdir": workdir,
            # 0: the host's tmpfs is the folder; else the size of the init's copy
            "folder_bytes": 0 if mounted else c.disk_quota_mb * 2**20,
            "folder_inodes": c.max_files,
            "ipc_limits": {
                **IPC_LIMITS,
                "kernel/shmmax": memory,
                "kernel/shmall": memory // page,
            },
            "cwd": "/tmp" if self.namespaced else workdir,
            "tmpfs_bytes": fsize,
            "binds": self.binds,
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
                ("RLIMIT_MSGQUEUE", msgqueue, msgqueue),
            ],
        }

    def make_workdir(self, uid: int | None) -> tuple[str, bool]:
        """A fresh folder for one trajectory, owned by `uid`; as root it is a tmpfs of
        `disk_quota_mb` and `max_files` inodes (the kernel enforces the quota). Returns the
        folder and whether it is such a mount."""
        c = self.config
        workdir = tempfile.mkdtemp(prefix="tephra-sandbox-", dir=c.workdir_root)
        if os.geteuid() == 0 and self.namespaced:
            owner = f",uid={uid},gid={uid}" if uid is not None else ""
            done = subprocess.run(
                [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={c.disk_quota_mb}m,nr_inodes={c.max_files},mode=0700,nosuid,nodev{owner}",
                    "tmpfs",
                    workdir,
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode == 0:
                return workdir, True
        if uid is not None:
            os.chown(workdir, uid, uid)  # the host made it: nothing inside to follow yet
        return workdir, False

    @staticmethod
    def remove_workdir(workdir: str, mounted: bool) -> None:
        """Unmount and remove a trajectory's folder, whatever the code left in it (deep
        trees, many files, folders it made unreadable); never follows a link."""
        if mounted:
            subprocess.run(["umount", workdir], capture_output=True, timeout=30)
            if os.path.ismount(workdir):  # still busy: detach it so no mount outlives us
                subprocess.run(["umount", "-l", workdir], capture_output=True, timeout=30)
        remove_tree(workdir)

    def check_quota(self, workdir: str) -> str | None:
        """Without namespaces (accepted by name) there is no tmpfs: the quota is checked after
        each call (the folder is emptied when the call went past it); None when within. The
        walk stops counting once past `max_files`; it blocks, so callers run it in a thread."""
        c = self.config
        size, count = tree_usage(workdir, max_entries=c.max_files)
        if size <= c.disk_quota_mb * 2**20 and count <= c.max_files:
            return None
        empty_tree(workdir)
        return (
            f"the folder quota of {c.disk_quota_mb} MiB / {c.max_files} files was exceeded "
            f"({size >> 20} MiB, {count if count <= c.max_files else f'over {c.max_files}'} "
            f"files); the folder was emptied"
        )

    async def run(self, code: str, workdir: str, uid: int | None) -> SandboxRun:
        """Run `code` (sent through stdin) in `workdir`; never raises for anything the code
        does, and never opens a path inside `workdir`."""
        cfg = self._bootstrap_config(workdir, uid)
        group = (
            MemoryCgroup.create(cfg["total_memory_bytes"] + _CGROUP_SLACK)
            if self.namespaced
            else None
        )
        cfg["cgroup_procs"] = group.procs if group is not None else None
        boot = [sys.executable, "-I", "-S", _INIT, json.dumps(cfg)]
        cmd = (
            [shutil.which("unshare") or "unshare", *self.flags, "--", *boot]
            if self.namespaced
            else boot
        )
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.config.max_concurrent)
        async with self._semaphores[loop]:
            try:
                run = await self._run_capped(cmd, code.encode())
            finally:
                killed = group.oom_kills() if group is not None else 0
                if group is not None:
                    group.remove()
        if killed and (run.error is None or "over the limit" not in run.error):
            run.error = (
                f"the call's processes went over the memory limit of "
                f"{self.config.total_memory_mb} MiB together; the kernel's memory "
                f"cgroup killed {killed} of them"
            )
        return run

    async def _run_capped(self, cmd: list[str], program: bytes) -> SandboxRun:  # noqa: C901, PLR0915 (older than the limit; to split)
        cap = self.config.max_output_bytes
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
        total = 0
        overflow = timed_out = False

        def kill_group(sig: int = signal.SIGKILL) -> None:
            # Kill the namespace's init first: `unshare` then reaps it only after the kernel has
            # removed every process of the namespace, so `proc.wait()` returning means all are
            # gone. SIGTERM first: the init exits at once on it (a SIGKILLed init makes
            # `unshare` print noise); SIGKILL is the backstop, and the process-group kill the
            # backstop's backstop (and the whole story without a PID namespace).
            if self.namespaced:
                try:
                    children = (
                        Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                    )
                except OSError:
                    children = []
                for child in children:
                    try:
                        os.kill(int(child), sig)
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
                    kill_group(signal.SIGTERM)

        async def feed() -> None:
            # under the call's timeout like every host step: a program that never reads its
            # stdin cannot block the host
            try:
                cast(asyncio.StreamWriter, proc.stdin).write(program)
                await cast(asyncio.StreamWriter, proc.stdin).drain()
                cast(asyncio.StreamWriter, proc.stdin).close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        pumps = [
            asyncio.ensure_future(pump(cast(asyncio.StreamReader, proc.stdout), "out")),
            asyncio.ensure_future(pump(cast(asyncio.StreamReader, proc.stderr), "err")),
            asyncio.ensure_future(feed()),
        ]
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.gather(*pumps, proc.wait())), self.config.timeout_s
            )
        except TimeoutError:
            timed_out = True
        finally:
            for sig, grace in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
                if proc.returncode is None:
                    kill_group(sig)
                    try:
                        await asyncio.wait_for(proc.wait(), grace)
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
        code = cast(int, proc.returncode)  # set: the process was awaited above
        error: str | None
        if timed_out:
            error = f"wall-time limit of {self.config.timeout_s} s exceeded; the process group was killed"
        elif overflow:
            error = f"output limit of {cap} bytes exceeded; the process group was killed"
        else:
            error = _describe_exit(code, stderr, self.config)
        return SandboxRun(stdout, stderr, code, error, time.monotonic() - start, total)


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
        self._instances: dict[str, tuple[str, int | None, bool]] = {}
        # per event loop, per trajectory: its calls, and its release, run one at a time (an
        # asyncio.Lock binds to the loop it first waits in)
        self._locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # folders (and, as root, tmpfs mounts) of trajectories never released are removed when
        # the tool is collected or the interpreter exits, even if nobody calls close()
        self._finalizer = weakref.finalize(self, _remove_all, self._instances)

    @contextlib.asynccontextmanager
    async def _alone(self, instance_id: str) -> AsyncIterator[None]:
        """Hold the trajectory: its folder is the code's (one call at a time, the init copying
        it in and out) or the host's (a walk), never both."""
        loop = asyncio.get_running_loop()
        locks = self._locks.setdefault(loop, {})
        lock = locks.setdefault(instance_id, asyncio.Lock())
        async with lock:
            yield

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        async with self._alone(instance_id):
            if instance_id in self._instances:
                return
            uid = self.sandbox.new_uid()
            workdir, mounted = await asyncio.to_thread(self.sandbox.make_workdir, uid)
            self._instances[instance_id] = (workdir, uid, mounted)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("", error="argument 'code' (a string holding the program) is missing")
        await self.create(instance_id)
        async with self._alone(instance_id):
            workdir, uid, _ = self._instances[instance_id]
            run = await self.sandbox.run(code, workdir, uid)
            error = run.error
            if not self.sandbox.namespaced:
                error = await asyncio.to_thread(self.sandbox.check_quota, workdir) or error
        text = run.stdout + (run.stderr if run.stderr else "")
        metrics = {"wall_s": run.wall_s, "output_bytes": float(run.output_bytes)}
        return ToolResult(text, error=error, metrics=metrics)

    async def release(self, instance_id: str) -> None:
        async with self._alone(instance_id):
            entry = self._instances.pop(instance_id, None)
            if entry is not None:
                await asyncio.to_thread(self.sandbox.remove_workdir, entry[0], entry[2])
        for locks in self._locks.values():
            locks.pop(instance_id, None)

    def close(self) -> None:
        """Remove the working directories of trajectories never released (no sandbox process
        outlives its call, so there is nothing else to stop)."""
        _remove_all(self._instances)

    def describe(self) -> dict[str, Any]:
        """What isolation this host gave the tool, then its limits."""
        group = parent_cgroup() if self.sandbox.namespaced else None
        return {
            "namespaced": self.sandbox.namespaced,
            "seccomp": self.sandbox.seccomp is not None,
            "identity": self.sandbox.identity,
            "memory_cgroup": group[0] if group is not None else None,
            **asdict(self.config),
        }


def _remove_all(instances: dict[str, tuple[str, int | None, bool]]) -> None:
    for workdir, _, mounted in instances.values():
        PythonSandbox.remove_workdir(workdir, mounted)
    instances.clear()


__all__ = ["PythonSandbox", "PythonTool", "SandboxConfig", "SandboxRun"]
