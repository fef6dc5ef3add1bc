"""A convergence gate: a short recorded run whose per-step metrics must stay inside corridors.

`uv run python -m tephra.apps.ppo.corridor_gate check` trains the gate run (the smoke preset
on the tiny model, rewarded by the vowel share of its responses, `GATE_STEPS` steps) and
compares each step's `GATE_METRICS` with the stored corridors; a NaN, a missing metric or a
value outside is a failure naming the step, the metric, the value and the corridor.
`... record` re-records the corridors after an intended change: it trains the gate run with
`RECORD_SEEDS` and widens each step's range over the seeds by `MARGIN`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tephra.apps.ppo.config import parse_config
from tephra.apps.ppo.main import run
from tephra.controller.run.trackers import read_jsonl

GATE_STEPS = 6
GATE_METRICS = (
    "reward/mean",
    "actor/entropy",
    "actor/grad_norm",
    "response/length_mean",
    "rollout_corr/log_prob_abs_gap_mean",
)
RECORD_SEEDS = (0, 1, 2, 3, 4)
MARGIN = 1.0
"""Each side of a corridor is widened by MARGIN x the range the seeds spanned (plus 5% of
the value's size and 1e-6): another machine's rounding can send sampling down another path,
which looks like another seed."""
CORRIDORS = Path(__file__).parent / "corridors" / "smoke_vowels.json"
REWARD = Path(__file__).parent / "corridors" / "vowels.py"


def gate_overrides(seed: int, run_dir: Path) -> list[str]:
    return [
        "-p",
        "smoke",
        f"reward.custom_function_path={REWARD}",
        f"trainer.steps={GATE_STEPS}",
        f"trainer.seed={seed}",
        f"trainer.run_dir={run_dir}",
        "trainer.export_hf=false",
    ]


def gate_run(seed: int, run_dir: Path, extra: Sequence[str] = ()) -> list[dict]:
    """The gate run's per-step metric records (`extra`: more overrides, e.g. a broken lr)."""
    run(parse_config(gate_overrides(seed, run_dir) + list(extra)))
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def make_corridors(runs: list[list[dict]], margin: float = MARGIN) -> dict:
    """{metric: [[low, high] per step]} spanning every run, widened by `margin`."""
    corridors: dict[str, list[list[float]]] = {}
    for metric in GATE_METRICS:
        corridors[metric] = []
        for step in range(GATE_STEPS):
            values = [records[step][metric] for records in runs]
            low, high = min(values), max(values)
            pad = margin * (high - low) + 0.05 * max(abs(low), abs(high)) + 1e-6
            corridors[metric].append([low - pad, high + pad])
    return corridors


def violations(records: list[dict], corridors: dict) -> list[str]:
    """Every step/metric of `records` outside its corridor, NaN or missing, one line each."""
    found = []
    if len(records) != GATE_STEPS:
        found.append(f"the run logged {len(records)} steps, the gate expects {GATE_STEPS}")
    for step, record in enumerate(records[:GATE_STEPS]):
        for metric, bounds in corridors.items():
            low, high = bounds[step]
            value = record.get(metric)
            if value is None:
                found.append(f"step {step + 1}: {metric} was not logged")
            elif not math.isfinite(value):
                found.append(f"step {step + 1}: {metric} = {value} (not finite)")
            elif not low <= value <= high:
                found.append(
                    f"step {step + 1}: {metric} = {value:.6g} outside [{low:.6g}, {high:.6g}]"
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tephra.apps.ppo.corridor_gate")
    parser.add_argument("action", choices=["check", "record"])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides (check only)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tephra-gate-") as tmp:
        if args.action == "record":
            runs = [gate_run(seed, Path(tmp) / f"seed{seed}") for seed in RECORD_SEEDS]
            CORRIDORS.write_text(json.dumps(make_corridors(runs), indent=1) + "\n")
            print(f"recorded {CORRIDORS} from seeds {list(RECORD_SEEDS)}")
            return 0
        records = gate_run(0, Path(tmp) / "check", args.overrides)
    found = violations(records, json.loads(CORRIDORS.read_text()))
    for line in found:
        print(line)
    print("corridor gate: " + ("FAILED" if found else f"passed ({GATE_STEPS} steps)"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
