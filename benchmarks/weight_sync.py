"""Time one full weight sync of the demo's model shape per bucket size, through the rollout's
real transport code, on CPU.

The model has SmolLM2-135M's shape (`gpu_step.SHAPE`: llama, 30 layers, hidden 576, tied
embeddings) with random weights. The sender is a `vllm` rollout's `update_weights` (buckets
of `weight_bucket_mb`, cast to bfloat16 on the sender, the tied head added, the four-phase
requests); the receiver is the stand-in server process of the tests
(`packages/rollout/tests/weight_receiver.py`), which receives each bucket with the server
plugin's own code and copies every tensor out, as a server's `load_weights` does. Two
transports: `gloo` (the CPU default: a broadcast between the two processes) and `ipc` as CPU
shared memory (the code that carries CUDA IPC handles on a GPU). The real vLLM CPU server is
left out: its start-up and a 135M model would take minutes of a shared 2-core machine, and
the transfer code timed here is the same. Each bucket size is reported as the median of
`--repeats` syncs and as a ratio to the default bucket size (256 MiB).

    uv run python benchmarks/weight_sync.py [--repeats 3] [--out results/weight_sync.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from gpu_step import SHAPE
from safetensors.torch import load_file

from tephra.core import cpu_name
from tephra.rollout import RolloutConfig, ServerSettings, get_rollout
from tephra.rollout.testing import build_tiny_model

RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
RECEIVER = Path(__file__).parents[1] / "packages" / "rollout" / "tests" / "weight_receiver.py"
BUCKETS_MB = (4, 16, 64, 256, 1024)
DEFAULT_MB = ServerSettings.weight_bucket_mb


def time_syncs(
    model_path: str, weights: list, transport: str, bucket_mb: float, repeats: int
) -> dict:
    receiver = subprocess.Popen(
        [sys.executable, str(RECEIVER), "cpu"], stdout=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{int(receiver.stdout.readline())}"
        rollout = get_rollout(
            "vllm",
            RolloutConfig(
                model_path=model_path,
                dtype="bfloat16",
                max_model_len=512,
                vllm=ServerSettings(url=url, weight_bucket_mb=bucket_mb, request_timeout_s=600),
            ),
        )
        try:
            rollout.transport = transport
            seconds = []
            for _ in range(repeats + 1):  # the first opens the transport: left out
                rollout.update_weights(iter(weights))
                seconds.append(rollout.last_update_stats["seconds"])
            stats = rollout.last_update_stats
            return {
                "median_s": round(statistics.median(seconds[1:]), 3),
                "seconds": [round(s, 3) for s in seconds[1:]],
                "buckets": stats["buckets"],
                "max_bucket_mb": round(stats["max_bucket_bytes"] / 2**20, 1),
                "mb": round(stats["bytes"] / 2**20, 1),
            }
        finally:
            rollout.close()
    finally:
        receiver.kill()
        receiver.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per bucket size")
    args = parser.parse_args()
    results = {
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "model_shape": SHAPE,
        "dtype": "bfloat16",
        "default_bucket_mb": DEFAULT_MB,
        "transports": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", **SHAPE)
        gen = torch.Generator().manual_seed(0)
        state = load_file(str(Path(model.path) / "model.safetensors"))
        # what an engine exports: float32, the tied head left out (the rollout adds it)
        weights = [
            (name, torch.randn(t.shape, generator=gen))
            for name, t in state.items()
            if name != "lm_head.weight"
        ]
        for transport in ("gloo", "ipc"):
            timings = {}
            for mb in BUCKETS_MB:
                timings[str(mb)] = time_syncs(model.path, weights, transport, mb, args.repeats)
                print(transport, mb, json.dumps(timings[str(mb)]), flush=True)
            default = timings[str(int(DEFAULT_MB))]["median_s"]
            for row in timings.values():
                row["ratio_to_default"] = round(row["median_s"] / default, 3)
            results["transports"][
                "ipc (CPU shared memory)" if transport == "ipc" else transport
            ] = timings
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
