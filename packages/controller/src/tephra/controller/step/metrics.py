"""The metrics a step logs beyond the workers' own: staleness, dynamic sampling, the rewards /
accuracy / throughput summary, the stage times (`StepTimer`) and each stage's share of the
run's time."""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from tephra.controller.samples import Sample
from tephra.controller.step.rounds import Round
from tephra.controller.step.scoring import accuracy_of


def staleness_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """`staleness/*`: version lag (`version`, the trainer's weights before the update, minus
    each sample's `weight_version`) mean and max, and the samples' versions min and max."""
    versions = [s.weight_version for s in samples]
    lags = [version - v for v in versions]
    return {
        "staleness/mean": sum(lags) / len(lags),
        "staleness/max": float(max(lags)),
        "staleness/weight_version_min": float(min(versions)),
        "staleness/weight_version_max": float(max(versions)),
    }


def dynamic_sampling_metrics(rounds: list[Round]) -> dict[str, float]:
    """`dapo/*`: generation rounds, prompt groups generated, flat ones among them (all samples
    scored the same), and flat groups trained on to fill the batch (0 when enough came)."""
    generated = sum(r.n_groups for r in rounds)
    return {
        "dapo/gen_rounds": float(len(rounds)),
        "dapo/groups_generated": float(generated),
        "dapo/groups_flat": float(generated - sum(r.informative for r in rounds)),
        "dapo/groups_filled": float(sum(r.filler for r in rounds)),
    }


def time_share(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's share of the total step time over a run's metric records (`time/<stage>_s`
    summed over steps, divided by the summed `time/step_s`)."""
    total = sum(r.get("time/step_s", 0.0) for r in records)
    stages: dict[str, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("time/") and key not in ("time/step_s", "time/reward_s"):
                stage = key[len("time/") : -len("_s")]
                stages[stage] = stages.get(stage, 0.0) + value
    return {k: v / total for k, v in sorted(stages.items(), key=lambda kv: -kv[1])} if total else {}


def format_time_share(share: dict[str, float]) -> str:
    """One line: `time per stage: generate 31%, actor 60%, ...`."""
    return "time per stage: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items())


def step_summary(
    rounds: list[Round],
    samples: list[Sample],
    batch: TensorDict,
    scores: torch.Tensor,
    step_s: float,
    mfu: float,
    peak_published: bool,
    flops: float,
) -> dict[str, float]:
    """A step's `reward/*`, `accuracy/train`, `response/*`, `perf/*` and `time/step_s`, over
    its kept `samples` (the trained batch) and every sample its `rounds` generated; `mfu` is
    `perf/mfu` when the peak is the devices' published figure, else
    `perf/mfu_measured_peak`."""
    all_samples = [s for r in rounds for s in r.samples]
    resp_len = batch["response_mask"].sum(-1).float()
    total_tokens = int(batch["attention_mask"].sum())
    return {
        "reward/mean": float(scores.mean()),
        "reward/errors": float(sum(r.errors for r in rounds)),
        "reward/timeouts": float(sum(r.timeouts for r in rounds)),
        "reward/clipped": float(sum(r.clipped for r in rounds)),
        # over every sample generated this step (dropped groups included): the policy's
        # accuracy, not the filtered batch's
        "accuracy/train": sum(accuracy_of(s.reward.score) for s in all_samples) / len(all_samples),
        "response/length_mean": float(resp_len.mean()),
        "response/clip_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "perf/tokens_per_s": total_tokens / step_s,
        "perf/trained_tokens": float(batch["response_mask"].sum()),
        "perf/flops": flops,
        ("perf/mfu" if peak_published else "perf/mfu_measured_peak"): mfu,
        "time/step_s": step_s,
    }


class StepTimer:
    """A step's stage times: `lap(name)` ends the stage that ran since the last lap (or the
    step's start) as `time/<name>_s`."""

    def __init__(self) -> None:
        self.start = self.tick = time.perf_counter()
        self.times: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[f"time/{name}_s"] = now - self.tick
        self.tick = now

    def total(self) -> float:
        """Seconds since the step started."""
        return time.perf_counter() - self.start
