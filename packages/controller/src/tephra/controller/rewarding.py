"""Scoring a step's responses with `tephra.rollout.rewards`.

The rollout package's `RewardManager` picks each sample's scorer by `data_source` (or runs
a custom function from a file, verl's signature), counts and logs scorer exceptions and
scores those samples 0. The trainer adds one rule: when every sample of a batch fails, the
run stops with the first error, because a reward that is always 0 trains nothing and hides
the bug.
"""

from __future__ import annotations

from tephra.controller.data import PromptRecord
from tephra.engine_api.errors import TephraError
from tephra.rollout.rewards import RewardConfig, RewardInput, RewardManager


class RewardFailure(TephraError, RuntimeError):
    """The reward function failed on every sample of a batch."""


class Scorer:
    """Scores decoded responses against their prompt records (serially in the driver: the
    demo's scorers take microseconds, and a pool would cost more than it saves)."""

    def __init__(self, custom_path: str | None = None, custom_name: str = "compute_score") -> None:
        self.manager = RewardManager(RewardConfig(
            custom_function_path=custom_path, custom_function_name=custom_name, executor="serial",
        ))

    def score(self, texts: list[str], records: list[PromptRecord]) -> tuple[list[float], int]:
        """Scores of `texts[i]` against `records[i]`; returns (scores, number of errors)."""
        results = self.manager.score_batch([
            RewardInput(rec.data_source, text, rec.ground_truth, rec.extra_info)
            for text, rec in zip(texts, records)
        ])
        failed = [r for r in results if r.error is not None]
        if results and len(failed) == len(results):
            raise RewardFailure(
                f"the reward function failed on all {len(results)} samples of the batch; first "
                f"error: {failed[0].error.strip().splitlines()[-1]}"
            )
        return [r.score for r in results], len(failed)


def accuracy_of(score: float) -> float:
    """A response counts as correct when its score reaches 1 (partial credit does not)."""
    return 1.0 if score >= 1.0 else 0.0
