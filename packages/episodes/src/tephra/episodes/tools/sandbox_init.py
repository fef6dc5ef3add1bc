"""The python sandbox's init: run as PID 1 of a fresh PID namespace (standard library only).

`python -I -S sandbox_init.py CONFIG_JSON`, started by `unshare` as root of its mount namespace
(really root, or root of a user namespace mapped to the caller). It sets low limits on the
call's IPC namespace, builds a new root holding only the read-only interpreter, its libraries
and the call's writable folder (a tmpfs of the folder quota, filled from the trajectory's
folder on the host and copied back once every process of the call is gone, unless the host
already made the folder a tmpfs), pivots into it, forks the code's process (a non-root uid
without capabilities, rlimits and a seccomp filter set), watches the memory of every process
of the call, and exits with the code's status (128 + signal for a signal); as the namespace's
init, its exit makes the kernel kill every process left. Setup failures exit 125 with one line
on stderr starting "sandbox setup failed".
"""

import ctypes
import importlib.util
import json
import os
import resource
import signal
import sys
import time

# the folder walks of tephra's host side (standard library only), loaded by path before the
# pivot hides the file: `-I -S` leaves the script's folder off sys.path
_spec = importlib.util.spec_from_file_location(
    "folder_tree", os.path.join(os.path.dirname(os.path.abspath(__file__)), "folder_tree.py")
)
assert _spec is not None and _spec.loader is not None
folder_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(folder_tree)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# mount flags a user namespace may not clear on a bind it inherited: kept on remount
MS_LOCKABLE = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + NOATIME DIRATIME RELATIME
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
CLONE_NEWUSER = 0x10000000
# pivot_root has no libc wrapper: its number per architecture
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
# system folders the interpreter and common programs need; nothing else of the host is visible
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
NEW_ROOT = "/mnt"

# socket families the code may make: Unix, IPv4, IPv6, and netlink for routes only (getaddrinfo,
# if_nameindex); vsock crosses the network namespace, uevent netlink hears the host's devices
ALLOWED_FAMILIES = (1, 2, 10, 16)  # AF_UNIX AF_INET AF_INET6 AF_NETLINK
AF_NETLINK, NETLINK_ROUTE = 16, 0
# seccomp_rule_add's comparisons
CMP_NE, CMP_EQ, CMP_GE, CMP_MASKED_EQ = 1, 4, 5, 7

libc = ctypes.CDLL(None, use_errno=True)
cfg: dict = {}  # the host's settings for this call (argv[1]), read by every step below
folder_fd = -1  # the trajectory's folder on the host, when the call's /tmp is a copy of it


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def mount(
    src: str | None, tgt: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)), f"mount {src} on {tgt}")


def bind(src: str, tgt: str, writable: bool = False, devices: bool = False) -> None:
    """Bind `src` (a path, or /proc/self/fd/N) on `tgt` inside the new root: nosuid, read-only
    unless `writable`, nodev unless `devices`; not recursive, so mounts below the source stay
    hidden."""
    if os.path.isdir(src):
        os.makedirs(tgt, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(tgt), exist_ok=True)
        open(tgt, "a").close()
    mount(src, tgt, None, MS_BIND)
    locked = os.statvfs(tgt).f_flag & MS_LOCKABLE
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | locked | (0 if devices else MS_NODEV)
    mount(None, tgt, None, flags if writable else flags | MS_RDONLY)


def tmpfs(tgt: str, size: int, mode: str, inodes: int | None = None) -> None:
    os.makedirs(tgt, exist_ok=True)
    extra = f",nr_inodes={inodes}" if inodes else ""
    mount("tmpfs", tgt, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}{extra}")


def limit_ipc() -> None:
    """Low limits in the call's own IPC namespace (its root may set them; the code, without
    capabilities, may not): message queues and semaphores are kernel memory that no sampling
    sees and, without a memory cgroup, nothing else bounds; shared memory is capped at the
    call's memory limit."""
    for name, value in cfg["ipc_limits"].items():
        with open("/proc/sys/" + name, "w") as f:
            f.write(str(value))


