"""The code scorer against hand-written programs and tests: each program runs in the python
sandbox, and the expected scores are counted by hand from the documented rules."""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import re
import time
from pathlib import Path

import pytest

from tephra.episodes.rewards import (
    CODE_DATA_SOURCES,
    REWARD_SCORERS,
    CodeLimits,
    CodeScorer,
    RewardConfig,
    RewardError,
    RewardInput,
    RewardManager,
    code_score,
    compute_score,
    extract_program,
    parse_code_tests,
    resolve_scorer,
    score_code,
)
from tephra.episodes.rewards.code import normalise_stdout
from tephra.episodes.tools import python_sandbox

FENCE = "`" * 3
LIMITS = CodeLimits(timeout_s=2.0, total_timeout_s=30.0)
README = Path(__file__).resolve().parents[1] / "README.md"

# a + b of two numbers on one line; the third expected output has trailing spaces and a blank
# line, which the comparison ignores
SUM_TESTS = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7", "7  \n\n"]}


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n{FENCE}{tag}\n{code}{FENCE}\nIt reads a and b."


def counts(report) -> dict[str, float]:
    return {k: v for k, v in report.as_score_dict().items() if k != "score"}


def test_passing_program_scores_one():
    report = score_code(
        fenced("a, b = map(int, input().split())\nprint(a + b)\n"), SUM_TESTS, LIMITS
    )
    assert report.score == 1.0
    assert report.as_score_dict() == {
        "score": 1.0,
        "passed": 3.0,
        "failed": 0.0,
        "total": 3.0,
        "wrong_answer": 0.0,
        "timeout": 0.0,
        "runtime_error": 0.0,
        "not_run": 0.0,
        "no_code": 0.0,
    }
    assert report.first_failure is None


def test_partly_wrong_program_scores_the_fraction_passed():
    # right for the first two tests only (it multiplies when a >= 5)
    program = (
        "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b if a < 5 else a * b)\n"
    )
    report = score_code(fenced(program), SUM_TESTS, LIMITS)
    assert report.score == 2 / 3
    assert [c.status for c in report.cases] == ["passed", "passed", "wrong_answer"]
    assert report.first_failure == "test 2: wrong answer: expected stdout '7  \\n\\n', got '-30\\n'"
    assert counts(report)["wrong_answer"] == 1.0 and counts(report)["failed"] == 1.0


def test_infinite_loop_fails_its_test_within_the_timeout_and_the_others_run():
    program = "a, b = map(int, open(0).read().split())\nwhile a == 3:\n    pass\nprint(a + b)\n"
    start = time.monotonic()
    report = score_code(fenced(program), SUM_TESTS, LIMITS)
    elapsed = time.monotonic() - start
    assert report.score == 2 / 3
    assert [c.status for c in report.cases] == ["passed", "timeout", "passed"]
    assert report.first_failure.startswith("test 1: wall-time limit of 2.0 s exceeded")
    # killed at the limit (plus the kill's and the sandbox's own overhead), not later
    assert 2.0 <= report.cases[1].seconds < 4.0
    assert elapsed < 10.0
    assert counts(report)["timeout"] == 1.0


def test_crashing_program_fails_the_tests_where_it_raises():
    # b - 4 is zero for the second test only
    program = "a, b = map(int, input().split())\nprint(a + b + 0 // (b - 4))\n"
    report = score_code(fenced(program), SUM_TESTS, LIMITS)
    assert report.score == 2 / 3
    assert [c.status for c in report.cases] == ["passed", "runtime_error", "passed"]
    assert report.first_failure == (
        "test 1: exited with status 1: ZeroDivisionError: integer division or modulo by zero"
    )
    always = score_code(fenced("raise ValueError('no idea')\n"), SUM_TESTS, LIMITS)
    assert always.score == 0.0 and counts(always)["runtime_error"] == 3.0
    # a non-zero exit fails even with the right output; exit(0) is fine
    exits = score_code(
        fenced("a, b = map(int, input().split())\nprint(a + b)\nexit(a == 3)\n"), SUM_TESTS, LIMITS
    )
    assert [c.status for c in exits.cases] == ["passed", "runtime_error", "passed"]


