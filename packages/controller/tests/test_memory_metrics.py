"""Per-step memory metrics: this process's RSS read from /proc against psutil's reading of
the same process, and the step metrics' names and maxima."""

from __future__ import annotations

import os

import psutil
import pytest

from tephra.controller.run.memory_metrics import GIB, memory_metrics, process_memory, rss_bytes


def test_rss_matches_psutil_and_follows_an_allocation():
    me = psutil.Process()
    assert abs(rss_bytes() - me.memory_info().rss) < 8 << 20  # the two reads are moments apart
    before = process_memory()["rss_gib"]
    block = bytearray(256 << 20)  # 256 MiB, touched: resident
    block[:: os.sysconf("SC_PAGE_SIZE")] = b"\1" * len(block[:: os.sysconf("SC_PAGE_SIZE")])
    after = process_memory()["rss_gib"]
    assert after - before == pytest.approx(0.25, abs=0.03)
    assert after == pytest.approx(me.memory_info().rss / GIB, abs=0.01)
    del block


def test_another_process_is_read_by_pid():
    parent = psutil.Process().parent()
    assert parent is not None
    assert abs(rss_bytes(parent.pid) - parent.memory_info().rss) < 8 << 20


def test_step_metrics_take_the_largest_rank():
    ranks = [
        {"rss_gib": 1.5},
        {"rss_gib": 2.25, "gpu_max_allocated_gib": 3.0, "gpu_max_reserved_gib": 4.0},
        {"rss_gib": 0.5, "gpu_max_allocated_gib": 5.0, "gpu_max_reserved_gib": 1.0},
    ]
    assert memory_metrics({"rss_gib": 0.75}, ranks) == {
        "memory/driver_rss_gib": 0.75,
        "memory/rank_rss_gib_max": 2.25,
        "memory/gpu_max_allocated_gib_max": 5.0,
        "memory/gpu_max_reserved_gib_max": 4.0,
    }
    # CPU ranks: no GPU metric at all (not a zero that reads as "no memory used")
    assert memory_metrics({"rss_gib": 1.0}, [{"rss_gib": 2.0}]) == {
        "memory/driver_rss_gib": 1.0,
        "memory/rank_rss_gib_max": 2.0,
    }
