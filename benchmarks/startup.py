"""Start-up, from the command to the first step, of this tree against an earlier commit, side
by side: runs alternate between the two so both see the same machine load. Writes
`results/startup.json` with each phase's median and the ratio of the totals.

    uv run python benchmarks/startup.py                      # against 7753f94, 3 runs each
    uv run python benchmarks/startup.py --baseline REV --runs 5 --preset smoke
    uv run python benchmarks/startup.py --preset demo --results benchmarks/results/startup_demo.json
    env -u PYTHONDONTWRITEBYTECODE uv run python benchmarks/startup.py \
        --results benchmarks/results/startup_writes_pyc.json   # where Python writes .pyc

Each run is a fresh `apps/ppo -p PRESET trainer.steps=1` process; its `startup`
(the phases the run prints and keeps in summary.json) is read back. The baseline runs from a
detached worktree of REV, put first on PYTHONPATH (Ray's workers inherit it), in this
environment.

Bytecode: this workspace's `uv sync` now compiles the installed modules (`compile-bytecode`);
the baseline's did not. Where Python writes no .pyc files (PYTHONDONTWRITEBYTECODE=1, as here
and in many container images) the baseline's processes compiled every module from source, so
the baseline runs see no .pyc (an empty PYTHONPYCACHEPREFIX). A third series,
`current_no_bytecode`, runs this tree the same way: the share of tephra's own changes. Where
Python writes .pyc files, the baseline had them after its first run, and all three share them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "startup.json"


def source_dirs(tree: Path) -> list[str]:
    """Every workspace member's `src` folder of a checkout."""
    return sorted(
        str(p) for p in tree.glob("*/*/src") if p.parent.parent.name in ("packages", "apps")
    )


def one_run(preset: str, pythonpath: list[str], bytecode: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
        if not bytecode:  # Python reads .pyc files only under the (empty) prefix
            env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "no-pyc")
        main = "from tephra.apps.ppo.main import main; main()"
        cmd = [sys.executable, "-c", main, *(["-p", preset] if preset != "demo" else [])]
        cmd.append("trainer.steps=1")
        cmd += [f"trainer.run_dir={tmp}", "trainer.val_before=false", "trainer.val_after=false"]
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=ROOT)
        return json.loads((Path(tmp) / "summary.json").read_text())["startup"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="7753f94", help="the commit to compare with")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--preset", default="smoke", help="a preset, or `demo` (no preset)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where to write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.baseline],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            # without .pyc files the baseline's install compiled nothing (see the docstring)
            had_bytecode = not sys.flags.dont_write_bytecode
            series = [
                ("baseline", source_dirs(base), had_bytecode),
                ("current", [], True),
                ("current_no_bytecode", [], False),
            ]
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in series}
            for i in range(args.runs):
                for name, path, bytecode in series:
                    runs[name].append(one_run(args.preset, path, bytecode))
                    print(f"run {i + 1} {name}: {runs[name][-1]['total_s']:.1f} s", flush=True)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
            )
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    result = {
        "preset": args.preset,
        "baseline": args.baseline,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average": os.getloadavg(),
        "writes_pyc": not sys.flags.dont_write_bytecode,
        "median_s": medians,
        "runs": runs,
        "total_ratio": round(medians["current"]["total_s"] / medians["baseline"]["total_s"], 3),
        "no_bytecode_ratio": round(
            medians["current_no_bytecode"]["total_s"] / medians["baseline"]["total_s"], 3
        ),
    }
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("median_s", "total_ratio", "no_bytecode_ratio")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
