"""The colour_squares scorer: 1 for the exact colour word (case and punctuation ignored),
else half of difflib's similarity, which orders near answers above far ones."""

from __future__ import annotations

import pytest

from tephra.episodes.rewards.colours import colour_score
from tephra.episodes.rewards.scorer_registry import REWARD_SCORERS


def test_exact_answer_scores_one():
    assert colour_score("colour_squares", " Red.", "red") == {"score": 1.0, "acc": 1.0}


def test_near_answers_get_partial_credit_below_a_half():
    near = colour_score("colour_squares", "redd", "red")["score"]
    far = colour_score("colour_squares", "xyz", "red")["score"]
    # difflib ratio 2 * matches / total: "redd" vs "red" = 6 / 7
    assert near == pytest.approx(0.5 * 6 / 7) and far == 0.0


def test_registered_under_the_data_source():
    assert REWARD_SCORERS.get("colour_squares") is colour_score
