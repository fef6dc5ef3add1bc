"""The LLM judge: parsers by hand, a scripted judge's scores mixed with rule scores per data
source, timeouts and unreadable judgements scoring the counted fallback, a real tiny model
served by the hf backend, and the config errors."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tephra.core.errors import ConfigError
from tephra.episodes.rewards import RewardConfig, RewardInput, RewardManager
from tephra.episodes.rewards.judge import (
    JUDGE_PARSERS,
    GenerativeJudge,
    JudgeConfig,
    JudgeParseError,
)
from tephra.rollout.testing import build_tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"


def test_parsers_by_hand():
    assert JUDGE_PARSERS.get("score_tag")("ok <score>3</score> then <score> 7.5 </score>") == 7.5
    assert JUDGE_PARSERS.get("last_number")("I give 4 out of 10") == 10.0
    assert JUDGE_PARSERS.get("yes_no")("Yes, it is right. no doubt") == 1.0
    assert JUDGE_PARSERS.get("yes_no")("No.") == 0.0
    for name in ("score_tag", "last_number", "yes_no"):
        with pytest.raises(JudgeParseError):
            JUDGE_PARSERS.get(name)("nothing here")


async def scripted(prompt: str) -> str:
    """A judge that rates by the answer's text: `slow` never answers in time, `mute` writes
    no score, `broken` fails; otherwise the answer's length is the rating."""
    answer = prompt.split("Answer: ")[1].split("\n")[0]
    if answer == "slow":
        await asyncio.sleep(30)
    if answer == "broken":
        raise RuntimeError("judge server down")
    if answer == "mute":
        return "I cannot say."
    return f"Fine. <score>{len(answer)}</score>"


def item(source, text, truth="42"):
    return RewardInput(data_source=source, solution_str=text, ground_truth=truth, prompt_str="Q?")


def test_scripted_judge_scores_mix_with_rule_scores_per_source():
    cfg = RewardConfig(
        executor="serial",
        judge=JudgeConfig(score_scale=0.1, judge_weight=1.0, source_weights={"gsm8k": [1.0, 0.5]}),
    )
    items = [
        item("gsm8k", "#### 42"),  # rule 1, judge 0.7: 1 + 0.5 * 0.7
        item("gsm8k", "#### 41"),  # rule 0, judge 0.7: 0.35
        item("my_chat", "abcd"),  # no rule scorer needed (rule weight 0): judge 0.4
    ]
    with RewardManager(cfg, judge_ask=scripted) as manager:
        results = manager.score_batch(items)
        report = manager.last_report
    assert [r.score for r in results] == pytest.approx([1.35, 0.35, 0.4])
    assert [r.extras["judge"] for r in results] == pytest.approx([0.7, 0.7, 0.4])
    assert report.judge_requests == 3 and report.judge_fallbacks == 0


def test_data_sources_limit_the_judge():
    cfg = RewardConfig(executor="serial", judge=JudgeConfig(data_sources=["my_chat"]))
    with RewardManager(cfg, judge_ask=scripted) as manager:
        results = manager.score_batch([item("gsm8k", "#### 42"), item("my_chat", "abc")])
    assert [r.score for r in results] == [1.0, 3.0]  # gsm8k by its rule alone
    assert "judge" not in results[0].extras


def test_timeouts_failures_and_unparsed_judgements_score_the_counted_fallback():
    cfg = RewardConfig(judge=JudgeConfig(timeout_s=0.5, fallback_score=-1.0))
    items = [item("chat", "slow"), item("chat", "mute"), item("chat", "broken"), item("chat", "ab")]
    with RewardManager(cfg, judge_ask=scripted) as manager:
        results = manager.score_batch(items)
        report = manager.last_report
    assert [r.score for r in results] == [-1.0, -1.0, -1.0, 2.0]
    assert [r.extras["judge_fallback"] for r in results] == [1.0, 1.0, 1.0, 0.0]
    assert [r.extras["judge_timeout"] for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert (report.judge_timeouts, report.judge_fallbacks) == (1, 3)
    metrics = report.as_metrics()
    assert metrics["reward/judge_timeouts"] == 1.0 and metrics["reward/judge_fallbacks"] == 3.0
    # requests run concurrently: the whole batch takes one timeout, not one per sample
    assert report.seconds < 5.0


def test_a_real_tiny_judge_model_through_the_hf_backend(tmp_path):
    model = build_tiny_model(tmp_path / "judge")
    cfg = JudgeConfig(
        model_path=str(model.path),
        parser="last_number",
        max_new_tokens=8,
        max_model_len=512,
        chat_template=False,
    )
    judge = GenerativeJudge(cfg)
    try:
        scores = judge.score([item("chat", f"answer {k}") for k in range(3)])
        stats = judge.last_stats
        # an untrained model writes tokens at random: each sample has a parsed number or
        # the fallback, and every sample is accounted for
        assert len(scores) == 3 and stats.requests == 3
        assert stats.timeouts == 0 and stats.errors == 0
        assert sum(s == cfg.fallback_score for s in scores) >= stats.parse_failures
        # greedy judging is reproducible
        assert judge.score([item("chat", f"answer {k}") for k in range(3)]) == scores
    finally:
        judge.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parser": ""}, r"reward\.judge\.parser='': a judge needs a parser"),
        ({"parser": "stars"}, r"reward\.judge\.parser='stars' is not registered"),
        ({"prompt_template": "Rate {prompt}"}, r"prompt_template: it must hold \{response\}"),
        ({"prompt_template": "{response} {answer}"}, r"unknown fields \['answer'\]"),
        ({"timeout_s": 0}, r"reward\.judge\.timeout_s=0 must be"),
        ({"source_weights": {"gsm8k": [1.0]}}, r"source_weights\['gsm8k'\]=\[1\.0\] must be two"),
        ({"data_sources": []}, r"data_sources=\[\] judges nothing"),
        ({"backend": "vlm"}, r"reward\.judge\.backend='vlm' is not a registered .* 'vllm'"),
        ({"backend": "sglang"}, r"backend='sglang': the judge has settings for the hf and vllm"),
        # the judge's server never receives weights: no weight-update or sleep settings
        (
            {"backend": "vllm", "vllm": {"sleep_level": 1, "weight_sync": "disk"}},
            r"reward\.judge\.vllm: unknown fields \['sleep_level', 'weight_sync'\]",
        ),
        ({"dtype": "fp8"}, r"reward\.judge\.dtype='fp8' is not allowed"),
    ],
)
def test_bad_judge_options_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        JudgeConfig(**kwargs)


def test_judge_and_reward_model_are_exclusive():
    with pytest.raises(
        ConfigError, match="at most one of reward.reward_model_path and reward.judge"
    ):
        RewardConfig(reward_model_path="/rm", judge={"model_path": "/judge"})


def test_readme_judge_example_runs_as_written(capsys):
    text = README.read_text()
    start = text.index("### LLM judge")
    block = re.findall(r"```python\n(.*?)```", text[start:], re.DOTALL)[0]
    exec(compile(block, str(README), "exec"), {"__name__": "judge_md"})  # noqa: S102 (our docs)
    assert capsys.readouterr().out.split() == ["1.4", "0"]
