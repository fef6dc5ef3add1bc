"""Peak activation memory per rank for one long packed sequence, Ulysses SP=1 vs SP=2.

    uv run python benchmarks/long_context.py            # 8192 tokens -> results/long_context.json
    uv run python benchmarks/long_context.py --quick    # 512 tokens, prints only

Measure: CPU, FSDPEngine (engine=fsdp) on a small Qwen2 built from a transformers config.
Each configuration runs in fresh processes (`run_distributed`, 1 rank for SP=1, 2 gloo
ranks for SP=2). Per rank, after the engine is built and one warm-up step has allocated the
gradients and allocator pools, the kernel's resident-set peak is reset (`5` written to
/proc/self/clear_refs resets VmHWM); then one `forward_backward` runs on the sequence and

    activation peak = VmHWM (after) - VmRSS (before)

in MiB. Torch's CPU allocator returns large blocks to the OS, so the resident-set peak sees
every activation tensor; tracemalloc does not see torch's allocations, and torch.profiler's
CPU memory view adds overhead of its own. The number includes transient buffers (the
attention scores of the math SDPA kernel, `[heads / sp, T, T]` per layer), which is what
decides whether a sequence fits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from memory_peak import SMALL_QWEN2, reset_peak, status_mib

MODEL = SMALL_QWEN2


def measure(sp: int, tokens: int) -> float:
    """Rank body: activation peak (MiB) of one forward_backward on `tokens` tokens."""
    import torch

    from tephra.engine_api import EngineConfig, ModelConfig
    from tephra.engine_api.testing import nll_loss_fn, random_batch
    from tephra.engine_fsdp import FSDPEngine

    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(hf_config=MODEL),
        device="cpu",
        micro_batch={"max_tokens_per_microbatch": tokens},
        parallel={"context": sp},
    )
    engine = FSDPEngine.build(config)
    half = tokens // 2
    batch = random_batch(
        MODEL["vocab_size"],
        num_sequences=1,
        prompt_lengths=(half, half + 1),
        response_lengths=(tokens - half, tokens - half + 1),
        seed=0,
    )
    with engine.train_mode():
        engine.forward_backward(batch, nll_loss_fn)  # warm-up: gradients, pools
        before = reset_peak()
        engine.forward_backward(batch, nll_loss_fn)
        after = status_mib("VmHWM")
    return after - before


def main() -> None:
    from tephra.engine_api.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens, no json written")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    tokens = 512 if args.quick else args.tokens
    peaks = {}
    for sp in (1, 2):
        per_rank = run_distributed(measure, world_size=sp, args=(sp, tokens), timeout=3000)
        peaks[sp] = max(per_rank)
        print(f"SP={sp}: peak activation memory per rank {per_rank} MiB")
    result = {
        "tokens": tokens,
        "model": MODEL,
        "device": "cpu",
        "method": "VmHWM - VmRSS around one forward_backward, fresh processes per config",
        "peak_activation_mib_per_rank_sp1": round(peaks[1], 1),
        "peak_activation_mib_per_rank_sp2": round(peaks[2], 1),
        "ratio_sp2_over_sp1": round(peaks[2] / peaks[1], 3),
    }
    print(json.dumps(result, indent=2))
    if not args.quick:
        out = Path(__file__).parent / "results" / "long_context.json"
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
