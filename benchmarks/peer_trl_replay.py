"""Are tephra and TRL the same learner? Both train on the very same samples, then compare.

    uv sync --all-packages --group bench
    uv run python benchmarks/peer_trl_replay.py --steps 4 --seeds 10   # results/peer_trl_replay.json

`peer_trl.py` compares the two frameworks' held-out accuracy after a few steps, but each
samples its own responses, so that comparison carries the sampling noise of 32 responses a
step. This script removes it: tephra trains `--steps` steps of the `peer_trl.py` workload and
dumps every step's samples (`trainer.dump_generations=1`: prompt and response token ids,
rewards, advantages); TRL's `GRPOTrainer` then trains from the same initial weights on the
same prompts, its generation replaced by tephra's responses of that step, token for token.
Everything else is TRL's own: prompt templating, reward call, advantages, loss, clipping and
AdamW. Compared, step by step and at the end:

- the prompt token ids (TRL's chat templating vs tephra's), the rewards and the advantages;
- how far the rollout's log-probs of its samples are from the actor's recomputed ones (the
  rollout sampled the weights being trained);
- the pre-clip gradient norm (at step 1 both start from the same weights and batch, so it
  agrees to float32 summation order; later steps start from weights that moved alike);
- the weights after the last step: the cosine between the two updates (W - W0) and the
  norm of their difference relative to the update;
- greedy held-out accuracy of both trained models and of the untrained one, all three scored
  by the one evaluator `peer_trl.py` uses for TRL (`--val-size` items; 0 skips it).

AdamW's first steps move each weight by about lr * sign(grad), so an entry whose gradient is
float32 noise (~1e-9) can move either way in each framework: the cosine sits a little under
1 for that reason alone; a different loss or normalisation would show in the grad norms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from peer_trl import (  # noqa: E402
    SETTINGS,
    THREADS,
    greedy_accuracy,
    machine,
    tephra_overrides,
    trl_records,
    trl_trainer,
)

RESULTS = Path(__file__).parent / "results" / "peer_trl_replay.json"


def run_tephra(steps: int, seed: int, run_dir: Path) -> tuple[list[list[dict]], list[dict]]:
    """tephra's run: each step's dumped samples, and its metrics. The trainer recomputes the
    samples' log-probs (`rollout_correction=tis`) so that `rollout_corr/*` tells how far the
    rollout's log-probs are from the actor's: the rollout sampled the current weights if
    ~0. Its weights (min(ratio, 2)) are 1 up to that gap, so the update stays TRL's."""
    from tephra.apps.ppo.main import parse_config, run

    run(
        parse_config(
            tephra_overrides(
                steps,
                8,
                str(run_dir),
                [
                    "trainer.val_after=false",
                    "trainer.export_hf=true",
                    "trainer.dump_generations=1",
                    "algorithm.rollout_correction=tis",
                ],
                seed,
            )
        )
    )
    samples = [
        [
            json.loads(line)
            for line in (run_dir / "generations" / f"train_step{k}.jsonl").read_text().splitlines()
        ]
        for k in range(1, steps + 1)
    ]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return samples, [r for r in records if "actor/grad_norm" in r]


def run_trl_on(samples: list[list[dict]], steps: int, seed: int):
    """TRL on tephra's samples: its prompt ids, rewards, advantages, grad norms and trainer."""
    import torch

    from tephra.controller.step.scoring import Scorer

    prepared, train, _ = trl_records(steps, 8, seed)
    trainer, tok = trl_trainer(prepared.model_path, train, steps, seed, Scorer())
    seen = {"prompt_ids": [], "rewards": [], "advantages": []}

    def replay(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        step = samples[len(seen["prompt_ids"])]
        if len(prompt_ids) != len(step):
            raise SystemExit(
                f"TRL asked for {len(prompt_ids)} completions, tephra made {len(step)}"
            )
        seen["prompt_ids"].append([list(p) for p in prompt_ids])
        return [s["response_ids"] for s in step], None

    score = trainer._generate_and_score_completions

    def scored(inputs):
        out = score(inputs)
        seen["advantages"].append(out["advantages"].tolist())
        return out

    trainer._generate_single_turn = replay
    trainer._generate_and_score_completions = scored
    torch.manual_seed(seed)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "reward" in e]
    seen["rewards"] = [e["reward"] for e in logs]
    return seen, [float(e["grad_norm"]) for e in logs], trainer.model, tok, prepared.model_path


def compare(steps: int, seed: int, val_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="peer_trl_replay_") as tmp:
        t0 = time.perf_counter()
        samples, metrics = run_tephra(steps, seed, Path(tmp))
        tephra_norms = [r["actor/grad_norm"] for r in metrics]
        trl_seen, trl_norms, trl_model, tok, model_path = run_trl_on(samples, steps, seed)
        after = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32)
        wall = time.perf_counter() - t0
    before = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    w0, w_tephra, w_trl = (dict(m.named_parameters()) for m in (before, after, trl_model))
    dot = na = nb = diff = 0.0
    for name, p0 in w0.items():
        a = (w_tephra[name] - p0).detach().double()
        b = (w_trl[name] - p0).detach().double()
        dot += float((a * b).sum())
        na += float((a * a).sum())
        nb += float((b * b).sum())
        diff += float(((a - b) ** 2).sum())
    prompts_equal = all(
        [s["prompt_ids"] for s in step] == trl_step
        for step, trl_step in zip(samples, trl_seen["prompt_ids"], strict=True)
    )
    accuracy = {}
    if val_size:  # the held-out items of peer_trl.py's rounds, one evaluator for all three
        from tephra.controller.step.scoring import Scorer

        val = trl_records(steps, val_size, seed)[2]
        accuracy = {
            name: greedy_accuracy(model, tok, val, Scorer())
            for name, model in (("tephra", after), ("trl", trl_model), ("untrained", before))
        }
    rewards_tephra = [sum(s["score"] for s in step) / len(step) for step in samples]
    adv_gap = max(
        abs(s["advantage"] - a)
        for step, advs in zip(samples, trl_seen["advantages"])
        for s, a in zip(step, advs, strict=True)
    )
    return {
        "seed": seed,
        "steps": steps,
        "prompt_ids_equal": prompts_equal,
        "reward_mean": {"tephra": rewards_tephra, "trl": trl_seen["rewards"]},
        "advantage_max_abs_diff": adv_gap,
        "grad_norm": {
            "tephra": tephra_norms,
            "trl": trl_norms,
            "relative_diff": [abs(a - b) / b for a, b in zip(tephra_norms, trl_norms)],
        },
        "rollout_vs_actor_log_prob_abs_gap": [
            r["rollout_corr/log_prob_abs_gap_mean"] for r in metrics
        ],
        "rollout_vs_actor_ratio_max": [r["rollout_corr/ratio_max"] for r in metrics],
        "update_cosine": dot / math.sqrt(na * nb),
        "update_diff_over_update_norm": math.sqrt(diff / nb),
        "update_norm": {"tephra": math.sqrt(na), "trl": math.sqrt(nb)},
        "val_accuracy": accuracy,
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--val-size",
        type=int,
        default=200,
        help="held-out items to score the trained models on (0: none)",
    )
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    rounds = [compare(args.steps, seed, args.val_size) for seed in args.seeds]
    settings = {**SETTINGS, "steps": args.steps, "val_size": args.val_size}
    result = {"settings": settings, "machine": machine(), "rounds": rounds}
    Path(args.results).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(rounds, indent=2))


if __name__ == "__main__":
    main()
