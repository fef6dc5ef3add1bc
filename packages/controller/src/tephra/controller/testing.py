"""Helpers for tests of trainers built on the controller."""

from __future__ import annotations

SMOKE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 5) / 4.0
"""
"""A custom reward with variance on a random tiny model: rule scorers would give all zeros,
and zero advantages would make "resume is exact" or "two layouts agree" trivially true."""


TIMED_METRICS = ("perf/tokens_per_s", "perf/mfu", "perf/mfu_measured_peak")
"""Step metrics computed from wall-clock time (throughput and the MFU derived from it)."""


def untimed_metrics(record: dict[str, object]) -> dict[str, object]:
    """A step's metrics without those that differ between two runs of the same computation:
    the times (`time/*`), the throughput and MFU (`TIMED_METRICS`) and the memory readings
    (`memory/*`: resident sets and the object store). What is left (losses, rewards, grad
    norms, token and flop counts, ...) is equal, bitwise, in runs that compute the same."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(("time/", "memory/")) and k not in TIMED_METRICS
    }
