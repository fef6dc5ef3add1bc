"""RewardManager: parallel scoring equals serial scoring equals the hand-worked table; scorer
exceptions are counted, logged once and score 0 (or raise when configured)."""

import logging
import math

import numpy as np
import pytest

from tephra.engine_api.errors import ConfigError, RegistryError
from tephra.episodes.rewards import (
    REWARD_SCORERS,
    RewardConfig,
    RewardError,
    RewardInput,
    RewardManager,
    RewardScoringError,
    reasoning_gym_rows,
)


def flaky_scorer(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise RuntimeError("scorer exploded")
    if solution_str == "nan":
        return math.nan
    if solution_str == "no score":
        return {"acc": 1.0}
    if solution_str == "text":
        return "1.0"
    # numpy scalars, as scorers built on numpy return them
    return {"score": np.float32(0.25), "len": np.int64(len(solution_str))}


REWARD_SCORERS.register("test_rewards_flaky", flaky_scorer)


def mixed_batch():
    """Items of every rule scorer with their hand-worked scores and extras."""
    countdown = {"target": 10, "numbers": [2, 3, 4]}
    rg = reasoning_gym_rows("basic_arithmetic", size=2, seed=1, extract="last_number")
    table = [
        (RewardInput("gsm8k", "so\n#### 72", "72"), 1.0, {}),
        (RewardInput("gsm8k", "The answer is 72", "72"), 0.0, {}),
        (RewardInput("openai/gsm8k", "#### 1,024", "1024"), 1.0, {}),
        (RewardInput("math", "\\boxed{\\frac{2}{4}}", "0.5"), 1.0, {}),
        (RewardInput("math", "\\boxed{3}", "4"), 0.0, {}),
        (RewardInput("lighteval/MATH", "\\boxed{\\sqrt{4}}", "2"), 1.0, {}),
        (RewardInput("countdown", "<answer>2*3+4</answer>", countdown), 1.0, {"acc": 1.0}),
        (RewardInput("countdown", "<answer>2*3*4</answer>", countdown), 0.1, {"acc": 0.0}),
        (RewardInput("countdown", "2*3+4", countdown), 0.0, {"acc": 0.0}),
    ]
    for row in rg:
        table.append(
            (
                RewardInput(
                    row["data_source"],
                    f"It is {row['ground_truth']}.",
                    row["ground_truth"],
                    row["extra_info"],
                ),
                1.0,
                {},
            )
        )
        table.append(
            (
                RewardInput(row["data_source"], "no idea", row["ground_truth"], row["extra_info"]),
                0.0,
                {},
            )
        )
    return table * 3  # 39 items, so that every worker gets several


@pytest.mark.parametrize("executor", ["serial", "thread"])
def test_rewards_parallel_equals_serial_and_table(executor):
    table = mixed_batch()
    items = [item for item, _, _ in table]
    with RewardManager(RewardConfig(executor=executor, num_workers=3)) as manager:
        results = manager.score_batch(items)
    assert [(r.score, r.extras, r.error) for r in results] == [(s, e, None) for _, s, e in table]
    report = manager.last_report
    assert report.num_items == 39 and report.errors_by_source == {}
    assert report.items_by_source["gsm8k"] == 6
    assert report.mean_score_by_source["gsm8k"] == pytest.approx(0.5)
    assert report.as_metrics()["reward/score/countdown"] == pytest.approx((1.0 + 0.1 + 0.0) / 3)


@pytest.mark.multiproc
def test_rewards_process_pool_equals_serial(tmp_path):
    """A process pool (forked from a fork server): math-verify keeps its signal timeout there (tasks run in
    each worker's main thread) and custom functions travel as (path, name)."""
    table = mixed_batch()
    items = [item for item, _, _ in table]
    serial = RewardManager(RewardConfig(executor="serial")).score_batch(items)
    with RewardManager(RewardConfig(executor="process", num_workers=2)) as manager:
        assert manager.score_batch(items) == serial
        assert manager.score_batch(items[:5]) == serial[:5]  # the pool is reused

    path = tmp_path / "fn.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'boom':\n        raise ValueError('bad item')\n"
        "    if solution_str == 'exit':\n        import os; os._exit(3)\n"
        "    return len(solution_str)\n"
    )
    texts = ["a", "boom", "abc", "", "boom", "ab"]
    config = RewardConfig(custom_function_path=str(path), executor="process", num_workers=2)
    with RewardManager(config) as manager:
        results = manager.score_batch([RewardInput("src", t, None) for t in texts])
        assert [r.score for r in results] == [1.0, 0.0, 3.0, 0.0, 0.0, 2.0]
        assert [r.error for r in results][1] == "ValueError: bad item"
        assert manager.last_report.errors_by_source == {"src": 2}
        # a worker that dies gives a clear error, and the next batch gets a fresh pool
        with pytest.raises(RewardError, match="a reward worker process died"):
            manager.score_batch([RewardInput("src", t, None) for t in ["exit", "a"]])
        assert [
            r.score for r in manager.score_batch([RewardInput("src", t, None) for t in ["ab", "a"]])
        ] == [2.0, 1.0]


