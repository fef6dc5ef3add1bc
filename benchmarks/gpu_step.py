"""The stages of an RL step on one CUDA device, without Ray: `hf` rollout generation, the
actor's log-prob pass and update (FSDP engine, bf16 compute, fp32 master weights, fused
log-prob kernel) and the weight sync into the rollout.

    python benchmarks/gpu_step.py [--out benchmarks/results/gpu_step.json] [--quick]

The model has SmolLM2-135M's shape (llama, 30 layers, hidden 576, 9/3 heads, 49,152-token
vocabulary, tied embeddings; MLP 1152 wide) with random weights, built from a config, so it
runs where no model can be downloaded. Sampling ignores EOS, so every response is exactly
`max_tokens` long. Workloads: the demo's (4 prompts x 8 samples x 32 tokens) and a larger one
(32 prompts x 8 samples x 256 tokens). One warm-up step, then the median of the timed steps.
Also reported: the largest gap between the rollout's and the engine's log-probs of the same
tokens (both bf16), which says the two paths compute the same model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig
from tephra.engine_api.testing import nll_loss_fn
from tephra.engine_fsdp import FSDPEngine
from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.testing import build_tiny_model

RESULTS = Path(__file__).parent / "results" / "gpu_step.json"
SHAPE = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    tie_word_embeddings=True,
    initializer_range=0.02,
)
WORKLOADS = {"demo": (4, 8, 32, 64), "large": (32, 8, 256, 128)}
"""name: (prompts, samples per prompt, response tokens, prompt tokens)"""


def _synced() -> float:
    if torch.cuda.is_available():  # GPU work is asynchronous: wait for it before reading
        torch.cuda.synchronize()
    return time.perf_counter()


def step(rollout, engine, prompts, sampling) -> dict[str, float]:
    t0 = _synced()
    out = rollout.generate(prompts, sampling)
    t1 = _synced()
    batch = out.to_batch(pad_token_id=0)
    with engine.eval_mode():
        old = engine.forward(batch)["log_probs"]
    t2 = _synced()
    with engine.train_mode():
        engine.forward_backward(batch, nll_loss_fn)
        engine.optimizer_step()
    t3 = _synced()
    rollout.update_weights(w for bucket in engine.export_weights() for w in bucket)
    t4 = _synced()
    mask = batch[B.RESPONSE_MASK].bool()
    gap = (old.float().cpu() - batch["rollout_log_probs"])[mask].abs().max()
    tokens = int(mask.sum())
    return {
        "generate_s": t1 - t0,
        "log_prob_s": t2 - t1,
        "update_s": t3 - t2,
        "sync_s": t4 - t3,
        "step_s": t4 - t0,
        "generated_tokens_per_s": tokens / (t1 - t0),
        "max_abs_logprob_gap": float(gap),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per workload")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 2-layer model, the demo workload only, 1 timed step (also runs "
        "on a CPU, to check the script)",
    )
    args = parser.parse_args()
    shape = {**SHAPE, "num_layers": 2} if args.quick else SHAPE
    steps = 1 if args.quick else args.steps
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model_shape": shape,
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", **shape)
        rollout = get_rollout(
            "hf",
            RolloutConfig(
                model_path=model.path, max_model_len=512, dtype="bfloat16", hf={"device": device}
            ),
        )
        engine = FSDPEngine.build(
            EngineConfig(
                model=ModelConfig(path=model.path),
                device=device,
                precision={"param_dtype": "bfloat16"},
                optimizer={"lr": 1e-6},
            )
        )
        gen = torch.Generator().manual_seed(0)
        workloads = {"demo": WORKLOADS["demo"]} if args.quick else WORKLOADS
        for name, (n_prompts, n, max_tokens, prompt_len) in workloads.items():
            prompts = torch.randint(
                10, model.vocab_size - 10, (n_prompts, prompt_len), generator=gen
            ).tolist()
            sampling = SamplingParams(
                temperature=1.0, max_tokens=max_tokens, n=n, seed=1, ignore_eos=True
            )
            step(rollout, engine, prompts, sampling)  # warm-up: kernels compile, caches fill
            timed = [step(rollout, engine, prompts, sampling) for _ in range(steps)]
            summary = {k: round(statistics.median(t[k] for t in timed), 4) for k in timed[0]}
            summary["max_abs_logprob_gap"] = max(t["max_abs_logprob_gap"] for t in timed)
            results["workloads"][name] = {
                "prompts": n_prompts,
                "n": n,
                "max_tokens": max_tokens,
                "prompt_tokens": prompt_len,
                **summary,
            }
            print(name, json.dumps(results["workloads"][name]), flush=True)
        rollout.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
