"""`colour_squares`: the answer of the synthetic image task (name the colour of the square).

score = 1 when the response, lower-cased and stripped of spaces and punctuation, is the colour
name; otherwise 0.5 x difflib's similarity ratio of the two strings (in [0, 0.5)), so that a
tiny random model's responses differ in reward and a group has an advantage to learn from.
Accuracy counts only exact answers (a score of 1).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 220, 40),
    "orange": (240, 140, 20),
    "purple": (140, 40, 180),
    "pink": (240, 120, 190),
    "cyan": (40, 200, 220),
}
"""Colour name -> RGB of the task's squares."""


def _normalise(text: str) -> str:
    return re.sub(r"[^a-z]", "", text.lower())


def colour_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, float]:
    """{"score": 1 on the exact colour else 0.5 x similarity, "acc": 1 or 0}."""
    answer, truth = _normalise(solution_str), _normalise(str(ground_truth))
    if answer == truth:
        return {"score": 1.0, "acc": 1.0}
    return {"score": 0.5 * difflib.SequenceMatcher(None, answer, truth).ratio(), "acc": 0.0}
