"""Scoring a step's responses with the rule scorers of `tephra.rollout.rewards`.

A data source picks its scorer by exact name, else by its prefix before `/`
(`reasoning_gym/basic_arithmetic` -> `reasoning_gym`). A custom function from a file (verl's
signature) replaces the lookup. A scorer that raises gives 0 for that sample and is counted;
when every sample of a batch fails, the run stops with the first error, because a reward that
is always 0 trains nothing and hides the bug.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from tephra.controller.data import PromptRecord
from tephra.engine_api.errors import ConfigError, TephraError


class RewardFailure(TephraError, RuntimeError):
    """The reward function failed on every sample of a batch."""


def load_function(path: str, name: str) -> Callable:
    """`name` from the Python file at `path` (verl's `custom_reward_function`)."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"reward.custom_function_path={path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"tephra_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise ConfigError(f"reward.custom_function_name={name!r} is not defined in {path}")
    return getattr(module, name)


class Scorer:
    def __init__(self, custom_path: str | None = None, custom_name: str = "compute_score") -> None:
        self.custom = load_function(custom_path, custom_name) if custom_path else None

    def scorer_for(self, data_source: str) -> Callable:
        if self.custom is not None:
            return self.custom
        import tephra.rollout.rewards.countdown  # noqa: F401  (registration)
        import tephra.rollout.rewards.gsm8k  # noqa: F401
        import tephra.rollout.rewards.math_equivalence  # noqa: F401
        import tephra.rollout.rewards.reasoning_gym_tasks  # noqa: F401
        from tephra.rollout.rewards.scorer_registry import REWARD_SCORERS

        if data_source in REWARD_SCORERS:
            return REWARD_SCORERS.get(data_source)
        return REWARD_SCORERS.get(data_source.split("/", 1)[0])

    def score(self, texts: list[str], records: list[PromptRecord]) -> tuple[list[float], int]:
        """Scores of `texts[i]` against `records[i]`; returns (scores, number of errors)."""
        scores, errors, first = [], 0, None
        for text, rec in zip(texts, records):
            fn = self.scorer_for(rec.data_source)
            try:
                value = fn(rec.data_source, text, rec.ground_truth, rec.extra_info)
                value = value["score"] if isinstance(value, dict) else value
                scores.append(float(value))
            except Exception as exc:  # a user's function may raise anything; count it
                errors += 1
                first = first or exc
                scores.append(0.0)
        if texts and errors == len(texts):
            raise RewardFailure(
                f"the reward function failed on all {len(texts)} samples of the batch; first "
                f"error: {type(first).__name__}: {first}"
            ) from first
        return scores, errors


def accuracy_of(score: float) -> float:
    """A response counts as correct when its score reaches 1 (partial credit does not)."""
    return 1.0 if score >= 1.0 else 0.0

