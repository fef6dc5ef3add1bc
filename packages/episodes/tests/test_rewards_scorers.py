"""Tables of right, wrong and malformed answers for each registered scorer, with the scores
worked out by hand from each scorer's documented rule."""

import json

import pytest

from tephra.engine_api.errors import RegistryError
from tephra.episodes.rewards import (
    REWARD_SCORERS,
    RewardError,
    compute_score,
    extract_answer_tag,
    extract_last_boxed,
    extract_last_integer,
    extract_last_number,
    gsm8k_score,
    reasoning_gym_rows,
    resolve_scorer,
)


@pytest.mark.parametrize(
    ("text", "number", "integer"),
    [
        ("The answer is 42.", "42", 42),
        ("It costs $1,234.50 in total", "1234.50", None),
        ("first 3, then -7", "-7", -7),
        ("3-2", "2", 2),  # a minus after a digit is subtraction, not a sign
        ("x = 12.0", "12.0", 12),
        ("no digits here", None, None),
        ("", None, None),
    ],
)
def test_rewards_last_number(text, number, integer):
    assert extract_last_number(text) == number
    assert extract_last_integer(text) == integer


@pytest.mark.parametrize(
    ("text", "tagged", "boxed"),
    [
        ("<answer> 5 </answer> or <answer>6</answer>", "6", None),
        ("so \\boxed{\\frac{1}{2}} and finally \\boxed{3}", None, "3"),
        ("\\boxed{\\frac{1}{2}}", None, "\\frac{1}{2}"),
        ("\\boxed{unclosed", None, None),
        ("<answer>open only", None, None),
    ],
)
def test_rewards_tag_and_box_extraction(text, tagged, boxed):
    assert extract_answer_tag(text) == tagged
    assert extract_last_boxed(text) == boxed


GSM8K_TABLE = [
    # (response, ground truth, strict score, flexible score)
    ("4 + 68 = 72 apples.\n#### 72", "72", 1.0, 1.0),
    ("#### 1,000", "1000", 1.0, 1.0),
    ("#### $18", "18", 1.0, 1.0),
    ("#### -5", "-5", 1.0, 1.0),
    ("#### 72.0", "72", 1.0, 1.0),  # compared as numbers, not strings
    ("#### 5\nno wait\n#### 72", "72", 1.0, 1.0),  # the last #### wins
    ("#### 71", "72", 0.0, 0.0),
    ("The answer is 72", "72", 0.0, 1.0),  # strict needs ####
    ("72 is wrong, it is 71", "72", 0.0, 0.0),
    ("It costs $1,000.", "1000", 0.0, 1.0),
    ("I do not know", "72", 0.0, 0.0),
    ("####", "72", 0.0, 0.0),
    ("", "72", 0.0, 0.0),
]


@pytest.mark.parametrize(("response", "truth", "strict", "flexible"), GSM8K_TABLE)
def test_rewards_gsm8k_table(response, truth, strict, flexible):
    assert compute_score("gsm8k", response, truth) == strict
    assert compute_score("openai/gsm8k", response, truth) == strict
    assert compute_score("gsm8k_flexible", response, truth) == flexible


def test_rewards_gsm8k_format_score_and_empty_truth():
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "72", format_score=0.1) == 0.0
    with pytest.raises(RewardError, match="ground_truth is empty"):
        compute_score("gsm8k", "#### 1", "")


MATH_TABLE = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
    ("first \\boxed{3}, finally \\boxed{4}", "3", 0.0),  # only the last box counts
    ("\\boxed{4}", "\\boxed{4}", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("The answer is 4", "4", 0.0),  # no box: malformed
    ("\\boxed{4", "4", 0.0),  # unclosed box
    ("\\boxed{}", "4", 0.0),
    ("\\boxed{hello}", "4", 0.0),
]


@pytest.mark.parametrize(("response", "truth", "expected"), MATH_TABLE)
def test_rewards_math_table(response, truth, expected):
    assert compute_score("math", response, truth) == expected
    assert compute_score("lighteval/MATH", response, truth) == expected


def test_rewards_math_empty_truth():
    with pytest.raises(RewardError, match="ground_truth is empty"):
        compute_score("math", "\\boxed{1}", None)


COUNTDOWN_TRUTH = {"target": 24, "numbers": [3, 4, 6, 2]}
COUNTDOWN_TABLE = [
    ("<answer>4*6</answer>", 1.0, 1.0),  # each number at most once: not all are needed
    ("<think>hmm</think><answer>3*(6+2)</answer>", 1.0, 1.0),
    ("<answer>4*6 = 24</answer>", 1.0, 1.0),  # a trailing "= value" is ignored
    ("<answer>(6-2)*6</answer>", 0.1, 0.0),  # 6 used twice
    ("<answer>3+4+6+2</answer>", 0.1, 0.0),  # = 15
    ("<answer>24</answer>", 0.1, 0.0),  # 24 is not a given number
    ("<answer>6/(3-3)</answer>", 0.1, 0.0),  # division by zero
    ("<answer>12/(3-2.5)</answer>", 0.0, 0.0),  # non-integer literal
    ("<answer>2**4</answer>", 0.0, 0.0),  # power is not allowed
    ("<answer>__import__('os')</answer>", 0.0, 0.0),
    ("<answer>(4*6</answer>", 0.0, 0.0),
    ("<answer></answer>", 0.0, 0.0),
    ("4*6", 0.0, 0.0),  # no <answer> tag
]


