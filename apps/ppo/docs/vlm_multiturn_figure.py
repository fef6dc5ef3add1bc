"""Draws the README's before/after figure of a `-p vlm_demo_multiturn` run from its metrics.

uv run python apps/ppo/docs/vlm_multiturn_figure.py runs/vlm_demo_multiturn
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)


def main(run_dir: Path, out: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    val = [r for r in records if "val/mean@1" in r]
    train = [r for r in records if "reward/mean" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [r["step"] for r in val]
    left.plot(steps, [r["val/mean@1"] for r in val], "o-", label="mean reward (partial credit)")
    left.plot(steps, [r["val/acc@1"] for r in val], "s-", label="both answers right")
    left.set(xlabel="GRPO step", ylabel="held-out, greedy (100 episodes)", ylim=(0, 1))
    left.set_title("two-turn colour_squares, held out")
    left.legend(loc="upper left")
    window = 10
    smooth = [
        sum(r["reward/mean"] for r in train[max(0, i - window + 1) : i + 1])
        / len(train[max(0, i - window + 1) : i + 1])
        for i in range(len(train))
    ]
    right.plot([r["step"] for r in train], smooth)
    right.set(xlabel="GRPO step", ylabel=f"training reward ({window}-step mean)", ylim=(0, 1))
    right.set_title("4 prompts x 8 episodes a step, temperature 1")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).parent / "vlm_multiturn_demo.png")
