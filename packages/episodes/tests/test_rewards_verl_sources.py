"""The scorers of verl's DAPO-maths and search-QA data sources, and async reward functions,
against hand-written cases."""

from __future__ import annotations

import pytest

from tephra.episodes.rewards import RewardConfig, RewardInput, RewardManager
from tephra.episodes.rewards.verl_sources import (
    dapo_answer,
    math_dapo_score,
    normalise_qa,
    search_qa_score,
    token_f1,
)


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("Let me think... so x = 3.\nAnswer: $\\frac{1}{2}$", "0.5", 1.0),
        ("Answer: 12.", "12", 1.0),
        ("answer: 11\nAnswer: 12", "12", 1.0),  # the last Answer: line counts
        ("The result is \\boxed{42}", "42", 1.0),  # no Answer: line: the last box
        ("Answer: 13", "12", -1.0),
        ("I could not solve it.", "12", -1.0),  # no answer at all: -1, as DAPO
    ],
)
def test_math_dapo(response, truth, score):
    got = math_dapo_score("math_dapo", response, truth)
    assert got == {"score": score, "acc": 1.0 if score > 0 else 0.0}


def test_dapo_answer_extraction():
    assert dapo_answer("Answer: $x^2$.") == "x^2"
    assert dapo_answer("no answer") is None


def test_search_qa_exact_match_and_f1():
    assert normalise_qa("The  Eiffel Tower!") == "eiffel tower"
    assert search_qa_score("nq", "<answer>the Eiffel tower</answer>", ["Eiffel Tower"]) == {
        "score": 1.0,
        "f1": 1.0,
    }
    got = search_qa_score("nq", "<answer>Paris France</answer>", {"target": ["Paris", "Lyon"]})
    assert got["score"] == 0.0 and got["f1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("red", "blue") == 0.0


def test_routing_by_data_source_and_async_function(tmp_path):
    manager = RewardManager(RewardConfig(executor="serial"))
    results = manager.score_batch(
        [
            RewardInput("aime24", "Answer: 7", "7"),
            RewardInput("searchR1_nq", "<answer>Paris</answer>", {"target": ["paris"]}),
            RewardInput("math_dapo", "Answer: 8", "7"),
        ]
    )
    assert [r.score for r in results] == [1.0, 1.0, -1.0]
    assert results[1].extras["f1"] == 1.0
    reward = tmp_path / "judge.py"
    reward.write_text(
        "import asyncio\n"
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    await asyncio.sleep(0)\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    judged = RewardManager(
        RewardConfig(custom_function_path=str(reward), executor="thread", num_workers=2)
    )
    out = judged.score_batch([RewardInput("x", "4", "4"), RewardInput("x", "5", "4")])
    assert [r.score for r in out] == [1.0, 0.0] and all(r.error is None for r in out)
