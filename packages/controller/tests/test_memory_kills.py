"""What the message of a worker killed for memory quotes: the node's memory from Ray's error,
and the machine's and the cgroup's own."""

from __future__ import annotations

from pathlib import Path

from tephra.controller.cluster.memory_kills import node_memory, ray_oom_usage

# Ray 2.60's OutOfMemoryError, as its raylet formats it ("Memory on the node (IP: %s, ID: %s)
# was %sGB used / %sGB limit (%f)"), and the format of earlier releases
RAY_2_60 = (
    "Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 10.0.0.5, ID: 4b1f) was 13.52GB used / 14.23GB limit (0.950123)"
    "\nRay killed 1 worker(s) based on the killing policy"
)
RAY_OLDER = (
    "Memory on the node (IP: 10.0.0.5, ID: 4b1f) where the task (actor ID: 9c) was running "
    "was 13.52GB / 14.23GB (0.950123), which exceeds the memory usage threshold of 0.95."
)


def test_ray_oom_usage_quotes_the_nodes_memory_at_the_kill() -> None:
    assert ray_oom_usage(RAY_2_60) == "13.52GB used / 14.23GB limit (0.950123)"
    assert ray_oom_usage(RAY_OLDER) == "13.52GB / 14.23GB (0.950123)"
    assert ray_oom_usage("the actor died unexpectedly") is None


def test_node_memory_is_what_meminfo_says() -> None:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024
    total = info["MemTotal"] / 2**30
    text = node_memory()
    assert text.startswith("node memory ") and f" used of {total:.1f} GiB" in text
    used = float(text.split()[2])
    assert abs(used - (info["MemTotal"] - info["MemAvailable"]) / 2**30) < 1.0  # moments apart
