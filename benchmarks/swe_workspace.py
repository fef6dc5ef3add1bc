"""What one SWE trajectory's repository costs the host, side by side: a hard-link farm
against a full copy of the task's template, the trajectory's folder as the environment makes
it (the sandbox's per-trajectory folder: as root a tmpfs mount), and one test run in the
sandbox for scale. Writes `results/swe_workspace.json` (medians in milliseconds, ratios).

    OMP_NUM_THREADS=1 uv run python benchmarks/swe_workspace.py [--reps 3]

As root the environment's copies are tmpfs mounts; run it as an ordinary user (e.g. under
`setpriv --reuid=65534 ...`, the interpreter readable by that user, `--results` somewhere it
may write) for the link-farm path; `results/swe_workspace_unprivileged.json` is such a run.

Every shipped task is measured `--reps` times per method, one after another:
- `link_farm`: a plain folder filled with hard links to the template's files (what
  `workspace: auto` does where the folder and the template share a filesystem, i.e. for an
  ordinary user), then removed with the sandbox's safe walk;
- `full_copy`: the same folder filled with copies of the files (shutil.copytree), removed
  the same way;
- `environment_setup`: `SweWorkspaces.create` + `release` as the `swe` environment runs them
  (as root: a fresh uid, a tmpfs mount of `disk_quota_mb`, the files copied into it, the
  unmount);
- `test_run`: one `run_tests` of the untouched repository in the python sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tephra.episodes.environments.swe import TASKS, SweSettings, SweWorkspaces
from tephra.episodes.environments.swe.workspace import _fill
from tephra.episodes.tools.folder_tree import remove_tree

RESULTS = Path(__file__).resolve().parent / "results" / "swe_workspace.json"


def ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tephra-swe-bench-")
    ws = SweWorkspaces(SweSettings(workdir_root=root, workspace="copy"))
    times: dict[str, list[float]] = {
        "link_farm": [],
        "full_copy": [],
        "environment_setup": [],
        "test_run": [],
    }
    try:
        for rep in range(args.reps):
            for task in TASKS:
                template = ws.template(task)
                for method in ("link_farm", "full_copy"):
                    target = os.path.join(root, f"{method}-{task.name}-{rep}")
                    start = time.perf_counter()
                    if method == "link_farm":
                        os.mkdir(target)
                        assert _fill(template, target, list(task.files), None, True) == len(
                            task.files
                        )
                    else:
                        shutil.copytree(template, target)
                    remove_tree(target)
                    times[method].append(time.perf_counter() - start)

                async def trajectory(instance: str, task=task) -> tuple[float, float]:
                    start = time.perf_counter()
                    await ws.create(instance, task)
                    made = time.perf_counter() - start
                    report = await ws.run_tests(instance)
                    assert len(report.passed) == len(task.test_ids) - len(task.failing), (
                        task.name,
                        report,
                    )
                    start = time.perf_counter()
                    await ws.release(instance)
                    return made + time.perf_counter() - start, report.seconds

                setup, run = asyncio.run(trajectory(f"{task.name}-{rep}"))
                times["environment_setup"].append(setup)
                times["test_run"].append(run)
        copy = ws.sandbox
        result = {
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "load_average": os.getloadavg(),
                "euid": os.geteuid(),
                "identity": copy.identity,
            },
            "trajectories_per_method": len(TASKS) * args.reps,
            "median_ms": {k: ms(v) for k, v in times.items()},
            "ratios": {
                "full_copy / link_farm": round(
                    statistics.median(times["full_copy"]) / statistics.median(times["link_farm"]),
                    2,
                ),
                "test_run / environment_setup": round(
                    statistics.median(times["test_run"])
                    / statistics.median(times["environment_setup"]),
                    2,
                ),
            },
            "files_per_task": statistics.median(len(t.files) for t in TASKS),
        }
    finally:
        ws.close()
        remove_tree(root)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
