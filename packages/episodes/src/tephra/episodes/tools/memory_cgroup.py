"""A memory cgroup per sandboxed call, where the host lets this process make one.

The kernel then charges every page of the call to it (tmpfs files, memfd and SysV shared
memory, page tables, socket buffers), which the sandbox's own sampling of resident memory
cannot all see, and kills inside it past the limit. cgroup v2 is used where our cgroup's
`cgroup.subtree_control` already enables `memory` (a delegated subtree); cgroup v1 where its
memory hierarchy is mounted and writable (containers often give root that). Elsewhere, e.g.
for an ordinary user without delegation, `MemoryCgroup.create` returns None.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from functools import cache


def _mounts() -> dict[str, tuple[str, str]]:
    """{'v2' or 'v1': (mount root, mount point)} of the memory-capable cgroup hierarchies."""
    found: dict[str, tuple[str, str]] = {}
    try:
        lines = open("/proc/self/mountinfo").read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            found.setdefault("v2", (fields[3], fields[4]))
        elif fstype == "cgroup" and "memory" in options:
            found.setdefault("v1", (fields[3], fields[4]))
    return found


@cache
def parent_cgroup() -> tuple[str, str] | None:
    """(version, folder) of the cgroup under which ours may be made, or None."""
    mounts = _mounts()
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        version = "v2" if controllers == "" else "v1"
        if version == "v1" and "memory" not in controllers.split(","):
            continue
        if version not in mounts:
            continue
        root, point = mounts[version]
        folder = os.path.join(point, os.path.relpath(path, root).removeprefix("."))
        folder = os.path.normpath(folder)
        if version == "v2":
            try:
                enabled = open(os.path.join(folder, "cgroup.subtree_control")).read().split()
            except OSError:
                continue
            if "memory" not in enabled:
                continue
        if os.path.isdir(folder) and os.access(folder, os.W_OK):
            return version, folder
    return None


@dataclass
class MemoryCgroup:
    """One call's cgroup: `procs` is the file a process writes "0" to, to join it."""

    version: str
    folder: str

    @classmethod
    def create(cls, limit_bytes: int) -> MemoryCgroup | None:
        parent = parent_cgroup()
        if parent is None:
            return None
        version, base = parent
        folder = os.path.join(base, f"tephra-sandbox-{secrets.token_hex(6)}")
        try:
            os.mkdir(folder)
        except OSError:
            return None
        group = cls(version, folder)
        try:
            if version == "v2":
                group._write("memory.max", limit_bytes)
                group._write("memory.swap.max", 0, optional=True)
                group._write("memory.oom.group", 1, optional=True)  # kill the call as a whole
            else:
                group._write("memory.limit_in_bytes", limit_bytes)
                group._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)
        except OSError:
            group.remove()
            return None
        return group

    @property
    def procs(self) -> str:
        return os.path.join(self.folder, "cgroup.procs")

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.folder, name), "w") as f:
                f.write(str(value))
        except OSError:
            if not optional:
                raise

    def oom_kills(self) -> int:
        """Processes the kernel killed for going over the limit."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            for line in open(os.path.join(self.folder, name)).read().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        # the call's processes are dead, but the kernel may take a moment to release them
        for _ in range(50):
            try:
                os.rmdir(self.folder)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


__all__ = ["MemoryCgroup", "parent_cgroup"]
