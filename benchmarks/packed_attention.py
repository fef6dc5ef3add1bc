"""Activation memory and time of one packed megatron step: per-sequence attention vs the dense mask.

    uv run python benchmarks/packed_attention.py            # 8192 tokens -> results/packed_attention.json
    uv run python benchmarks/packed_attention.py --quick    # 1024 tokens, prints only

Measure: CPU, MegatronEngine (engine=megatron) on a small Qwen2 built from a transformers
config (GQA: 4 query heads on 2 key/value heads), one packed micro-batch of `--tokens` tokens
made of `--sequences` sequences of equal length. Two attention paths, each in a fresh process:
- `plan`: the engine as it is (per-sequence SDPA blocks from the attention plan, grouped
  heads through SDPA's own GQA, no mask);
- `dense`: the engine's attention before this change, re-created here for the comparison: a
  block-diagonal causal bool mask `[1, 1, S, S]` over the packed row (built from the same
  plan), keys/values `repeat_interleave`d to every query head, one SDPA over the whole row.
Per process, after the engine is built and one warm-up step has allocated the gradients, the
resident-set peak is reset (`5` into /proc/self/clear_refs); one `forward_backward` then runs:

    activation peak = VmHWM (after) - VmRSS (before)     in MiB (transients included)
    saved for backward = bytes of the distinct storages autograd saves during the step,
                         weights left out

Only ratios measured in one run are compared (the machine is shared and CPUs differ).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from memory_peak import SMALL_QWEN2, reset_peak, status_mib

MODEL = SMALL_QWEN2


def _dense_blocks(q, k, v, plan, scale, dropout_p):
    """Today's path before the change: one dense block-diagonal causal mask over the row."""
    import torch

    s, b, heads = q.shape[0], q.shape[1], q.shape[2]
    seg = torch.full((b, s), -1, dtype=torch.long)
    for j, (row, q0, q1, _, _) in enumerate(plan):
        seg[row, q0:q1] = j
    same = seg[:, :, None] == seg[:, None, :]
    mask = (same & torch.ones(s, s, dtype=torch.bool).tril())[:, None]  # [b, 1, S, S]
    rep = heads // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1),
        v.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1),
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
    )
    return out.permute(2, 0, 1, 3)


def measure(path: str, tokens: int, sequences: int) -> dict:
    """Rank body: activation peak (MiB), saved-for-backward bytes and step time."""
    import torch

    from tephra.engine_api import EngineConfig
    from tephra.engine_api.testing import nll_loss_fn, random_batch
    from tephra.engine_megatron import core_attention
    from tephra.engine_megatron.engine import MegatronEngine

    torch.set_num_threads(1)
    if path == "dense":
        core_attention._torch_blocks = _dense_blocks
    engine = MegatronEngine.build(
        EngineConfig(
            model={"hf_config": MODEL},
            micro_batch={"max_tokens_per_microbatch": tokens, "use_packing": True},
        )
    )
    length = tokens // sequences
    batch = random_batch(
        MODEL["vocab_size"],
        num_sequences=sequences,
        prompt_lengths=(length // 2, length // 2 + 1),
        response_lengths=(length - length // 2, length - length // 2 + 1),
        seed=0,
    )
    saved: dict[int, int] = {}
    # weights live in megatron's flat parameter buffers: not activations
    weights = {p.untyped_storage().data_ptr() for c in engine.chunks for p in c.parameters()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with engine.train_mode():
        engine.forward_backward(batch, nll_loss_fn)  # warm-up: gradients, pools
        before = reset_peak()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = engine.forward_backward(batch, nll_loss_fn)["loss"]
        seconds = time.perf_counter() - start
        after = status_mib("VmHWM")
    return {
        "activation_peak_mib": round(after - before, 1),
        "saved_for_backward_mib": round(sum(saved.values()) / 2**20, 1),
        "step_seconds": round(seconds, 2),
        "loss": loss,
    }


def main() -> None:
    from tephra.core.machine import cpu_fields
    from tephra.engine_api.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024 tokens, no json written")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sequences", type=int, default=16)
    args = parser.parse_args()
    tokens = 1024 if args.quick else args.tokens
    runs = {}
    for path in ("plan", "dense"):
        (runs[path],) = run_distributed(measure, 1, (path, tokens, args.sequences), timeout=3000)
        print(path, runs[path])
    cpu = cpu_fields()
    flags = set(cpu.get("flags", "").split())
    result = {
        "tokens": tokens,
        "sequences": args.sequences,
        "model": MODEL,
        "device": "cpu",
        "cpu": cpu.get("model name", "unknown"),
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "method": "VmHWM - VmRSS around one forward_backward after a warm-up, fresh process "
        "per path; saved-for-backward = distinct storages autograd saved, weights left out; torch on 1 thread",
        "plan": runs["plan"],
        "dense": runs["dense"],
        "ratio_activation_peak_plan_over_dense": round(
            runs["plan"]["activation_peak_mib"] / runs["dense"]["activation_peak_mib"], 3
        ),
        "ratio_saved_plan_over_dense": round(
            runs["plan"]["saved_for_backward_mib"] / runs["dense"]["saved_for_backward_mib"], 3
        ),
        "ratio_time_plan_over_dense": round(
            runs["plan"]["step_seconds"] / runs["dense"]["step_seconds"], 3
        ),
        "loss_difference": abs(runs["plan"]["loss"] - runs["dense"]["loss"]),
    }
    print(json.dumps(result, indent=2))
    if not args.quick:
        out = Path(__file__).parent / "results" / "packed_attention.json"
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