def test_no_code_block_scores_zero_with_a_reason():
    for response in (
        "The answer is print(3).",
        f"{FENCE}cpp\nint main() {{}}\n{FENCE}",
        f"{FENCE}python\nprint(3)\n",
    ):  # the last fence was never closed
        report = score_code(response, SUM_TESTS, LIMITS)
        assert report.as_score_dict() == {
            "score": 0.0,
            "passed": 0.0,
            "failed": 3.0,
            "total": 3.0,
            "wrong_answer": 0.0,
            "timeout": 0.0,
            "runtime_error": 0.0,
            "not_run": 0.0,
            "no_code": 1.0,
        }
        assert report.first_failure == "no ```python (or bare ```) code block in the response"


@pytest.mark.parametrize(
    ("response", "program"),
    [
        (fenced("print(1)\n"), "print(1)\n"),
        (
            fenced("print(1)\n") + "\nbetter:\n" + fenced("print(2)\n", "py"),
            "print(2)\n",
        ),  # last wins
        (
            fenced("print(1)\n", "") + fenced("print(2)\n", "Python3"),
            "print(2)\n",
        ),  # tagged beats bare
        (fenced("print(1)\n", "") + fenced("3\n", "text"), "print(1)\n"),  # other languages skipped
        ("1. Run:\n   ```python\n   x = 1\n   print(x)\n   ```", "x = 1\nprint(x)\n"),  # indented
        ("no code", None),
    ],
)
def test_extract_program(response, program):
    assert extract_program(response) == program


def test_stdin_ways_of_reading_and_lines_formats():
    tests = {"inputs": [["2", "5 6"], None], "outputs": [["11"], ""]}
    for program in (
        "import sys\nfirst = sys.stdin.readline()\nprint(sum(map(int, sys.stdin.readline().split())) if first else '')\n",
        "data = open(0).read().split()\nprint(sum(map(int, data[1:])) if data else '')\n",
        "import sys\ndata = sys.stdin.buffer.read().split()\nprint(sum(map(int, data[1:])) if data else '')\n",
        # a __main__ guard runs: the program is the main module in the stdin format
        "def main():\n    data = open(0).read().split()\n    print(sum(map(int, data[1:])) if data else '')\n"
        "if __name__ == '__main__':\n    main()\n",
    ):
        assert score_code(fenced(program), tests, LIMITS).score == 1.0, program
    assert normalise_stdout("1 \r\n2\t\n\n\n") == "1\n2"
    # leading whitespace and inner blank lines still count
    assert (
        score_code(fenced("print(' 3')\n"), {"inputs": [""], "outputs": ["3"]}, LIMITS).score == 0.0
    )


FN_TESTS = {  # verl's prime / sandbox_fusion form: one JSON argument per line, JSON outputs
    "fn_name": "twoSum",
    "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6", "[3, 3]\n6"],
    "outputs": ["[0, 1]", "[1, 2]", "[0, 1]"],
}


def test_fn_name_format_calls_the_solution_method():
    # List needs no import (LeetCode's prelude); a tuple return equals a JSON list; prints are
    # discarded; the __main__ block does not run (it would fail on input())
    program = (
        "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n"
        "        for i, x in enumerate(nums):\n"
        "            print('looking at', i)\n"
        "            if target - x in seen:\n"
        "                return (seen[target - x], i)\n"
        "            seen[x] = i\n"
        "if __name__ == '__main__':\n"
        "    input()\n"
    )
    report = score_code(fenced(program), FN_TESTS, LIMITS)
    assert report.score == 1.0 and report.first_failure is None
    # a top-level function, wrong on the third test (it finds the first 3 twice)
    wrong = (
        "def twoSum(nums, target):\n"
        "    for i, x in enumerate(nums):\n"
        "        if target - x in nums[i + 1:]:\n"
        "            return [i, nums.index(target - x)]\n"
    )
    report = score_code(fenced(wrong), json.dumps(FN_TESTS), LIMITS)
    assert report.score == 2 / 3
    assert [c.status for c in report.cases] == ["passed", "passed", "wrong_answer"]
    assert report.first_failure == (
        "test 2: wrong answer: twoSum(*[[3, 3], 6]) returned [0, 0], expected [0, 1]"
    )


