"""Evaluation metrics against hand-computed values on canned samples."""

from __future__ import annotations

import json
import math

import pytest

from tephra.controller.run.evaluation import (
    EvalRow,
    ValidationConfig,
    flat_metrics,
    markdown_table,
    pass_at_k,
    summarise,
    write_jsonl,
)
from tephra.core.errors import ConfigError


def rows(source, prompt_index, answers, scores):
    return [
        EvalRow(
            prompt="q",
            response=a,
            score=s,
            ground_truth="1",
            data_source=source,
            answer=a,
            prompt_index=prompt_index,
        )
        for a, s in zip(answers, scores)
    ]


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0  # n = k: any correct sample passes
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 2, 4) == 1.0  # k > n - c: every k-subset holds a correct one
    assert pass_at_k(6, 2, 3) == pytest.approx(1 - math.comb(4, 3) / math.comb(6, 3))


def test_summary_per_source_and_overall():
    canned = (
        rows("math", 0, ["1", "2", "1", "3"], [1.0, 0.0, 1.0, 0.0])  # c=2
        + rows("math", 1, ["5", "5", "6", "1"], [0.0, 0.0, 0.0, 1.0])  # c=1, majority wrong
        + rows("gsm8k", 2, ["7", "8", "8", "9"], [0.0, 0.5, 0.5, 0.0])
    )  # c=0, partial
    s = summarise(canned, n=4, ks=[1, 2, 4])
    math_rows = s["math"]
    assert math_rows["prompts"] == 2
    assert math_rows["acc@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert math_rows["pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)
    assert math_rows["pass@4"] == 1.0
    # maj@4: prompt 0 "1" (2 votes, correct) -> 1; prompt 1 "5" (2 votes, wrong) -> 0
    assert math_rows["maj@4"] == pytest.approx(0.5)
    # maj@2 over the first two samples: prompt 0 tie "1"/"2" -> the first seen, "1" (correct)
    assert math_rows["maj@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert s["gsm8k"]["mean@4"] == pytest.approx(0.25) and s["gsm8k"]["best@4"] == 0.5
    assert s["gsm8k"]["pass@4"] == 0.0
    assert s["all"]["prompts"] == 3
    assert s["all"]["acc@4"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    flat = flat_metrics(s)
    assert flat["val/acc@4"] == s["all"]["acc@4"] and flat["val/math/pass@2"] == math_rows["pass@2"]
    table = markdown_table(s)
    assert table.splitlines()[0].startswith("| source | prompts | mean@4 | acc@4 | best@4 | pass@1")
    assert table.splitlines()[-1].startswith("| all | 3 |")


def test_jsonl_dump_is_complete(tmp_path):
    canned = rows("math", 0, ["1", "2"], [1.0, 0.0])
    write_jsonl(canned, tmp_path / "g" / "val.jsonl")
    back = [json.loads(line) for line in (tmp_path / "g" / "val.jsonl").read_text().splitlines()]
    assert back[0] == {
        "prompt": "q",
        "response": "1",
        "score": 1.0,
        "ground_truth": "1",
        "data_source": "math",
        "answer": "1",
        "prompt_index": 0,
        "advantage": None,
    }
    assert len(back) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"n": 4, "ks": [8], "temperature": 1.0},
            r"val.ks=\[8\]: every k must be in \[1, val.n=4\]",
        ),
        ({"n": 4}, r"val.n=4 greedy samples would all be the same"),
        ({"n": 0}, r"val.n=0 must be >= 1"),
    ],
)
def test_validation_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ValidationConfig(**kwargs)
