"""Peak host memory per rank of megatron's weight export at TP=2: gathered (before) vs streamed.

    uv run python benchmarks/streamed_export.py            # -> results/streamed_export.json
    uv run python benchmarks/streamed_export.py --quick    # a smaller model, prints only

Measure: CPU, 2 gloo processes, MegatronEngine at TP=2 on a Qwen2 built from a transformers
config (about 56M parameters, 224 MB in fp32; each rank holds half). Two exports, each way:
- `export_weights` (the rollout's weight sync), every bucket consumed and dropped;
- `export_hf` (rank 0 writes the folder).
`before` is the export as it was: every rank completes its shards over TP and
`all_gather_object` hands the whole model to every rank (kept as
`tephra.engine_megatron.testing.gathered_hf_weights`; its `export_hf` then loaded that dict
into a meta model on rank 0 and called `save_pretrained`). `after` is the engine's streamed
export. Per measurement the resident-set peak is reset (`5` into /proc/self/clear_refs) and

    peak = VmHWM (after) - VmRSS (before)     in MiB, per rank

`MALLOC_MMAP_THRESHOLD_` is fixed at 64 KiB so that freed tensors go back to the OS and one
measurement does not inherit the previous one's heap. Only ratios of one run are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from memory_peak import reset_peak, status_mib

MODEL = dict(
    model_type="qwen2",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
QUICK = {**MODEL, "vocab_size": 4096, "num_hidden_layers": 2}


def _gathered_export_hf(engine, path: Path) -> None:
    """`export_hf` before streaming: the gathered dict, rank 0 writes it."""
    import torch
    import torch.distributed as dist
    import transformers

    from tephra.engine_megatron.testing import gathered_hf_weights

    weights = gathered_hf_weights(engine)
    if dist.get_rank() == 0:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(engine.hf_config)
        model.load_state_dict(weights, strict=False, assign=True)
        model.save_pretrained(path)
    del weights
    dist.barrier()


def _gathered_export_weights(engine, bucket_bytes: int):
    from tephra.engine_megatron.testing import gathered_hf_weights

    weights = gathered_hf_weights(engine)
    bucket, size = [], 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def measure(model: dict, workdir: str) -> dict:
    """Rank body: per-rank peaks (MiB) and seconds of both exports, gathered and streamed."""
    import torch
    import torch.distributed as dist

    from tephra.engine_api import EngineConfig
    from tephra.engine_megatron.engine import MegatronEngine

    torch.set_num_threads(1)
    engine = MegatronEngine.build(EngineConfig(model={"hf_config": model}, parallel={"tensor": 2}))
    bucket = 64 << 20

    def peak(fn) -> tuple[float, float]:
        dist.barrier()
        before = reset_peak()
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        return round(status_mib("VmHWM") - before, 1), round(seconds, 2)

    def drain(buckets) -> None:
        for b in buckets:
            del b

    out = {}
    out["export_weights_before"] = peak(lambda: drain(_gathered_export_weights(engine, bucket)))
    out["export_weights_after"] = peak(lambda: drain(engine.export_weights(bucket_bytes=bucket)))
    out["export_hf_before"] = peak(lambda: _gathered_export_hf(engine, Path(workdir) / "before"))
    out["export_hf_after"] = peak(lambda: engine.export_hf(Path(workdir) / "after"))
    return out


def main() -> None:
    import tempfile

    from tephra.core.machine import cpu_fields
    from tephra.engine_api.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, no json written")
    args = parser.parse_args()
    model = QUICK if args.quick else MODEL
    # read by glibc when a process starts: the spawned ranks inherit it from here
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_distributed(measure, 2, (model, tmp), timeout=3000)
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: (peak MiB, seconds) {r}")
    params = sum(
        n
        for n in (
            2 * model["vocab_size"] * model["hidden_size"],
            model["num_hidden_layers"]
            * (
                model["hidden_size"] * model["hidden_size"] * 2  # q, o
                + 2 * model["hidden_size"] * model["hidden_size"] // 2  # k, v (4 of 8 heads)
                + 3 * model["hidden_size"] * model["intermediate_size"]
            ),
        )
    )
    cpu = cpu_fields()
    result = {
        "model": model,
        "parameters_about": params,
        "model_mib_fp32_about": round(params * 4 / 2**20, 1),
        "layout": "TP=2, 2 gloo processes, CPU",
        "cpu": cpu.get("model name", "unknown"),
        "method": "VmHWM - VmRSS around each export per rank (clear_refs reset), "
        "MALLOC_MMAP_THRESHOLD_=65536; before = all_gather_object of the whole model",
        "per_rank": [
            {k: {"peak_mib": v[0], "seconds": v[1]} for k, v in r.items()} for r in per_rank
        ],
    }
    for what in ("export_weights", "export_hf"):
        for rank, r in enumerate(per_rank):
            result[f"ratio_peak_after_over_before_{what}_rank{rank}"] = round(
                r[f"{what}_after"][0] / max(r[f"{what}_before"][0], 0.1), 3
            )
    print(json.dumps(result, indent=2))
    if not args.quick:
        out = Path(__file__).parent / "results" / "streamed_export.json"
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
