"""The Ray smoke on one device: apps/ppo's `smoke` preset (two GRPO steps of a tiny random
Qwen2, engine=fsdp, the in-process `hf` rollout) under Ray, with the ranks' bundles on a
placement group that holds the GPU. Written for the GPU machine (`gpu_check.sh ray`), runnable
on a CPU (`--device cpu`) to check everything but CUDA.

    python benchmarks/gpu_ray.py [--device cuda|cpu] [--out benchmarks/results/gpu_ray.json]

Two parts, both recorded:
1. placement: Ray started as tephra starts it (`ray_init`) with the device's GPUs, a
   placement group of one bundle `{"CPU": 1, "GPU": 1}` (CPU only with --device cpu) and an
   actor on it that reports what Ray set (`CUDA_VISIBLE_DEVICES`, `ray.get_gpu_ids()`), the
   device tephra's workers derive from it (`device_from_assignment`) and a CUDA tensor made
   there.
2. the app: apps/ppo `-p smoke` with `resources.gpus_per_rank=1`, on a small
   verl-format parquet written here (arithmetic prompts scored by `gsm8k_flexible`: the
   smoke's default data, reasoning-gym, is not installed on the GPU machine; the jsonl tracker
   where matplotlib imports, which its reward-curve plot needs, else console). Recorded: its
   exit status, the summary line (steps, seconds, start-up phases), the weight-transport line
   (the in-process hf rollout gets the trainer's tensors copied in place; CUDA IPC is the
   transport of a vLLM/SGLang server on the trainer's GPU, checked by the `gpu`-marked
   transport tests), the last step's metrics, and the tail of its log on failure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

RESULTS = Path(__file__).parent / "results" / "gpu_ray.json"


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def write_parquet(path: Path, n: int, seed: int) -> None:
    """`n` verl-format rows: `a + b` questions, the sum as ground truth."""
    rows = []
    for i in range(n):
        a, b = (seed * 7 + i * 3) % 10, (seed * 5 + i * 7) % 10
        rows.append(
            {
                "prompt": [
                    {"role": "user", "content": f"What is {a} + {b}? Answer with the number."}
                ],
                "data_source": "gsm8k_flexible",
                "reward_model": {"ground_truth": str(a + b), "style": "rule"},
                "extra_info": {"index": i},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def placement(device: str) -> dict[str, Any]:
    """Start Ray, place one actor on a placement-group bundle (with the GPU on CUDA), and
    return what the actor saw."""
    import ray  # the part's subject: imported here so that `--help` needs no Ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tephra.controller.cluster.worker_group import ray_init

    gpus = 1 if device == "cuda" else 0
    t0 = time.perf_counter()
    # tephra's own start: a private local session, workers on the driver's interpreter and
    # PYTHONPATH (the GPU machine's installs live on it), as the app's workers get them
    ray_init(num_cpus=2, num_gpus=gpus)
    started = time.perf_counter() - t0
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
    group = placement_group([bundle], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)

    @ray.remote(num_cpus=1, num_gpus=gpus)
    class Probe:
        def report(self) -> dict[str, Any]:
            import torch

            from tephra.controller.cluster.worker_group import device_from_assignment

            ids = ray.get_gpu_ids()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            dev, local_rank = device_from_assignment(ids, visible)
            out: dict[str, Any] = {
                "ray_gpu_ids": [str(i) for i in ids],
                "CUDA_VISIBLE_DEVICES": visible,
                "tephra_device": dev,
                "local_rank": local_rank,
                "cuda_available": torch.cuda.is_available(),
            }
            if dev.startswith("cuda"):
                x = torch.arange(4.0, device=dev) * 2
                out["cuda_tensor_sum"] = float(x.sum())
                out["gpu_name"] = torch.cuda.get_device_name(local_rank)
            return out

    probe = Probe.options(  # type: ignore[attr-defined]
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0
        )
    ).remote()
    seen = ray.get(probe.report.remote(), timeout=120)
    result = {
        "ray": ray.__version__,
        "ray_init_s": round(started, 2),
        "cluster_resources": {
            k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")
        },
        "bundle": bundle,
        "actor": seen,
    }
    ray.kill(probe)
    remove_placement_group(group)
    ray.shutdown()
    return result


def run_app(device: str, work: Path, timeout: int) -> dict[str, Any]:
    """apps/ppo's smoke preset under Ray, on this script's parquet; its figures."""
    train, val = work / "train.parquet", work / "val.parquet"
    write_parquet(train, 32, seed=1)
    write_parquet(val, 8, seed=2)
    run_dir = work / "run"
    # the jsonl tracker draws the reward curve at the end with matplotlib, which the GPU
    # machine may lack: the console tracker then (the metrics are still printed)
    tracker = "jsonl" if _importable("matplotlib") else "console"
    args = [
        "-p",
        "smoke",
        "data.source=parquet",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"trainer.run_dir={run_dir}",
        "resources.num_cpus=2",
        "resources.cpus_per_rank=1",
        f"resources.gpus_per_rank={1 if device == 'cuda' else 0}",
        f"trainer.trackers=[{tracker}]",
    ]
    # what `uv run apps/ppo` runs (apps/ppo/__main__.py), without uv
    cmd = [sys.executable, "-c", "from tephra.apps.ppo.cli import main; main()", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    lines = (proc.stdout + proc.stderr).splitlines()
    summary = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{") and '"status"' in line:
            summary = json.loads(line)
            break
    metrics_file = run_dir / "metrics.jsonl"
    steps = (
        [json.loads(x) for x in metrics_file.read_text().splitlines()]
        if metrics_file.exists()
        else []
    )
    last = steps[-1] if steps else {}
    return {
        "command": "apps/ppo " + " ".join(args),
        "returncode": proc.returncode,
        "tracker": tracker,
        "wall_s": round(seconds, 1),
        "summary": summary,
        "weight_transport": next((x for x in lines if "weight transport:" in x), None),
        "steps_recorded": len(steps),
        "last_step_metrics": {
            k: v
            for k, v in last.items()
            if any(s in k for s in ("reward", "grad_norm", "loss", "step", "time", "tokens"))
        },
        "log_tail": None if proc.returncode == 0 else lines[-40:],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--timeout", type=int, default=300, help="seconds for the app run")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"device": args.device, "python": sys.version.split()[0]}
    try:
        result["placement"] = placement(args.device)
    except Exception as exc:  # record and go on: the app run says more
        result["placement"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    print("placement:", json.dumps(result["placement"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="tephra-ray-") as tmp:
        try:
            result["app"] = run_app(args.device, Path(tmp), args.timeout)
        except subprocess.TimeoutExpired:
            result["app"] = {"error": f"the app ran past --timeout={args.timeout} s"}
    app = result["app"]
    print(
        "app:",
        json.dumps(
            {
                k: app.get(k)
                for k in ("returncode", "wall_s", "summary", "weight_transport", "error")
            }
        ),
        flush=True,
    )
    result["ok"] = (
        "error" not in result["placement"]
        and app.get("returncode") == 0
        and (app.get("summary") or {}).get("status") == "completed"
        and (args.device == "cpu" or result["placement"]["actor"].get("cuda_tensor_sum") == 12.0)
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"ok={result['ok']}; wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
