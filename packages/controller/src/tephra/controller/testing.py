"""Helpers for tests of trainers built on the controller."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def run_and_read(
    run: Callable[[Any], dict[str, Any]], cfg: Any, steps: int = 2
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """`run(cfg)` in a local Ray session of 2 CPUs (shut down after), for a config that trains
    `steps` steps with the jsonl tracker and `trainer.dump_generations` on. Returns the summary
    and, for each training step in order, its metrics row (the one with `reward/mean`) and the
    rows it dumped (`generations/train_step{N}.jsonl`). Fails unless exactly `steps` steps ran."""
    import ray  # noqa: PLC0415 (the constants above need no Ray)

    from tephra.controller.cluster.worker_group import ray_init  # noqa: PLC0415
    from tephra.controller.run.trackers import read_jsonl  # noqa: PLC0415

    ray_init(num_cpus=2)
    try:
        summary = run(cfg)
    finally:
        ray.shutdown()
    run_dir = Path(cfg.trainer.run_dir)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert summary["steps"] == steps, summary
    assert [r["step"] for r in train] == list(range(1, steps + 1)), train
    gens = run_dir / "generations"
    return summary, [
        (
            r,
            [
                json.loads(x)
                for x in (gens / f"train_step{r['step']}.jsonl").read_text().splitlines()
            ],
        )
        for r in train
    ]
