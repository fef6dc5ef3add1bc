"""The registry of per-item reward scorers, keyed by `data_source`: every built-in listed here.

A scorer has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)`` and
returns a float or a dict with "score". Several names may point to one scorer (aliases such
as `openai/gsm8k`); data sources that share a prefix (`reasoning_gym/<task>`) are mapped by
`RewardConfig.prefix_scorers`. Another package adds its own with
`REWARD_SCORERS.register(name, fn)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tephra.core.registry import Registry
from tephra.episodes.rewards.code import CODE_DATA_SOURCES, code_score
from tephra.episodes.rewards.colours import colour_score
from tephra.episodes.rewards.countdown import countdown_score
from tephra.episodes.rewards.gsm8k import gsm8k_flexible, gsm8k_strict
from tephra.episodes.rewards.math_equivalence import MATH_DATA_SOURCES, math_score
from tephra.episodes.rewards.reasoning_gym_tasks import reasoning_gym_score
from tephra.episodes.rewards.verl_sources import math_dapo_score, search_qa_score

Scorer = Callable[[str, str, Any, "dict[str, Any] | None"], "float | dict[str, Any]"]

MATH_DAPO_DATA_SOURCES = (
    "math_dapo",
    "math_dapo_reasoning",
    "aime",
    "aime24",
    "aime25",
    "aime2024",
    "aime2025",
)
"""Data-source names scored by `math_dapo_score` (verl's DAPO and AIME sets)."""
SEARCH_QA_DATA_SOURCES = ("search_qa", "nq", "hotpotqa", "triviaqa")
"""Data-source names scored by `search_qa_score` (verl's Search-R1 sets)."""

REWARD_SCORERS: Registry[Scorer] = Registry("reward scorer")
"""data_source name -> scorer function."""
for _name in ("code", *CODE_DATA_SOURCES):
    REWARD_SCORERS.register(_name, code_score)
REWARD_SCORERS.register("colour_squares", colour_score)
REWARD_SCORERS.register("countdown", countdown_score)
for _name in ("gsm8k", "openai/gsm8k"):
    REWARD_SCORERS.register(_name, gsm8k_strict)
REWARD_SCORERS.register("gsm8k_flexible", gsm8k_flexible)
for _name in MATH_DATA_SOURCES:
    REWARD_SCORERS.register(_name, math_score)
REWARD_SCORERS.register("reasoning_gym", reasoning_gym_score)
for _name in MATH_DAPO_DATA_SOURCES:
    REWARD_SCORERS.register(_name, math_dapo_score)
for _name in SEARCH_QA_DATA_SOURCES:
    REWARD_SCORERS.register(_name, search_qa_score)
