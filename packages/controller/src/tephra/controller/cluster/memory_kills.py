"""A worker killed for memory, told apart from other deaths: by Ray's memory monitor (its
`OutOfMemoryError`) or by the kernel's OOM killer (the cgroup's `oom_kill` count went up),
with the memory the node had at the kill and the settings that lower a rank's share."""

from __future__ import annotations

import re
from pathlib import Path

from tephra.episodes.tools.memory_cgroup import MemoryCgroup, parent_cgroup

KNOBS = (
    "actor.micro_batch.max_tokens_per_microbatch (and critic's): fewer tokens per forward/"
    "backward; actor.offload.params / actor.offload.optimizer=true: weights and Adam state "
    "in host memory between uses (on GPUs); resources.memory_per_rank_gb: Ray places no more "
    "ranks on a node than its memory holds; rollout.max_tokens and batch.prompts_per_step: "
    "smaller batches"
)
"""What lowers a rank's memory, named in the message of a worker killed for it."""

_RAY_USAGE = re.compile(r"was ([\d.]+\s*GB(?: used)?\s*/\s*[\d.]+\s*GB(?: limit)?\s*\([\d.]+\))")
"""Ray's report of the node's memory in its OutOfMemoryError: `was 13.52GB used / 14.23GB limit
(0.950000)` (Ray 2.60; earlier releases: `was 13.52GB / 14.23GB (0.95)`)."""


def _cgroup() -> MemoryCgroup | None:
    """This process's memory cgroup (the run's workers are in it, or below it)."""
    found = parent_cgroup()
    return MemoryCgroup(*found) if found is not None else None


def oom_kills() -> int:
    """Processes the kernel's OOM killer has killed in this process's memory cgroup so far
    (0 where the cgroup cannot be read)."""
    group = _cgroup()
    return group.oom_kills() if group is not None else 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def node_memory() -> str:
    """The node's memory now (`/proc/meminfo`), and this cgroup's limit and peak where it has
    one: what the message of a memory kill reports."""
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return "node memory unknown"
    total, available = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    text = f"node memory {_gib(total - available)} used of {_gib(total)}"
    group = _cgroup()
    if group is not None:
        names = (
            ("memory.max", "memory.peak")
            if group.version == "v2"
            else ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
        )
        values = []
        for name in names:
            try:
                values.append((Path(group.folder) / name).read_text().strip())
            except OSError:
                values.append("")
        limit, peak = values
        if limit.isdigit() and int(limit) < total:
            text += f"; the run's cgroup limit {_gib(int(limit))}"
            if peak.isdigit():
                text += f", its peak {_gib(int(peak))}"
    return text


def ray_oom_usage(message: str) -> str | None:
    """The node's memory at the kill as Ray's memory monitor wrote it in its error
    (`13.52GB used / 14.23GB limit (0.950000)`), else None."""
    found = _RAY_USAGE.search(message)
    return found.group(1) if found else None


__all__ = ["KNOBS", "node_memory", "oom_kills", "ray_oom_usage"]
