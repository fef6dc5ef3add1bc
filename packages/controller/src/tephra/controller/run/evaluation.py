"""Evaluation: n samples per held-out prompt, scored, summarised per data source and overall.

Metrics over a prompt's n scored samples (c of them correct, a sample being correct when its
score reaches 1), averaged over prompts:
    mean@n   mean score of the n samples
    acc@n    share of correct samples (greedy accuracy when n = 1)
    pass@k   1 - C(n - c, k) / C(n, k): the unbiased estimate of "at least one of k samples
             is correct" (Chen et al. 2021, "Evaluating Large Language Models Trained on Code")
    maj@k    whether the most frequent answer among the first k samples is a correct one
             (answers: the scorer's extracted `pred` when it gives one, else the response text
             stripped; ties go to the answer seen first)
    best@n   the highest score among the n samples
The trainer's validation (`trainer.val`) and the evaluation app use this module.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tephra.core.errors import ConfigError


@dataclass
class ValidationConfig:
    """How held-out prompts are sampled and summarised."""

    n: int = 1
    """Samples per prompt (1 with temperature 0: greedy accuracy, the default)."""
    temperature: float = 0.0
    """Sampling temperature of validation (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling of validation."""
    ks: list[int] = field(default_factory=lambda: [1])
    """The k of pass@k and maj@k (each <= n)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"val.n={self.n} must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0 or not 0 < self.top_p <= 1:
            what = "" if math.isfinite(self.temperature) else "a finite number "
            raise ConfigError(
                f"val.temperature={self.temperature} must be {what}>= 0 and "
                f"val.top_p={self.top_p} in (0, 1]"
            )
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ConfigError(
                f"val.ks={self.ks}: every k must be in [1, val.n={self.n}]; {bad} is not"
            )
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(
                f"val.n={self.n} greedy samples would all be the same; set "
                "val.temperature > 0 (e.g. 0.6) or val.n=1"
            )


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the unbiased pass@k of one prompt with c correct of n."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: list[str], correct: list[bool]) -> float:
    """1.0 when the most frequent answer (ties: the first seen) is a correct one."""
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return float(any(c for a, c in zip(answers, correct) if a == winner))


@dataclass
class EvalRow:
    """One generated sample, as written to generations.jsonl."""

    prompt: str
    response: str
    score: float
    ground_truth: Any
    data_source: str
    answer: str = ""
    """The scorer's extracted answer (`pred`) when it gives one, else the stripped response."""
    prompt_index: int = 0
    advantage: float | None = None


def summarise(rows: list[EvalRow], n: int, ks: list[int]) -> dict[str, dict[str, float]]:
    """{source: metrics} plus "all": mean@n, acc@n, pass@k, maj@k, best@n and the prompt count,
    from rows grouped by `prompt_index` (n per prompt)."""
    by_prompt: dict[int, list[EvalRow]] = defaultdict(list)
    for row in rows:
        by_prompt[row.prompt_index].append(row)
    per_source: dict[str, list[dict[str, float]]] = defaultdict(list)
    for samples in by_prompt.values():
        scores = [s.score for s in samples]
        correct = [s.score >= 1.0 for s in samples]
        c = sum(correct)
        m = {
            f"mean@{n}": sum(scores) / len(scores),
            f"acc@{n}": c / len(samples),
            f"best@{n}": max(scores),
        }
        for k in ks:
            m[f"pass@{k}"] = pass_at_k(len(samples), c, k)
            m[f"maj@{k}"] = majority_correct([s.answer for s in samples[:k]], correct[:k])
        per_source[samples[0].data_source].append(m)
        per_source["all"].append(m)
    return {
        source: {
            **{key: sum(m[key] for m in ms) / len(ms) for key in ms[0]},
            "prompts": float(len(ms)),
        }
        for source, ms in sorted(per_source.items())
    }


def flat_metrics(summary: dict[str, dict[str, float]], prefix: str = "val") -> dict[str, float]:
    """`{prefix}/<metric>` for the overall numbers, `{prefix}/<source>/<metric>` per source."""
    out = {}
    for source, metrics in summary.items():
        for key, value in metrics.items():
            out[f"{prefix}/{key}" if source == "all" else f"{prefix}/{source}/{key}"] = value
    return out


def write_jsonl(rows: list[EvalRow], path: Path) -> None:
    """One JSON object per generation (prompt, response, score, ground truth, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(asdict(row), default=str) + "\n")


def markdown_table(summary: dict[str, dict[str, float]]) -> str:
    """The summary as a markdown table, one row per data source (`all` last)."""
    sources = [s for s in summary if s != "all"] + ["all"]
    keys = [k for k in summary["all"] if k != "prompts"]
    lines = ["| source | prompts | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for s in sources:
        m = summary[s]
        lines.append(
            f"| {s} | {int(m['prompts'])} | " + " | ".join(f"{m[k]:.3f}" for k in keys) + " |"
        )
    return "\n".join(lines) + "\n"
