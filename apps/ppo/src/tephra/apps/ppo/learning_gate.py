"""A learning gate: short real runs of the demo whose held-out accuracy must rise.

`uv run python -m tephra.apps.ppo.learning_gate check` trains the demo (SmolLM2-135M-Instruct
on reasoning-gym arithmetic, GRPO) for `GATE_STEPS` steps from each of `GATE_SEEDS` and fails
when the mean gain in held-out greedy accuracy over the seeds falls below the threshold recorded
for the compute dtype the run chose (bf16 on a CPU with bf16 units, fp32 elsewhere), or when a
step's rollout/trainer log-prob gap (`rollout_corr/log_prob_abs_gap_mean`) exceeds its bound:
a run that learns nothing, learns backwards, or trains on log-probs that are not its rollout's.
`... record` trains `RECORD_SEEDS` and writes the thresholds of the run's dtype to
`corridors/learning_gate.json` after an intended change.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tephra.apps.ppo.config import parse_config
from tephra.controller.launch.preflight import resolve_auto_dtypes
from tephra.controller.run.trackers import read_jsonl

GATE_STEPS = 12
GATE_SEEDS = (0, 1)
RECORD_SEEDS = (0, 1, 2, 3)
GAP_METRIC = "rollout_corr/log_prob_abs_gap_mean"
THRESHOLDS = Path(__file__).parent / "corridors" / "learning_gate.json"
SIGMAS = 3.0
"""The gain threshold is the recorded mean gain less this many standard errors of the
gate's two-seed mean (a healthy run on the recording CPU fails about once in 700 checks) ..."""
SHARE = 0.5
"""... or this share of the recorded mean, if lower: another CPU of the same dtype rounds
differently and sends the runs down other paths (the accuracy before training already differs
by CPU kind and thread count), so the gate bounds what a broken run does (lr 0 gains exactly 0,
a flipped sign loses accuracy) and leaves ranking changes of a few points to the seed table."""
GAP_FACTOR = 3.0
"""The gap bound is this multiple of the largest gap any recorded step showed ..."""
GAP_FLOOR = 1e-3
"""... and at least this (nats): in fp32 the recorded gaps are ~1e-5, and another CPU's
kernels round differently; a real mismatch (a token off, bf16 against fp32) is 1e-2 or more."""
MIN_GAIN_FLOOR = 0.05
"""A threshold at or below this is refused when recording: the gate could not tell a run
that learns from one that does not (lr 0 gains exactly 0); gate more steps or seeds."""


@dataclass
class GateRun:
    """One seed's outcome: held-out greedy accuracy before and after, the largest gap."""

    seed: int
    dtype: str
    accuracy_before: float
    accuracy_after: float
    max_gap: float

    @property
    def gain(self) -> float:
        return self.accuracy_after - self.accuracy_before


def gate_overrides(seed: int, run_dir: Path) -> list[str]:
    """The demo for `GATE_STEPS` steps on one thread: the seeds run side by side, one
    process each, and the thresholds were recorded in the same setting."""
    return [
        f"trainer.steps={GATE_STEPS}",
        f"trainer.seed={seed}",
        f"trainer.run_dir={run_dir}",
        "trainer.resume=off",
        "trainer.export_hf=false",
        "trainer.progress_bar=false",
        "resources.num_cpus=1",
        "resources.cpus_per_rank=1",
    ]


def read_run(seed: int, dtype: str, run_dir: Path) -> GateRun:
    """A finished gate run's outcome from its summary and metrics."""
    summary = json.loads((run_dir / "summary.json").read_text())
    gaps = [r[GAP_METRIC] for r in read_jsonl(run_dir / "metrics.jsonl") if GAP_METRIC in r]
    if len(gaps) != GATE_STEPS:
        raise RuntimeError(
            f"seed {seed}: {len(gaps)} steps logged {GAP_METRIC}, the gate expects {GATE_STEPS}"
        )
    return GateRun(
        seed=seed,
        dtype=dtype,
        accuracy_before=float(summary["accuracy_before"]),
        accuracy_after=float(summary["accuracy_after"]),
        max_gap=max(gaps),
    )