@pytest.mark.parametrize(("response", "score", "acc"), COUNTDOWN_TABLE)
def test_rewards_countdown_table(response, score, acc):
    assert compute_score("countdown", response, COUNTDOWN_TRUTH) == {"score": score, "acc": acc}
    assert compute_score("countdown", response, json.dumps(COUNTDOWN_TRUTH)) == {
        "score": score,
        "acc": acc,
    }


def test_rewards_countdown_bad_truth():
    with pytest.raises(RewardError, match="countdown: ground_truth"):
        compute_score("countdown", "<answer>1</answer>", "24")


@pytest.fixture(scope="module")
def arithmetic_rows():
    rows = reasoning_gym_rows("basic_arithmetic", size=3, seed=0, extract="last_number")
    assert all(row["data_source"] == "reasoning_gym/basic_arithmetic" for row in rows)
    return rows


def _with_extract(row, extract):
    info = json.loads(json.dumps(row["extra_info"]))
    info["reasoning_gym"]["extract"] = extract
    return info


@pytest.mark.parametrize(
    ("extract", "template", "expected"),
    [
        ("last_number", "The answer is {gt}.", 1.0),
        ("last_number", "{gt}", 1.0),
        ("last_number", "The answer is 0.", 0.0),
        # reasoning-gym's base checker gives len(oracle)/len(answer) when the oracle is inside
        ("last_number", "The answer is {gt}0.", "partial"),
        ("last_number", "I cannot compute this.", 0.0),
        ("answer_tag", "<answer>{gt}</answer>", 1.0),
        ("answer_tag", "The answer is {gt}.", 0.0),  # no tag: no answer
        ("full", "  {gt} ", 1.0),
        ("full", "The answer is {gt}", "partial"),
    ],
)
def test_rewards_reasoning_gym_table(arithmetic_rows, extract, template, expected):
    for row in arithmetic_rows:
        gt = row["ground_truth"]
        response = template.format(gt=gt)
        assert gt != "0"
        if expected == "partial":
            extracted = extract_last_number(response) if extract == "last_number" else response
            expected_score = len(gt) / len(extracted)
        else:
            expected_score = expected
        got = compute_score(row["data_source"], response, gt, _with_extract(row, extract))
        assert got == pytest.approx(expected_score)


def test_rewards_reasoning_gym_decimal_checker_and_regeneration():
    # chain_sum's own checker tolerates commas and trailing decimals
    row = reasoning_gym_rows("chain_sum", size=1, seed=3, extract="last_number")[0]
    answer = int(row["ground_truth"])
    assert compute_score(row["data_source"], f"= {answer:,}.00", None, row["extra_info"]) == 1.0
    assert compute_score(row["data_source"], f"= {answer + 1}", None, row["extra_info"]) == 0.0

    # arc_agi keeps tuples in its metadata: the JSON-stored entry no longer scores its own
    # answer 1.0, the regenerated entry does (why both forms of extra_info exist).
    import reasoning_gym

    entry = reasoning_gym.create_dataset("arc_agi", seed=0, size=2)[1]
    response = f"<answer>{entry['answer']}</answer>"
    regenerated = {
        "reasoning_gym": {"task": "arc_agi", "seed": 0, "size": 2, "index": 1, "config_json": "{}"}
    }
    stored = {"reasoning_gym": {"task": "arc_agi", "entry_json": json.dumps(entry)}}
    assert compute_score("reasoning_gym/arc_agi", response, None, regenerated) == 1.0
    assert compute_score("reasoning_gym/arc_agi", response, None, stored) < 1.0


@pytest.mark.parametrize(
    ("extra_info", "match"),
    [
        (None, "needs extra_info\\['reasoning_gym'\\]"),
        ({"reasoning_gym": {"task": "basic_arithmetic"}}, "needs 'entry_json'"),
        (
            {"reasoning_gym": {"task": "basic_arithmetc", "entry_json": "{}"}},
            "did you mean 'basic_arithmetic'",
        ),
        (
            {"reasoning_gym": {"task": "basic_arithmetic", "entry_json": "{}", "extract": "last"}},
            "extract'\\]='last'",
        ),
    ],
)
def test_rewards_reasoning_gym_bad_extra_info(extra_info, match):
    with pytest.raises(RewardError, match=match):
        compute_score("reasoning_gym/basic_arithmetic", "1", "1", extra_info)


