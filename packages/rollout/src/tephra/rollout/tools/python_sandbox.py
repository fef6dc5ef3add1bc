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
  killing the whole process group (and so the namespace) when either is exceeded;
- the host never opens a path inside the call's folder: the code reaches the sandbox through a
  pipe (stdin), so a symbolic link or FIFO the code left there cannot redirect or block the
  host, and every host-side step of a call runs under its wall-time limit;
- a new IPC namespace per call, so SysV shared memory, semaphores and message queues die with
  the call and no trajectory reaches another's;
- an aggregate memory limit for the whole call: the namespace's init sums the resident memory
  of every process in it every 20 ms and kills them all past `total_memory_mb` (per-process
  RLIMIT_AS alone lets N forked children use N times the limit);
- a quota on the call's folder: as root it is a tmpfs of `disk_quota_mb` and `max_files`
  inodes, mounted for the trajectory's life (the kernel refuses writes past it);
- a seccomp filter (libseccomp, loaded after the uid switch) refusing mount, namespace
  creation (unshare, setns, clone with namespace flags, clone3), keyrings, bpf, perf and
  ptrace, so the code cannot build user namespaces and mount inside them.
Without working namespaces the tool refuses to start, unless `allow_network=True` says that a
weaker sandbox (process group + rlimits only) is acceptable. See the package README's
security section for what each protection relies on and what happens where it is missing.
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
def seccomp_filter(lib_path):
    # refuse (EPERM) what builds namespaces or mounts; clone3 gets ENOSYS so that libc falls
    # back to clone, whose namespace flags the filter can see
    lib = ctypes.CDLL(lib_path, use_errno=True)
    class Arg(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                    ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    if not ctx:
        raise OSError("seccomp_init failed")
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    def rule(action, name, *args):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return
        if lib.seccomp_rule_add(ctypes.c_void_p(ctx), ctypes.c_uint32(action), ctypes.c_int(nr),
                                ctypes.c_uint(len(args)), *args) != 0:
            raise OSError("seccomp_rule_add(%s) failed" % name)
    for name in ("mount", "umount2", "umount", "unshare", "setns", "pivot_root", "chroot",
                 "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "ptrace",
                 "fsopen", "fsmount", "open_tree", "move_mount"):
        rule(eperm, name)
    rule(enosys, "clone3")
    for flag in (0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x08000000, 0x04000000,
                 0x02000000):  # NEWUSER NEWNS NEWNET NEWPID NEWIPC NEWUTS NEWCGROUP
        rule(eperm, "clone", Arg(0, 7, flag, flag))  # SCMP_CMP_MASKED_EQ on the flags
    if lib.seccomp_load(ctypes.c_void_p(ctx)) != 0:
        raise OSError("seccomp_load failed")
pid = os.fork()
if pid == 0:
    try:
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        if cfg["seccomp"]:
            seccomp_filter(cfg["seccomp"])
        os.chdir(cfg["cwd"])
        os.execve(cfg["python"], [cfg["python"], "-I", "-c", cfg["wrapper"], *cfg["site_dirs"]], cfg["env"])
    except BaseException as exc:
        os.write(2, ("sandbox setup failed: %r\n" % (exc,)).encode())
        os._exit(125)
os.close(0)  # the code reads its program from stdin; init holds no copy of the pipe
status = None
if cfg["mounts"] and cfg["total_memory_bytes"]:
    # init of the PID namespace: reap every orphan, and kill everything when the resident
    # memory of all the namespace's processes together passes the limit
    import time
    page = os.sysconf("SC_PAGE_SIZE")
    while status is None:
        while True:
            try:
                done, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                done = 0
            if done == 0:
                break
            if done == pid:
                status = st
        if status is not None:
            break
        total = 0
        for entry in os.listdir("/proc"):
            if entry.isdigit() and entry != "1":
                try:
                    with open("/proc/%s/statm" % entry) as f:
                        total += int(f.read().split()[1]) * page
                except (OSError, IndexError, ValueError):
                    pass
        if total > cfg["total_memory_bytes"]:
            os.kill(-1, 9)
            os.write(2, ("\nsandbox: the call's processes held %d MiB of memory together, over "
                         "the limit of %d MiB; all were killed\n"
                         % (total >> 20, cfg["total_memory_bytes"] >> 20)).encode())
            os._exit(124)
        time.sleep(0.02)
else:
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
    """Size of the trajectory's folder in MiB (as root: a tmpfs of this size)."""
    max_files: int = 4096
    """Files and folders the trajectory's folder may hold (as root: the tmpfs's inodes)."""
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
            "total_memory_mb",
            "disk_quota_mb",
            "max_files",
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


@cache
def _libseccomp() -> str | None:
    """Path of libseccomp's shared library, or None where it is not installed."""
    import ctypes.util

    return ctypes.util.find_library("seccomp")


def _folder_usage(folder: str) -> tuple[int, int]:
    """(bytes, entries) under `folder`, from lstat only: nothing is opened or followed."""
    size = count = 0
    stack = [folder]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                count += 1
                st = entry.stat(follow_symlinks=False)
                size += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return size, count


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
            "seccomp": _libseccomp() if self.namespaced and os.geteuid() == 0 else None,
            "total_memory_bytes": c.total_memory_mb * 2**20,
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

    def make_workdir(self, uid: int | None) -> tuple[str, bool]:
        """A fresh folder for one trajectory, owned by `uid`; as root it is a tmpfs of
        `disk_quota_mb` and `max_files` inodes (the kernel enforces the quota). Returns the
        folder and whether it is such a mount."""
        c = self.config
        workdir = tempfile.mkdtemp(prefix="tephra-sandbox-", dir=c.workdir_root)
        if os.geteuid() == 0 and self.namespaced:
            owner = f",uid={uid},gid={uid}" if uid is not None else ""
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o",
                 f"size={c.disk_quota_mb}m,nr_inodes={c.max_files},mode=0700,nosuid,nodev{owner}",
                 "tmpfs", workdir], capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                return workdir, True
        if uid is not None:
            os.chown(workdir, uid, uid)  # the host made it: nothing inside to follow yet
        return workdir, False

    @staticmethod
    def remove_workdir(workdir: str, mounted: bool) -> None:
        if mounted:
            subprocess.run(["umount", "-l", workdir], capture_output=True, timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)  # never follows links

    def check_quota(self, workdir: str) -> str | None:
        """Without a tmpfs, the quota is checked after each call (the folder is emptied when
        the call went past it); None when within."""
        c = self.config
        size, count = _folder_usage(workdir)
        if size <= c.disk_quota_mb * 2**20 and count <= c.max_files:
            return None
        for entry in os.scandir(workdir):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        return (f"the folder quota of {c.disk_quota_mb} MiB / {c.max_files} files was exceeded "
                f"({size >> 20} MiB, {count} files); the folder was emptied")

    async def run(self, code: str, workdir: str, uid: int | None) -> SandboxRun:
        """Run `code` (sent through stdin) in `workdir`; never raises for anything the code
        does, and never opens a path inside `workdir`."""
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
            return await self._run_capped(cmd, code.encode())

    async def _run_capped(self, cmd: list[str], program: bytes) -> SandboxRun:
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

        async def feed() -> None:
            # under the call's timeout like every host step: a program that never reads its
            # stdin cannot block the host
            try:
                proc.stdin.write(program)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        pumps = [
            asyncio.ensure_future(pump(proc.stdout, "out")),
            asyncio.ensure_future(pump(proc.stderr, "err")),
            asyncio.ensure_future(feed()),
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
        self._instances: dict[str, tuple[str, int | None, bool]] = {}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        if instance_id in self._instances:
            return
        uid = self.sandbox.new_uid()
        workdir, mounted = self.sandbox.make_workdir(uid)
        self._instances[instance_id] = (workdir, uid, mounted)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("", error="argument 'code' (a string holding the program) is missing")
        if instance_id not in self._instances:
            await self.create(instance_id)
        workdir, uid, mounted = self._instances[instance_id]
        run = await self.sandbox.run(code, workdir, uid)
        text = run.stdout + (run.stderr if run.stderr else "")
        metrics = {"wall_s": run.wall_s, "output_bytes": float(run.output_bytes)}
        error = run.error
        if not mounted:
            error = self.sandbox.check_quota(workdir) or error
        return ToolResult(text, error=error, metrics=metrics)

    async def release(self, instance_id: str) -> None:
        entry = self._instances.pop(instance_id, None)
        if entry is not None:
            self.sandbox.remove_workdir(entry[0], entry[2])

    def close(self) -> None:
        """Remove the working directories of trajectories never released (no sandbox process
        outlives its call, so there is nothing else to stop)."""
        for workdir, _, mounted in self._instances.values():
            self.sandbox.remove_workdir(workdir, mounted)
        self._instances.clear()

    def describe(self) -> dict[str, Any]:
        return {"namespaced": self.sandbox.namespaced,
                "seccomp": bool(_libseccomp()) and self.sandbox.namespaced and os.geteuid() == 0,
                **asdict(self.config)}


__all__ = ["PythonSandbox", "PythonTool", "SandboxConfig", "SandboxRun"]
