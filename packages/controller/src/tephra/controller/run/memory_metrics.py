"""The memory an operator watches, per step: each process's resident set (the driver's and
every rank's), and on CUDA each rank's peak allocated and reserved device memory."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

GIB = float(1 << 30)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process on this machine (Linux `/proc/<pid>/statm`: resident
    pages times the page size), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def process_memory() -> dict[str, float]:
    """This process's memory, in GiB: `rss_gib`, and where CUDA is initialised the peak
    allocated and reserved memory of its device since the last call (the peaks are reset, so
    each step reports its own)."""
    stats = {"rss_gib": rss_bytes() / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        stats["gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        torch.cuda.reset_peak_memory_stats()
    return stats


def memory_metrics(driver: dict[str, float], ranks: Sequence[dict[str, float]]) -> dict[str, float]:
    """`memory/driver_rss_gib`, and over the ranks the largest of each of their stats:
    `memory/rank_rss_gib_max`, `memory/gpu_max_allocated_gib_max`,
    `memory/gpu_max_reserved_gib_max` (the GPU ones where CUDA is present)."""
    metrics = {"memory/driver_rss_gib": driver["rss_gib"]}
    for key in ("rss_gib", "gpu_max_allocated_gib", "gpu_max_reserved_gib"):
        values = [r[key] for r in ranks if key in r]
        if values:
            name = "rank_rss_gib" if key == "rss_gib" else key
            metrics[f"memory/{name}_max"] = max(values)
    return metrics
