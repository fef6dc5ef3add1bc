"""The trainer's estimated peak memory (`tephra.controller.run.memory_estimate`, which sizes a
colocated server's `gpu_memory_utilization`) beside the peak one real FSDP update reaches.

    OMP_NUM_THREADS=1 python benchmarks/colocation_estimate.py [--tokens 2048] [--layers 4]

One rank, no Ray: a random Qwen2 (hidden 256, MLP 688, 4 heads on 2 KV heads, 32k vocabulary)
is built and saved, the FSDP engine loads it (fp32 on CPU; bf16 compute with fp32 master
weights on CUDA), and one micro-batch of `--tokens` response tokens runs forward, backward
and an AdamW step. Measured: on CUDA `torch.cuda.max_memory_allocated` from before the engine
is built; on CPU the process's resident-set peak over the same span (Linux /proc, which also
counts the allocator's and the libraries' own memory). The estimate should be at or above
the measured peak: it sizes memory that must not run out.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from memory_peak import reset_peak, status_mib

from tephra.controller.run.memory_estimate import GIB, EngineShape, ModelSize, trainer_memory
from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig
from tephra.engine_api.testing import nll_loss_fn
from tephra.engine_fsdp import FSDPEngine

MIB = 1024**2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="response tokens of the batch")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    # transformers: seconds to import; only this benchmark builds a model
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device, compute = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    with tempfile.TemporaryDirectory() as tmp:
        config = AutoConfig.for_model(
            "qwen2",
            vocab_size=32000,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.tokens + 16,
            tie_word_embeddings=False,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        size = ModelSize.of_model(tmp)
        ids = torch.randint(
            1, 32000, (1, args.tokens + 8), generator=torch.Generator().manual_seed(0)
        )
        attn = torch.ones_like(ids)
        resp = torch.zeros_like(ids)
        resp[:, 8:] = 1
        batch = B.make_batch(ids, attn, resp)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = reset_peak() * MIB
        engine = FSDPEngine.build(
            EngineConfig(
                model=ModelConfig(path=tmp, gradient_checkpointing=args.checkpointing),
                device=device,
                precision={"param_dtype": compute},
                micro_batch={"max_tokens_per_microbatch": args.tokens + 8},
            )
        )
        with engine.train_mode():
            engine.forward_backward(batch, nll_loss_fn)
            engine.optimizer_step()
        peak = torch.cuda.max_memory_allocated() if cuda else status_mib("VmHWM") * MIB
        measured = peak - base
    shape = EngineShape(
        compute_dtype=compute,
        master_dtype="float32",
        shard=1,
        tensor=1,
        context=1,
        tokens_per_microbatch=args.tokens + 8,
        gradient_checkpointing=args.checkpointing,
        fused_head=True,
    )
    estimate = trainer_memory(size, shape)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "params": size.params,
        "tokens": args.tokens + 8,
        "gradient_checkpointing": args.checkpointing,
        "estimate_gib": round(estimate.peak / GIB, 3),
        "estimate": estimate.describe(size, 1),
        "measured_gib": round(measured / GIB, 3),
        "estimate_over_measured": round(estimate.peak / measured, 2),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