def gate_runs(seeds: tuple[int, ...], root: Path, extra: list[str], parallel: int) -> list[GateRun]:
    """Train each seed in a process of its own, `parallel` at a time."""
    dtype = str(
        resolve_auto_dtypes(
            parse_config(gate_overrides(0, root) + extra)
        ).actor.precision.param_dtype
    )
    runs: list[GateRun] = []
    pending = list(seeds)
    while pending:
        batch, pending = pending[:parallel], pending[parallel:]
        procs = {}
        for seed in batch:
            run_dir = root / f"seed{seed}"
            run_dir.mkdir(parents=True)
            log = (run_dir.parent / f"seed{seed}.log").open("w")
            command = [sys.executable, "-m", "tephra.apps.ppo.main"]
            procs[seed] = (
                subprocess.Popen(
                    command + gate_overrides(seed, run_dir) + extra,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
                run_dir,
            )
        for seed, (proc, log, run_dir) in procs.items():
            code = proc.wait()
            log.close()
            if code != 0:
                tail = (run_dir.parent / f"seed{seed}.log").read_text()[-3000:]
                raise RuntimeError(f"seed {seed}: the gate run exited with {code}:\n{tail}")
            r = read_run(seed, dtype, run_dir)
            runs.append(r)
            print(
                f"learning gate: seed {seed} ({r.dtype}): held-out accuracy "
                f"{r.accuracy_before:.3f} -> {r.accuracy_after:.3f} (gain {r.gain:+.3f}), "
                f"largest log-prob gap {r.max_gap:.2e}",
                flush=True,
            )
    return runs


def thresholds_from(runs: list[GateRun], gate_seeds: int = len(GATE_SEEDS)) -> dict:
    """The dtype's thresholds from recorded runs: the gate's mean gain over `gate_seeds` seeds
    must reach the recorded mean minus `SIGMAS` standard errors of such a mean, or `SHARE` of
    the recorded mean if that is lower; every step's
    gap must stay within `GAP_FACTOR` x the largest recorded (at least `GAP_FLOOR`)."""
    gains = [r.gain for r in runs]
    mean, sd = statistics.mean(gains), statistics.stdev(gains)
    min_gain = min(mean - SIGMAS * sd / math.sqrt(gate_seeds), SHARE * mean)
    if min_gain <= MIN_GAIN_FLOOR:
        raise ValueError(
            f"recorded gains {[round(g, 3) for g in gains]} (mean {mean:.3f}, sd {sd:.3f}) "
            f"give a threshold of {min_gain:.3f}, too close to no learning; raise GATE_STEPS "
            "or the number of GATE_SEEDS"
        )
    return {
        "steps": GATE_STEPS,
        "gate_seeds": gate_seeds,
        "recorded_seeds": [r.seed for r in runs],
        "accuracy_before": runs[0].accuracy_before,
        "gains": [round(g, 4) for g in gains],
        "gain_mean": round(mean, 4),
        "gain_sd": round(sd, 4),
        "min_gain": round(min_gain, 4),
        "max_gaps": [r.max_gap for r in runs],
        "max_gap": max(GAP_FACTOR * max(r.max_gap for r in runs), GAP_FLOOR),
    }


def verdict(runs: list[GateRun], stored: dict) -> list[str]:
    """What fails the gate, one line each (empty: it passes)."""
    dtype = runs[0].dtype
    if dtype not in stored:
        return [
            f"no thresholds recorded for compute dtype {dtype} (recorded: {sorted(stored)}); "
            "run `python -m tephra.apps.ppo.learning_gate record` on such a machine"
        ]
    t = stored[dtype]
    if t["steps"] != GATE_STEPS:
        return [f"thresholds for {dtype} were recorded for {t['steps']} steps, not {GATE_STEPS}"]
    found = []
    gain = statistics.mean(r.gain for r in runs)
    if not gain >= t["min_gain"]:
        found.append(
            f"mean held-out accuracy gain {gain:+.3f} over seeds {[r.seed for r in runs]} is "
            f"below {t['min_gain']:.3f} ({dtype}: recorded {t['gain_mean']:.3f} +- "
            f"{t['gain_sd']:.3f} per seed): the run did not learn as it did"
        )
    for r in runs:
        if not r.max_gap <= t["max_gap"]:
            found.append(
                f"seed {r.seed}: rollout/trainer log-prob gap {r.max_gap:.3g} exceeds "
                f"{t['max_gap']:.3g} ({dtype}): the trainer's log-probs are not the rollout's"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tephra.apps.ppo.learning_gate")
    parser.add_argument("action", choices=["check", "record"])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    parser.add_argument(
        "--parallel", type=int, default=len(GATE_SEEDS), help="seeds trained at once (1 CPU each)"
    )
    args = parser.parse_intermixed_args(argv)
    stored = json.loads(THRESHOLDS.read_text()) if THRESHOLDS.exists() else {}
    with tempfile.TemporaryDirectory(prefix="tephra-learning-gate-") as tmp:
        seeds = RECORD_SEEDS if args.action == "record" else GATE_SEEDS
        runs = gate_runs(seeds, Path(tmp), args.overrides, args.parallel)
    if args.action == "record":
        stored[runs[0].dtype] = thresholds_from(runs)
        THRESHOLDS.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"recorded {runs[0].dtype} thresholds in {THRESHOLDS}: {stored[runs[0].dtype]}")
        return 0
    found = verdict(runs, stored)
    for line in found:
        print(line)
    print("learning gate: " + ("FAILED" if found else "passed"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
