"""GSM8K: the answer after the final `####`, compared as a number with the ground truth.

- strict (verl's default, data_source `gsm8k` / `openai/gsm8k`): the response must contain
  `#### N`; the last such N is the answer. No `####` -> no answer -> 0.
- flexible (`gsm8k_flexible`): the last number anywhere in the response is the answer.

score = 1.0 if answer == ground_truth (as numbers: "1,000" == "1000.0")
        format_score if an answer was found but is wrong (0.0 by default, as in verl)
        0.0 if no answer was found.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from tephra.episodes.rewards.extraction import extract_last_number, numbers_equal
from tephra.episodes.rewards.results import RewardError

# Regexes over long rambling responses are slow and the answer sits at the end, so only the
# tail is searched (verl does the same with 300 characters).
TAIL_CHARS = 300

_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def extract_gsm8k_answer(
    solution_str: str, method: Literal["strict", "flexible"] = "strict"
) -> str | None:
    """The final answer of a GSM8K response (commas removed), or None when there is none."""
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
        return matches[-1].replace(",", "") if matches else None
    if method == "flexible":
        return extract_last_number(tail)
    raise RewardError(f"gsm8k method={method!r} is not allowed; choose 'strict' or 'flexible'")


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """Score one GSM8K response (see the module docstring for the rule)."""
    if ground_truth is None or str(ground_truth).strip() == "":
        raise RewardError("gsm8k: ground_truth is empty; expected the final number, e.g. '72'")
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return correct_score if numbers_equal(answer, str(ground_truth)) else format_score


def gsm8k_strict(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """GSM8K, strict: the answer must follow `####`."""
    return gsm8k_score(solution_str, ground_truth, method="strict")


def gsm8k_flexible(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """GSM8K, flexible: the last number in the response is the answer."""
    return gsm8k_score(solution_str, ground_truth, method="flexible")