def folder_copy(cfg: dict, work: int, tmp: str) -> None:
    """The call's /tmp as a tmpfs of the folder quota, filled from the trajectory's folder:
    past the quota writes fail (ENOSPC), unnamed O_TMPFILE files included."""
    global folder_fd
    # through the descriptor taken before the mounts (see build_root)
    folder_fd = os.open(f"/proc/self/fd/{work}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    tmpfs(tmp, cfg["folder_bytes"], "700", cfg["folder_inodes"])
    owner = cfg["code_uid"] if cfg["identity"] == "switch_uid" else None
    if owner is not None:
        os.chown(tmp, owner, owner)
    into = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        folder_tree.copy_tree(folder_fd, into, cfg["folder_bytes"], owner)
    finally:
        os.close(into)


def keep_folder() -> None:
    """After the call, with every other process of it gone: the trajectory's folder on the
    host becomes a copy of the call's /tmp (which dies with the namespace)."""
    src = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        folder_tree.empty_tree(folder_fd)
        folder_tree.copy_tree(src, folder_fd, cfg["folder_bytes"])
    except OSError as exc:
        os.write(2, f"\nsandbox: the folder could not be kept whole: {exc}\n".encode())
    finally:
        os.close(src)


def build_root(cfg: dict) -> None:
    """Mount the new root's tree under NEW_ROOT, then pivot into it and drop the host's."""
    # sources are opened before anything is mounted: a checkout under /mnt or /tmp stays
    # reachable through its descriptor after the mounts below hide its path
    sources = {tgt: os.open(src, os.O_PATH | os.O_CLOEXEC) for src, tgt in cfg["binds"]}
    work = os.open(cfg["workdir"], os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmpfs(NEW_ROOT, 1 << 20, "755")
    r = NEW_ROOT
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            os.symlink(os.readlink(d), r + d)
        elif os.path.isdir(d):
            bind(d, r + d)
    for name in ("ld.so.cache", "localtime"):
        if os.path.exists("/etc/" + name):
            bind(os.path.realpath("/etc/" + name), r + "/etc/" + name)
    os.makedirs(r + "/etc", exist_ok=True)
    uid = cfg["code_uid"]
    for name, text in (
        ("passwd", f"root:x:0:0::/:/bin/false\nsandbox:x:{uid}:{uid}::/tmp:/bin/false\n"),
        ("group", f"root:x:0:\nsandbox:x:{uid}:\n"),
        ("hosts", "127.0.0.1 localhost\n"),
    ):
        with open(r + "/etc/" + name, "w") as f:
            f.write(text)
    for tgt, fd in sources.items():
        bind(f"/proc/self/fd/{fd}", r + tgt)
    if cfg["folder_bytes"]:
        folder_copy(cfg, work, r + "/tmp")
    else:  # the host made the folder a tmpfs of the quota (root): the call writes in it
        bind(f"/proc/self/fd/{work}", r + "/tmp", writable=True)
    tmpfs(r + "/dev", 1 << 16, "755")
    for name in DEVICES:
        bind("/dev/" + name, r + "/dev/" + name, writable=True, devices=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, r + "/dev/" + name)
    for d in cfg["private_tmpfs"]:
        tmpfs(r + d, cfg["tmpfs_bytes"], "1777")
    os.makedirs(r + "/proc")
    # this namespace's own /proc (the one `unshare --mount-proc` made), so host PIDs stay
    # unseen; hidepid=2 hides what the code may not ptrace: the init (not dumpable), whose
    # command line names host paths and whose limits and knobs would otherwise be in reach
    mount("proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    for fd in [work, *sources.values()]:
        os.close(fd)
    mount(None, r, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    os.chdir(r)
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir("/")


def seccomp_filter(lib_path: str) -> None:
    """Refuse (EPERM) what builds namespaces or mounts, and kernel surfaces code has no use
    for; clone3 gets ENOSYS so that libc falls back to clone, whose flags the filter can see."""
    lib = ctypes.CDLL(lib_path, use_errno=True)

    class Arg(ctypes.Structure):
        _fields_ = [
            ("arg", ctypes.c_uint),
            ("op", ctypes.c_int),
            ("datum_a", ctypes.c_uint64),
            ("datum_b", ctypes.c_uint64),
        ]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    if not ctx:
        raise SetupError("seccomp_init failed")
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38

    def rule(action: int, name: str, *args: Arg) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return
        if (
            lib.seccomp_rule_add(
                ctypes.c_void_p(ctx),
                ctypes.c_uint32(action),
                ctypes.c_int(nr),
                ctypes.c_uint(len(args)),
                *args,
            )
            != 0
        ):
            raise SetupError(f"seccomp_rule_add({name}) failed")

    for name in cfg["seccomp_denied"]:
        rule(eperm, name)
    rule(enosys, "clone3")
    for flag in (
        0x10000000,
        0x00020000,
        0x40000000,
        0x20000000,
        0x08000000,
        0x04000000,
        0x02000000,
    ):  # NEWUSER NEWNS NEWNET NEWPID NEWIPC NEWUTS NEWCGROUP
        rule(eperm, "clone", Arg(0, 7, flag, flag))  # SCMP_CMP_MASKED_EQ on the flags
    # personality may only be queried (0xffffffff): setting it turns off ASLR, among others
    rule(eperm, "personality", Arg(0, CMP_NE, 0xFFFFFFFF, 0))
    # socket families: refuse every one but the allowed (compared on all 64 bits, so high
    # bits the kernel would drop cannot smuggle a family past), and netlink but for routes
    for name in ("socket", "socketpair"):
        for family in range(64):
            if family not in ALLOWED_FAMILIES:
                rule(eperm, name, Arg(0, CMP_EQ, family, 0))
        rule(eperm, name, Arg(0, CMP_GE, 64, 0))
        rule(eperm, name, Arg(0, CMP_EQ, AF_NETLINK, 0), Arg(2, CMP_NE, NETLINK_ROUTE, 0))
    # the init's limits and scheduling: the code may change its own, never the init's (which
    # it shares a kernel uid with as an ordinary user): prlimit only on itself (pid 0)
    rule(eperm, "prlimit64", Arg(0, CMP_NE, 0, 0))
    rule(eperm, "setpriority", Arg(0, CMP_NE, 0, 0))  # PRIO_PGRP and PRIO_USER reach the init
    rule(eperm, "setpriority", Arg(1, CMP_EQ, 1, 0))
    rule(eperm, "ioprio_set", Arg(0, CMP_NE, 1, 0))  # IOPRIO_WHO_PROCESS only
    rule(eperm, "ioprio_set", Arg(1, CMP_EQ, 1, 0))
    for name in ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr"):
        rule(eperm, name, Arg(0, CMP_EQ, 1, 0))
    if lib.seccomp_load(ctypes.c_void_p(ctx)) != 0:  # also sets no_new_privs
        raise SetupError("seccomp_load failed")


def own_user_namespace(code_uid: int) -> None:
    """Unprivileged mode: move the code's process into a user namespace of its own where it
    is `code_uid`, not root: the exec that follows leaves it no capability at all, and
    RLIMIT_NPROC counts only the processes of this namespace."""
    outer_uid, outer_gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{code_uid} {outer_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{code_uid} {outer_gid} 1")
    os.setgid(code_uid)
    os.setuid(code_uid)


def start_code() -> None:
    """In the forked child: limits, identity, filter, then exec the interpreter."""
    if cfg["identity"] == "switch_uid":
        os.setgroups([])
        os.setgid(cfg["code_uid"])
        os.setuid(cfg["code_uid"])
    elif cfg["identity"] == "user_namespace":
        own_user_namespace(cfg["code_uid"])
    # after the identity: a user namespace keeps the process limit in force when it is made
    # as the cap of its parent's count, which also holds init and unshare
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if cfg["seccomp"]:
        seccomp_filter(cfg["seccomp"])
    os.chdir(cfg["cwd"])
    os.execve(
        cfg["python"], [cfg["python"], "-I", "-c", cfg["wrapper"], *cfg["site_dirs"]], cfg["env"]
    )


def memory_in_use(page: int) -> int:
    """Bytes the call holds: resident memory of its processes, plus the pages of its tmpfs
    folders and SysV shared memory, which belong to no process once unmapped."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != "1":
            try:
                with open(f"/proc/{entry}/statm") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                pass
    for d in cfg["counted_tmpfs"]:
        try:
            st = os.statvfs(d)
            total += (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            pass
    try:
        with open("/proc/sysvipc/shm") as f:
            next(f)
            for line in f:
                total += int(line.split()[14])  # rss column, in bytes
    except (OSError, IndexError, ValueError, StopIteration):
        pass
    return total


def end_the_rest() -> None:
    """Kill every process of the call left after the code's own and reap them all."""
    try:
        os.kill(-1, 9)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def supervise(pid: int) -> int:
    """Reap every orphan until the code's process ends; kill all past the memory limit."""
    page = os.sysconf("SC_PAGE_SIZE")
    limit = cfg["total_memory_bytes"]
    while True:
        while True:
            try:
                done, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                done = 0
            if done == pid:
                return status
            if done == 0:
                break
        used = memory_in_use(page)
        if used > limit:
            os.kill(-1, 9)
            os.write(
                2,
                (
                    f"\nsandbox: the call's processes held {used >> 20} MiB of memory together, "
                    f"over the limit of {limit >> 20} MiB; all were killed\n"
                ).encode(),
            )
            os._exit(124)
        time.sleep(0.02)


def main() -> None:
    cfg.update(json.loads(sys.argv[1]))
    # the host ends a call (wall time, output cap) with SIGTERM: exit quietly, which makes the
    # kernel kill the rest (a SIGKILLed init makes `unshare` print noise into the output)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    if cfg["namespaced"]:
        try:
            if cfg["cgroup_procs"]:
                # join the call's memory cgroup first: everything forked later is charged to it
                with open(cfg["cgroup_procs"], "w") as f:
                    f.write("0")
            _check(libc.sethostname(b"sandbox", 7), "sethostname")
            limit_ipc()
            build_root(cfg)
        except (OSError, SetupError) as exc:
            os.write(2, f"sandbox setup failed: {exc}\n".encode())
            os._exit(125)
    # the code may share our uid (unprivileged mode): without this it could ptrace us or write
    # our /proc/1/mem and use our capabilities over the sandbox's mounts (the code's exec makes
    # it dumpable again, so it can still read its own /proc/self)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    child = os.fork()
    if child == 0:
        try:
            start_code()
        except BaseException as exc:
            os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
            os._exit(125)
    os.close(0)  # the code reads its program from stdin; init holds no copy of the pipe
    if cfg["namespaced"]:
        status = supervise(child)
        if folder_fd >= 0:
            end_the_rest()
            keep_folder()
    else:
        # weaker mode (no namespaces, accepted by name): the host kills our process group after
        _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":  # run as a script by the sandbox; importing it does nothing
    main()
