"""Seconds from the command to the end of `--help` for each app, against what importing the
app's config (what `--help` had to do before it was answered from the shipped index) takes.
Writes `results/app_help.json` (medians of `--runs` fresh processes, the CPU named).

    uv run python benchmarks/app_help.py            # 3 runs of each
    uv run python benchmarks/app_help.py --runs 5

`python apps/NAME --help` is timed with this environment's interpreter; `uv run` adds its own
environment check on top (timed once per app, as `uv_run_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tephra.core.machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "app_help.json"
CONFIGS = {
    "ppo": "tephra.apps.ppo.config",
    "sft": "tephra.apps.sft.config",
    "eval": "tephra.apps.eval.config",
}


def seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    for app, module in CONFIGS.items():
        helps = [seconds([sys.executable, f"apps/{app}", "--help"]) for _ in range(args.runs)]
        imports = [seconds([sys.executable, "-c", f"import {module}"]) for _ in range(args.runs)]
        out[app] = {
            "help_s": round(statistics.median(helps), 3),
            "import_config_s": round(statistics.median(imports), 3),
            "uv_run_s": round(seconds(["uv", "run", f"apps/{app}", "--help"]), 3),
        }
        print(app, out[app], flush=True)
    result = {
        "command": "uv run python benchmarks/app_help.py --runs " + str(args.runs),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "runs": args.runs,
        "median_s": out,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
