"""Custom reward functions loaded from a file: good ones score, bad ones fail at load time
with a message naming the file (and the line, for a syntax error)."""

import pickle
import textwrap

import pytest

from tephra.episodes.rewards import (
    FileRewardFunction,
    RewardConfig,
    RewardFunctionError,
    RewardInput,
    RewardManager,
    load_reward_function,
)

GOOD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    hit = float(solution_str.strip() == ground_truth)
    return {"score": hit + bonus, "acc": hit, "pred": solution_str}

def other(**kwargs):
    return len(kwargs["solution_str"])
"""


def write(tmp_path, source, name="reward_fn.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_rewards_custom_function_scores_for_every_data_source(tmp_path):
    path = write(tmp_path, GOOD)
    config = RewardConfig(custom_function_path=str(path), custom_function_kwargs={"bonus": 0.5})
    items = [RewardInput("anything", "7", "7"), RewardInput("gsm8k", "8", "7")]
    with RewardManager(config) as manager:
        results = manager.score_batch(items)
    # hand-computed: hit + bonus; the string "pred" extra is dropped (extras are numeric)
    assert [(r.score, r.extras) for r in results] == [(1.5, {"acc": 1.0}), (0.5, {"acc": 0.0})]
    assert (
        load_reward_function(path, "other")(
            data_source="x", solution_str="abcd", ground_truth="", extra_info=None
        )
        == 4
    )


def test_rewards_custom_function_pickles_by_path(tmp_path):
    fn = FileRewardFunction(write(tmp_path, GOOD), "compute_score")
    clone = pickle.loads(pickle.dumps(fn))
    assert clone("x", "7", "7", None) == fn("x", "7", "7", None)


@pytest.mark.parametrize(
    ("source", "name", "match"),
    [
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return (1\n",
            "compute_score",
            r"reward_fn\.py, line 2: syntax error",
        ),
        (
            "def compute_score(solution_str, ground_truth):\n    return 1.0\n",
            "compute_score",
            r"reward_fn\.py: function 'compute_score'\(solution_str, ground_truth\) does not fit .*"
            r"cannot take the keyword argument\(s\) data_source, extra_info",
        ),
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info, /):\n    return 1.0\n",
            "compute_score",
            r"reward_fn\.py.*cannot take the keyword argument\(s\) data_source, solution_str, ground_truth, extra_info",
        ),
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info, tokenizer):\n    return 1.0\n",
            "compute_score",
            r"reward_fn\.py.*parameter\(s\) tokenizer have no default",
        ),
        (
            "def score_it(**kwargs):\n    return 1.0\n",
            "compute_score",
            r"reward_fn\.py has no function 'compute_score'; it defines: score_it",
        ),
        (
            "compute_score = 3\n",
            "compute_score",
            r"reward_fn\.py: 'compute_score' is a int, not a function",
        ),
        (
            "import not_a_module_anywhere\n",
            "compute_score",
            r"reward_fn\.py raised ModuleNotFoundError: .*not_a_module_anywhere.* while being imported",
        ),
    ],
    ids=[
        "syntax",
        "signature",
        "positional-only",
        "extra-required",
        "missing",
        "not-callable",
        "import",
    ],
)
def test_rewards_custom_function_errors_name_the_file(tmp_path, source, name, match):
    path = write(tmp_path, source)
    with pytest.raises(RewardFunctionError, match=match) as error:
        RewardManager(RewardConfig(custom_function_path=str(path), custom_function_name=name))
    assert str(path) in str(error.value)


def test_rewards_custom_function_missing_file(tmp_path):
    with pytest.raises(
        RewardFunctionError, match=r"nope\.py does not exist; set reward.custom_function_path"
    ):
        load_reward_function(tmp_path / "nope.py")


def test_rewards_custom_function_kwargs_fill_required_parameter(tmp_path):
    path = write(
        tmp_path,
        "def f(data_source, solution_str, ground_truth, extra_info, scale):\n    return scale\n",
    )
    assert FileRewardFunction(path, "f", {"scale": 2.0})("d", "s", "g", None) == 2.0
    with pytest.raises(RewardFunctionError, match="cannot take the keyword argument\\(s\\) scale"):
        load_reward_function(write(tmp_path, GOOD, "g.py"), "compute_score", {"scale": 2.0})