def test_fn_name_apps_form_and_failures():
    # APPS / TACO: arguments as a list, expected value wrapped in a one-element list
    tests = {
        "fn_name": "count_words",
        "inputs": [["a b c"], ["  "], ["x"]],
        "outputs": [[3], [0], [2]],
    }
    program = "def count_words(text):\n    return len(text.split())\n"
    report = score_code(fenced(program), tests, LIMITS)
    assert report.score == 2 / 3
    assert (
        report.first_failure == "test 2: wrong answer: count_words(*['x']) returned 1, expected [2]"
    )
    missing = score_code(fenced("def count(text):\n    return 0\n"), tests, LIMITS)
    assert missing.score == 0.0 and counts(missing)["runtime_error"] == 3.0
    assert missing.first_failure == (
        "test 0: exited with status 1: NameError: the program defines "
        "neither a function count_words nor a method Solution.count_words"
    )
    loops = score_code(
        fenced(
            "def count_words(text):\n    while text == 'x':\n        pass\n"
            "    return len(text.split())\n"
        ),
        tests,
        LIMITS,
    )
    assert [c.status for c in loops.cases] == ["passed", "passed", "timeout"]


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("{'inputs': [1]}", "code ground truth is not valid JSON"),
        (["1"], "code ground truth is a list, not a dict"),
        ({"inputs": ["1"]}, "'outputs' is missing, not a list"),
        (
            {"input": ["1"], "outputs": ["1"]},
            "'inputs' is missing, not a list \\(keys: \\['input', 'outputs'\\]\\)",
        ),
        ({"inputs": "1 2", "outputs": ["3"]}, "'inputs' is a str, not a list"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "'inputs' has 2 entries but 'outputs' 1"),
        ({"inputs": [], "outputs": []}, "needs at least one test case"),
        ({"inputs": [{"a": 1}], "outputs": ["1"]}, "inputs\\[0\\] is a dict"),
        (
            {"fn_name": "f", "inputs": ["[1, 2]\nnot json"], "outputs": ["3"]},
            "inputs\\[0\\], line 2 .* is not JSON",
        ),
        (
            {"fn_name": "f(x)", "inputs": ["1"], "outputs": ["1"]},
            "'fn_name' = 'f\\(x\\)' is not a function name",
        ),
    ],
)
def test_malformed_ground_truth_raises_naming_the_field(ground_truth, message):
    with pytest.raises(RewardError, match=message):
        score_code(fenced("print(1)\n"), ground_truth, LIMITS)


def test_malformed_ground_truth_scores_zero_as_a_counted_error_in_a_batch():
    manager = RewardManager(RewardConfig(executor="serial"))
    results = manager.score_batch(
        [
            RewardInput("apps", fenced("print(3)\n"), {"inputs": ["1 2"], "outputs": ["3"]}),
            RewardInput("apps", fenced("print(3)\n"), {"inputs": ["1 2"]}),
        ]
    )
    assert [r.score for r in results] == [1.0, 0.0]
    assert results[1].error.startswith("RewardError: code ground truth: 'outputs' is missing")
    assert manager.last_report.errors_by_source == {"apps": 1}


