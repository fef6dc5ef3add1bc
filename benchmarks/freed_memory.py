"""Actor updates with and without `tephra.core.retain_freed_memory`, side by side: glibc's
defaults (large blocks unmapped on free, so each update faults their pages in again) against
raised mmap/trim thresholds (freed blocks reused). Writes `results/freed_memory.json`.

    uv run python benchmarks/freed_memory.py            # 3 processes each way, 8 updates each
    uv run python benchmarks/freed_memory.py --quick    # 1 process each way, 4 updates

The setting is per process, so each way runs in fresh processes, alternating (default,
retain, default, ...) so machine load hits both alike. Each process builds engine-fsdp on the
SmolLM2-135M shape (bf16 compute, fp32 master weights, 2 threads) and runs forward, backward
and an optimizer step on the demo's batch shape, a new batch of other lengths each update
(as RL steps have); the first update (warm-up) is left out. Reported: the median update,
the page faults per update and resident memory after the last update.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "freed_memory.json"


def one_process(retain: bool, updates: int) -> dict:
    import torch

    from tephra.controller.data.smollm2 import smollm2_folder
    from tephra.core import cpu_name, retain_freed_memory
    from tephra.engine_api.config import EngineConfig
    from tephra.engine_api.testing import nll_loss_fn
    from tephra.engine_fsdp import FSDPEngine

    sys.path.insert(0, str(Path(__file__).parent))
    from actor_update import demo_batch

    torch.set_num_threads(2)
    kept = retain and retain_freed_memory()
    engine = FSDPEngine.build(
        EngineConfig(
            model={"path": str(smollm2_folder())},
            device="cpu",
            precision={"param_dtype": "bfloat16"},
            optimizer={"lr": 1e-6},
        )
    )
    vocab = engine.hf_model.config.vocab_size
    seconds, faults = [], []
    for i in range(updates):
        batch = demo_batch(vocab, seed=i)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        with engine.train_mode():
            engine.forward_backward(batch, nll_loss_fn)
            engine.optimizer_step()
        seconds.append(round(time.perf_counter() - start, 3))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {
        "retained": kept,
        "seconds": seconds,
        "page_faults": faults,
        "rss_mb": pages * resource.getpagesize() >> 20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 process each way, 4 updates")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes each way")
    parser.add_argument("--updates", type=int, default=8, help="updates per process")
    parser.add_argument("--child", choices=["default", "retain"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(args.child == "retain", args.updates)))
        return
    processes, updates = (1, 4) if args.quick else (args.processes, args.updates)
    runs: dict[str, list[dict]] = {"default": [], "retain": []}
    for _ in range(processes):
        for way in runs:
            out = subprocess.run(
                [sys.executable, __file__, "--child", way, "--updates", str(updates)],
                check=True,
                capture_output=True,
                text=True,
            )
            runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for way, rs in runs.items():
        summary[way] = {
            "median_update_s": statistics.median(s for r in rs for s in r["seconds"][1:]),
            "median_page_faults": statistics.median(f for r in rs for f in r["page_faults"][1:]),
            "rss_mb_after": statistics.median(r["rss_mb"] for r in rs),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
        }
    result = {
        "machine": runs["default"][0]["machine"],
        "workload": f"SmolLM2-135M shape, bf16, demo batch (32 rows, other lengths each "
        f"update), {updates} updates per process (first left out), "
        f"{processes} processes each way, alternating",
        "summary": summary,
        "update_time_ratio_default_over_retain": summary["default"]["median_update_s"]
        / summary["retain"]["median_update_s"],
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("machine", "summary", "update_time_ratio_default_over_retain")},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
