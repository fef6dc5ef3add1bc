"""The gate run's reward: the share of a response's letters that are vowels.

A tiny random model samples text whose vowel share differs from sample to sample, so GRPO
groups are rarely flat and a few steps of a healthy update move the reward; a broken update
shows within them.
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    letters = [c for c in solution_str.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
