"""The demo task in each training mode with the same total compute, side by side: time per
step, tokens/s and the training time to reach the sync run's final held-out accuracy, as
ratios to sync. Writes `results/async_modes.json`.

    uv run python benchmarks/async_modes.py                  # the demo: 36 steps, val every 6
    uv run python benchmarks/async_modes.py --quick          # 4 steps, val every 2, 16 items

Modes, on this machine's 2 cores:
  sync          colocated: one rank with 2 threads generates, then trains
  one_step_off  colocated: the same rank generates step k+1 while it trains step k
  async         1 core of rollout (a replica) + 1 core of training, `async_window=1`,
                requests of 4 prompt groups (a step's batch), 2 in flight
Each run is a fresh process running `apps/ppo` with the demo's defaults otherwise. Time is
the summed `time/step_s` (validation passes excluded); accuracy is the greedy held-out
accuracy every `--val-every` steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "async_modes.json"
MODES = {
    "sync": ["trainer.mode=sync", "resources.cpus_per_rank=2"],
    "one_step_off": ["trainer.mode=one_step_off", "resources.cpus_per_rank=2"],
    "async": [
        "trainer.mode=async",
        "resources.cpus_per_rank=1",
        "resources.rollout.replicas=1",
        "resources.rollout.cpus_per_replica=1",
        "trainer.async_window=1",
        "trainer.async_in_flight=2",
        "trainer.async_groups_per_request=4",
    ],
}


def run_mode(mode: str, steps: int, val_every: int, val_size: int) -> dict:
    """One `apps/ppo` run in this process; its per-step times, tokens/s and accuracy curve."""
    from tephra.apps.ppo.main import parse_config, run

    with tempfile.TemporaryDirectory(prefix=f"async_modes_{mode}_") as tmp:
        run(
            parse_config(
                [
                    f"trainer.steps={steps}",
                    f"trainer.val_every={val_every}",
                    f"data.val_size={val_size}",
                    "trainer.val_before=true",
                    "trainer.val_after=true",
                    "trainer.trackers=[jsonl]",
                    "trainer.progress_bar=false",
                    "trainer.export_hf=false",
                    "trainer.resume=off",
                    f"trainer.run_dir={tmp}",
                    *MODES[mode],
                ]
            )
        )
        records = [
            json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        ]
    step_s = {r["step"]: r["time/step_s"] for r in records if "time/step_s" in r}
    tokens = [r["perf/tokens_per_s"] for r in records if "perf/tokens_per_s" in r]
    curve = []  # (training seconds so far, accuracy) at each validation
    for r in records:
        if "accuracy/val" in r:
            seconds = sum(s for k, s in step_s.items() if k <= r["step"])
            curve.append((round(seconds, 1), r["accuracy/val"]))
    stages = {
        k: round(statistics.median(r[k] for r in records if k in r), 3)
        for k in sorted({k for r in records for k in r})
        if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"
    }
    return {
        "step_s": [round(step_s[k], 3) for k in sorted(step_s)],
        "median_stages_s": stages,
        "median_step_s": statistics.median(step_s.values()),
        "median_tokens_per_s": statistics.median(tokens),
        "curve": curve,
    }


def time_to(curve: list, target: float) -> float | None:
    """Training seconds at the first validation at or above `target` (None: never)."""
    return next((s for s, acc in curve if acc >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 steps, val every 2, 16 items")
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--val-every", type=int, default=6)
    parser.add_argument("--val-size", type=int, default=200)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--run", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.val_every, args.val_size = 4, 2, 16
    if args.run:  # a child process: one mode
        Path(args.out).write_text(
            json.dumps(run_mode(args.run, args.steps, args.val_every, args.val_size))
        )
        return
    runs = {}
    for mode in args.modes.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--run",
                    mode,
                    "--out",
                    out.name,
                    "--steps",
                    str(args.steps),
                    "--val-every",
                    str(args.val_every),
                    "--val-size",
                    str(args.val_size),
                ],
                check=True,
            )
            runs[mode] = json.loads(Path(out.name).read_text())
        print(mode, {k: v for k, v in runs[mode].items() if k != "step_s"}, flush=True)
    base = runs["sync"]
    target = base["curve"][-1][1]
    sync_time = time_to(base["curve"], target)
    for r in runs.values():
        reached = time_to(r["curve"], target)
        r["ratio_step_time_sync_over"] = base["median_step_s"] / r["median_step_s"]
        r["ratio_tokens_per_s_over_sync"] = r["median_tokens_per_s"] / base["median_tokens_per_s"]
        r["training_s_to_sync_final_accuracy"] = reached
        r["ratio_time_to_accuracy_sync_over"] = (sync_time / reached) if reached else None
    from tephra.engine_api.fastest_dtype import fastest_dtype

    result = {
        "machine": f"{platform.machine()}, 2 cores, compute dtype {fastest_dtype('cpu')}",
        "steps": args.steps,
        "val_every": args.val_every,
        "val_size": args.val_size,
        "sync_final_accuracy": target,
        "runs": runs,
    }
    if not args.quick:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                n: {k: r[k] for k in r if k.startswith(("ratio", "training", "median"))}
                for n, r in runs.items()
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