def test_rewards_unknown_data_source_lists_scorers():
    with pytest.raises(RegistryError) as error:
        compute_score("gsm9k", "#### 1", "1")
    message = str(error.value)
    assert "'gsm9k'" in message and "did you mean 'gsm8k'" in message
    for name in REWARD_SCORERS.names():
        assert name in message
    assert "reasoning_gym/<anything>" in message


def test_rewards_resolution_order():
    assert resolve_scorer("reasoning_gym/leg_counting")[0] == "reasoning_gym"
    assert (
        resolve_scorer("gsm8k", scorer_overrides={"gsm8k": "gsm8k_flexible"})[0] == "gsm8k_flexible"
    )
    assert (
        resolve_scorer("rg:chain_sum", prefix_scorers={"rg:": "reasoning_gym"})[0]
        == "reasoning_gym"
    )
    with pytest.raises(RegistryError):
        resolve_scorer("reasoning_gym/chain_sum", prefix_scorers={})


def test_rewards_reasoning_gym_rows_survive_parquet(tmp_path):
    """Rows of two tasks and a gsm8k row in one verl-style parquet file score as before: the
    entry is one JSON string, so differing task metadata does not break the file's schema."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = reasoning_gym_rows("basic_arithmetic", 2, seed=5, extract="last_number")
    rows += reasoning_gym_rows("chain_sum", 2, seed=6, extract="answer_tag")
    rows.append(
        {"data_source": "gsm8k", "question": "q", "ground_truth": "7", "extra_info": {"index": 0}}
    )
    # the regeneration form of the first row, without "extract" (defaults to answer_tag)
    regenerate = {"task": "basic_arithmetic", "seed": 5, "size": 2, "index": 0, "config_json": "{}"}
    rows.append({**rows[0], "extra_info": {"index": 0, "reasoning_gym": regenerate}})
    table = [
        {
            "data_source": row["data_source"],
            "prompt": [{"role": "user", "content": row["question"]}],
            "reward_model": {"ground_truth": row["ground_truth"]},
            "extra_info": row["extra_info"],
        }
        for row in rows
    ]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "train.parquet")
    read = pq.read_table(tmp_path / "train.parquet").to_pylist()
    responses = [
        "so 1 + 2 is {gt}",
        "so 1 + 2 is {gt}",
        "<answer>{gt}</answer>",
        "{gt}",
        "#### {gt}",
        "<answer>{gt}</answer>",
    ]
    expected = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # the fourth has no <answer> tag
    assert read[-1]["extra_info"]["reasoning_gym"]["entry_json"] is None  # null-filled by parquet
    assert len(read) == len(responses)
    for row, template, score in zip(read, responses, expected):
        truth = row["reward_model"]["ground_truth"]
        got = compute_score(row["data_source"], template.format(gt=truth), truth, row["extra_info"])
        assert got == score


def test_rewards_math_verify_signal_timeout_only_in_main_thread():
    """Why the math scorer switches the timeout off in worker threads: math-verify's
    signal.alarm refuses to run outside the main thread."""
    from concurrent.futures import ThreadPoolExecutor

    from math_verify import parse

    from tephra.episodes.rewards import math_equivalence

    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(ValueError, match="doesn't support threaded environment"):
            pool.submit(parse, "$1$", parsing_timeout=5).result()
        assert pool.submit(math_equivalence._timeout).result() is None
        assert pool.submit(compute_score, "math", "\\boxed{\\frac{1}{2}}", "0.5").result() == 1.0
    assert math_equivalence._timeout() == math_equivalence.MATH_VERIFY_TIMEOUT_S


def test_math_verify_running_out_of_time_is_a_counted_timeout_not_a_wrong_answer(monkeypatch):
    """math-verify turns its own timeout into "not equal" (0.0, indistinguishable from a wrong
    answer); the math scorer makes it a RewardTimeout, which the reward manager counts in
    reward/timeouts. math-verify's limit holds where the scorer runs in a main thread
    (`compute_score` called directly, as verl's `default_compute_score` is); the real
    signal.alarm fires here: the parse is slowed past a 1 s limit."""
    import time

    import math_verify.parser

    from tephra.episodes.rewards import RewardTimeout, is_timeout, math_equivalence

    slow_parse = math_verify.parser.extract_target_from_pred

    def slow(pred, *args, **kwargs):
        if "7" in pred:  # only the answer below; the ground truth parses at full speed
            time.sleep(3)
        return slow_parse(pred, *args, **kwargs)

    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", slow)
    monkeypatch.setattr(math_equivalence, "MATH_VERIFY_TIMEOUT_S", 1)
    limit = "math-verify's 1 s limit ran out while parsing the answer"
    with pytest.raises(RewardTimeout, match=limit) as e:
        compute_score("math", "\\boxed{7}", "2")
    assert is_timeout(f"{type(e.value).__name__}: {e.value}")  # the manager's error text
    assert compute_score("math", "\\boxed{2}", "2") == 1.0  # other answers still score
    assert compute_score("math", "\\boxed{3}", "2") == 0.0  # and a wrong one is no error