@pytest.mark.parametrize("executor", ["serial", "thread"])
def test_rewards_errors_are_counted_logged_once_and_score_zero(executor, caplog):
    config = RewardConfig(
        executor=executor, num_workers=2, scorer_overrides={"flaky": "test_rewards_flaky"}
    )
    items = [
        RewardInput("flaky", "ok", None),
        RewardInput("flaky", "boom", None),
        RewardInput("gsm8k", "#### 3", "3"),
        RewardInput("flaky", "boom", None),
        RewardInput("flaky", "nan", None),
        RewardInput("flaky", "no score", None),
        RewardInput("flaky", "text", None),
    ]
    with (
        caplog.at_level(logging.WARNING, logger="tephra.episodes.rewards"),
        RewardManager(config) as manager,
    ):
        results = manager.score_batch(items)
        manager.score_batch(items)
    assert [r.score for r in results] == [0.25, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert type(results[0].score) is float
    assert results[0].extras == {"len": 2.0}
    assert results[1].error == "RuntimeError: scorer exploded"
    assert "non-finite" in results[4].error and "without 'score'" in results[5].error
    assert "of type str" in results[6].error
    assert manager.last_report.errors_by_source == {"flaky": 5}
    assert manager.total_errors == {"flaky": 10}
    tracebacks = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert (
        len(tracebacks) == 1 and "scorer exploded" in tracebacks[0].getMessage()
    )  # first traceback, once
    summaries = [
        r for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.getMessage()
    ]
    assert len(summaries) == 2 and "5 of 7 items" in summaries[0].getMessage()


def test_rewards_raise_on_error():
    config = RewardConfig(
        executor="thread", raise_on_error=True, scorer_overrides={"flaky": "test_rewards_flaky"}
    )
    items = [RewardInput("flaky", "ok", None), RewardInput("flaky", "boom", None)]
    with RewardManager(config) as manager, pytest.raises(RewardScoringError) as error:
        manager.score_batch(items)
    message = str(error.value)
    assert "item 1" in message and "RuntimeError: scorer exploded" in message
    assert 'raise RuntimeError("scorer exploded")' in message  # the scorer's own traceback


def test_rewards_unknown_data_source_fails_before_scoring():
    items = [RewardInput("gsm8k", "#### 1", "1"), RewardInput("mystery", "x", "y")]
    with (
        RewardManager(RewardConfig(executor="serial")) as manager,
        pytest.raises(RegistryError, match="'mystery'.*gsm8k"),
    ):
        manager.score_batch(items)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"executor": "fork"}, ConfigError, r"reward.executor='fork' is not allowed"),
        ({"num_workers": 0}, ConfigError, r"reward.num_workers=0 must be >= 1"),
        ({"custom_function_path": "a.py", "reward_model_path": "rm"}, ConfigError, "at most one"),
        ({"reward_model_dtype": "fp8"}, ConfigError, "reward_model_dtype='fp8'"),
    ],
)
def test_rewards_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        RewardConfig(**kwargs)


def test_rewards_config_names_must_be_registered():
    with pytest.raises(
        RegistryError,
        match=r"scorer_overrides\['gsm8k'\].*'gsm8k_flexibel'.*did you mean 'gsm8k_flexible'",
    ):
        RewardManager(RewardConfig(scorer_overrides={"gsm8k": "gsm8k_flexibel"}))


def test_rewards_process_pool_refuses_unpicklable_scorer():
    REWARD_SCORERS.register("test_rewards_lambda", lambda_scorer)
    config = RewardConfig(executor="process", scorer_overrides={"l": "test_rewards_lambda"})
    with (
        RewardManager(config) as manager,
        pytest.raises(RewardError, match="needs picklable scorers.*'test_rewards_lambda'"),
    ):
        manager.score_batch([RewardInput("l", "a", None), RewardInput("l", "b", None)])


lambda_scorer = lambda data_source, solution_str, ground_truth, extra_info=None: 1.0  # noqa: E731
