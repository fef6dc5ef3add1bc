"""A helper for end-to-end tests of the RL trainer: run a config in a local Ray session and
read back what each step logged and dumped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from tephra.controller.cluster.worker_group import ray_init
from tephra.controller.run.trackers import read_jsonl


def run_and_read(
    run: Callable[[Any], dict[str, Any]], cfg: Any, steps: int = 2
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """`run(cfg)` in a local Ray session of 2 CPUs (shut down after), for a config that trains
    `steps` steps with the jsonl tracker and `trainer.dump_generations` on. Returns the summary
    and, for each training step in order, its metrics row (the one with `reward/mean`) and the
    rows it dumped (`generations/train_step{N}.jsonl`). Fails unless exactly `steps` steps ran."""
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