def test_total_budget_stops_the_remaining_tests():
    limits = CodeLimits(timeout_s=1.0, total_timeout_s=2.0)
    report = score_code(
        fenced("while True:\n    pass\n"), {"inputs": ["", "", ""], "outputs": ["", "", ""]}, limits
    )
    assert [c.status for c in report.cases] == ["timeout", "timeout", "not_run"]
    assert report.cases[2].reason == "not run: the total budget of 2.0 s was spent"
    assert report.as_score_dict()["not_run"] == 1.0 and report.score == 0.0


def test_max_tests_runs_only_the_first_cases():
    report = score_code(
        fenced("print(3)\n"),
        {"inputs": ["", "", ""], "outputs": ["3", "3", "4"]},
        CodeLimits(timeout_s=2.0, max_tests=2),
    )
    assert report.total == 2 and report.score == 1.0


def test_registered_for_verl_code_sources_and_picklable():
    assert set(CODE_DATA_SOURCES) == {
        "codecontests",
        "apps",
        "codeforces",
        "taco",
        "primeintellect",
        "livecodebench",
    }
    for source in (*CODE_DATA_SOURCES, "code"):
        assert resolve_scorer(source) == (source, code_score)
    got = compute_score(
        "codeforces", fenced("print(sum(map(int, input().split())))\n"), json.dumps(SUM_TESTS)
    )
    assert got["score"] == 1.0 and got["passed"] == 3.0
    # the process pool pickles scorers
    copy = pickle.loads(pickle.dumps(CodeScorer(CodeLimits(timeout_s=1.5))))
    assert copy.limits == CodeLimits(timeout_s=1.5)
    assert REWARD_SCORERS.get("taco") is code_score
    assert parse_code_tests(SUM_TESTS).fn_name is None


def test_batch_of_code_items_in_threads():
    items = [
        RewardInput("apps", fenced("a, b = map(int, input().split())\nprint(a + b)\n"), SUM_TESTS),
        RewardInput("taco", fenced("print(3)\n"), SUM_TESTS),  # right for the first test only
        RewardInput("livecodebench", "no code", SUM_TESTS),
    ]
    with RewardManager(RewardConfig(executor="thread", num_workers=2)) as manager:
        results = manager.score_batch(items)
    assert [r.score for r in results] == [1.0, 1 / 3, 0.0]
    assert results[1].extras["wrong_answer"] == 2.0 and results[2].extras["no_code"] == 1.0
    assert all(r.error is None for r in results)


def test_readme_code_example_runs(capsys):
    text = README.read_text()
    section = text[text.index("### Code problems") :]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})  # noqa: S102 (our own docs)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "0.6666666666666666 test 2: wrong answer: expected stdout '7', got '-30\\n'"
    assert lines[1] == (
        "{'score': 1.0, 'passed': 2.0, 'failed': 0.0, 'total': 2.0, 'wrong_answer': 0.0, "
        "'timeout': 0.0, 'runtime_error': 0.0, 'not_run': 0.0, 'no_code': 0.0}"
    )


def test_scorer_logs_the_first_failure_and_runs_inside_an_event_loop(caplog):
    async def score_in_a_coroutine():
        return CodeScorer(LIMITS)("apps", fenced("print(4)\n"), {"inputs": [""], "outputs": ["3"]})

    with caplog.at_level(logging.DEBUG, logger="tephra.episodes.rewards.code"):
        got = asyncio.run(score_in_a_coroutine())
    assert got["score"] == 0.0 and got["wrong_answer"] == 1.0
    assert (
        "apps: 0/1 tests passed; first failure: test 0: wrong answer: expected stdout '3', "
        "got '4\\n'" in caplog.text
    )


def test_host_without_namespaces_names_the_scorer_setting(monkeypatch):
    monkeypatch.setattr(python_sandbox, "_unshare_works", lambda flags: "no namespaces here")
    with pytest.raises(
        RewardError,
        match=r"cannot create the sandbox's namespaces: no namespaces "
        r"here.*CodeLimits\(accept_missing=\.\.\.\)",
    ):
        score_code(fenced("print(3)\n"), {"inputs": [""], "outputs": ["3"]}, LIMITS)
