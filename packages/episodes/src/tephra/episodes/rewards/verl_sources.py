"""Scorers for more of verl's common data sources: DAPO-style maths (`math_dapo`, `aime*`) and
search-augmented QA (`search_qa`, `searchR1_*`).

math_dapo / aime: the answer is the text after the last "Answer:" (DAPO's prompt asks for
"Answer: $ANSWER" on the last line), else the last `\\boxed{}`; it is compared with the ground
truth by math-verify (symbolic and numeric equivalence). As in DAPO, the reward is +1 for a
correct answer and -1 otherwise (a missing answer included); `acc` (1/0) is returned beside it.

search QA: the answer is the text inside the last <answer>...</answer> (Search-R1's format),
else the whole response; after SQuAD normalisation (lower case, no punctuation, no articles,
single spaces) `score` is the exact match (1/0) against any of the accepted answers and `f1`
the best token-level F1. The ground truth is a string, a list of strings, or a dict with
`target` (Search-R1's rows).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from tephra.episodes.rewards.extraction import extract_answer_tag, extract_last_boxed
from tephra.episodes.rewards.math_equivalence import math_equal
from tephra.episodes.rewards.results import RewardError

_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)


def dapo_answer(response: str) -> str | None:
    """The text after the last "Answer:" (to the end of its line, `$` and a final period
    stripped), else the last boxed content, else None."""
    found = _ANSWER_LINE.findall(response)
    if found:
        answer = found[-1].strip()
        answer = answer[:-1].rstrip() if answer.endswith(".") else answer
        return answer.strip("$").strip()
    boxed = extract_last_boxed(response)
    return boxed if boxed else None


def math_dapo_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, float]:
    """{"score": +1 correct / -1 otherwise, "acc": 1/0}."""
    if ground_truth is None or str(ground_truth).strip() == "":
        raise RewardError(f"{data_source}: ground_truth is empty; expected the reference answer")
    answer = dapo_answer(solution_str)
    correct = answer is not None and math_equal(answer, str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}


def normalise_qa(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles removed, single
    spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _targets(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("target")
    if isinstance(ground_truth, str):
        ground_truth = [ground_truth]
    answers = [str(t) for t in (ground_truth or []) if str(t).strip()]
    if not answers:
        raise RewardError(
            "search QA: ground_truth holds no answer; expected a string, a list "
            "of strings or {'target': [...]}"
        )
    return answers


def token_f1(prediction: str, target: str) -> float:
    """F1 of the normalised tokens of `prediction` against `target`."""
    pred, gold = normalise_qa(prediction).split(), normalise_qa(target).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def search_qa_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, float]:
    """{"score": exact match 1/0, "f1": best token F1} against any accepted answer."""
    targets = _targets(ground_truth)
    answer = extract_answer_tag(solution_str)
    answer = solution_str if answer is None else answer
    exact = any(normalise_qa(answer) == normalise_qa(t) for t in targets)
    return {"score": 1.0 if exact else 0.0, "f1": max(token_f1(answer, t) for t in targets)}
