"""One actor update (forward + backward) of the demo's batch shape on engine-fsdp, side by
side: packed micro-batches, padded rows, and padded rows with shared prompt prefixes
(`micro_batch.share_prefix`). Reports seconds per update, ratios to packed, and writes
`results/actor_update.json`.

    uv run python benchmarks/actor_update.py                 # SmolLM2-135M shape, 5 repeats
    uv run python benchmarks/actor_update.py --quick         # 2 repeats

The batch is the demo's: 4 prompts x 8 samples, 45-token prompts, 20-32-token responses,
bf16 compute with fp32 master weights, 2 threads, one micro-batch. Layouts are interleaved
(one update of each per round) so machine load hits all alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tephra.controller.data.smollm2 import smollm2_folder
from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig
from tephra.engine_api.testing import nll_loss_fn
from tephra.engine_fsdp import FSDPEngine

LAYOUTS = {
    "packed": {"use_packing": True, "share_prefix": False},
    "padded": {"use_packing": False, "share_prefix": False},
    "padded_shared_prefix": {"use_packing": False, "share_prefix": True},
}


def demo_batch(vocab: int, groups: int = 4, n: int = 8, prompt: int = 45, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        p = torch.randint(1, vocab, (prompt,), generator=g)
        for _ in range(n):
            length = int(torch.randint(20, 33, (1,), generator=g))
            rows.append((p, torch.randint(1, vocab, (length,), generator=g)))
    width = prompt + max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, : prompt + len(r)] = torch.cat([p, r])
        attn[i, : prompt + len(r)] = 1
        resp[i, prompt : prompt + len(r)] = 1
    return B.make_batch(ids, attn, resp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    torch.set_num_threads(2)
    folder = str(smollm2_folder())
    engines = {
        name: FSDPEngine.build(
            EngineConfig(
                model={"path": folder},
                device="cpu",
                precision={"param_dtype": "bfloat16"},
                micro_batch={"max_tokens_per_microbatch": 8192, **layout},
            )
        )
        for name, layout in LAYOUTS.items()
    }
    batch = demo_batch(engines["packed"].hf_model.config.vocab_size)
    seconds: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    losses: dict[str, float] = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name, engine in engines.items():
            start = time.perf_counter()
            with engine.train_mode():
                losses[name] = engine.forward_backward(batch, nll_loss_fn)["loss"]
            engine.optimizer.zero_grad(set_to_none=True)
            if round_:
                seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "batch": "4 prompts x 8 samples, 45-token prompts, 20-32-token responses, bf16",
        "seconds": seconds,
        "median_s": median,
        "ratio_packed_over": {name: median["packed"] / m for name, m in median.items()},
        "loss": losses,
    }
    out = Path(__file__).parent / "results" / "actor_update.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_s", "ratio_packed_over", "loss")}, indent=2))


if __name__ == "__main__":
    main()
