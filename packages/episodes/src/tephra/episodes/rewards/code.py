"""Code problems: the model's Python program is run against the problem's tests in tephra's
sandbox (`tephra.episodes.tools.python_sandbox`), one sandbox run per test case.

The program is the last ```python (or ```py / ```python3) fenced block of the response, else
the last bare ``` block; a response with neither scores 0 (`no_code` = 1).

The ground truth is verl's code format, a dict or its JSON string::

    {"inputs": [stdin, ...], "outputs": [expected stdout, ...]}
    {"fn_name": "add", "inputs": [args, ...], "outputs": [expected return value, ...]}

- stdin format (no `fn_name`): each input is fed to the program on stdin (`input()`,
  `sys.stdin`, `open(0)` all work) and its stdout must equal the expected output after
  trailing whitespace is stripped from every line and trailing blank lines are dropped.
  An input or output may also be a list of lines. The program must exit with status 0.
- `fn_name` format (LeetCode-style rows of LiveCodeBench, PrimeIntellect, APPS, TACO): the
  program is loaded as a module (so an `if __name__ == "__main__":` block does not run) after
  the imports LeetCode provides (`typing`, `collections`, `heapq`, `math`, ...), and
  `Solution().<fn_name>` (or a top-level function `<fn_name>`) is called. Each input is either
  a string with one JSON value per line (verl's prime / sandbox_fusion convention, e.g.
  "[1, 2]\\n3") or a list of the arguments (APPS / TACO). The return value, made JSON-like
  (tuples become lists, dict keys strings), must equal the expected output, which is
  JSON-decoded when it is a string (a string that is not JSON is compared as text); an
  expected value wrapped in a one-element list (APPS stores `[answer]`) also matches its
  element. What the function prints is discarded.

The expected outputs never enter the sandbox, so a program cannot read them.

Score: the fraction of test cases passed. A case fails on a wrong answer, on an exception or
non-zero exit, on a timeout (`CodeLimits.timeout_s` wall-clock per case, the CPU-time limit
set to match) or when the total budget (`CodeLimits.total_timeout_s`) is spent before it
runs. The registered scorer returns ``{"score", "passed", "failed", "total", "wrong_answer",
"timeout", "runtime_error", "not_run", "no_code"}`` (all numbers: tephra keeps only numeric
extras); `score_code` returns the whole `CodeReport`, with each case's status and the first
failure's reason, which the scorer also logs at DEBUG level.

A ground truth that cannot be read (not JSON, no `inputs` or `outputs` list, lists of
different lengths, no tests, an `fn_name` input that is not JSON) raises `RewardError` naming
the field and the expected shape: the reward manager then scores the item 0.0, counts it as a
scorer error of its data source and logs the message once, so a broken data set shows up at
once instead of as a quietly low reward.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tephra.episodes.rewards.results import RewardError
from tephra.episodes.tools.base import ToolError
from tephra.episodes.tools.python_sandbox import PythonSandbox, SandboxConfig, SandboxRun

logger = logging.getLogger(__name__)

CODE_DATA_SOURCES = (
    "codecontests",
    "apps",
    "codeforces",
    "taco",
    "primeintellect",
    "livecodebench",
)
"""Data sources scored by `code_score`: verl's code sources (`default_compute_score`) plus
PrimeIntellect and LiveCodeBench. It is also registered as `code`, for `scorer_overrides`."""

STATUSES = ("passed", "wrong_answer", "timeout", "runtime_error", "not_run")
"""What can happen to one test case."""

GROUND_TRUTH_SHAPE = (
    '{"inputs": [...], "outputs": [...]} (stdin -> stdout) or '
    '{"fn_name": "f", "inputs": [...], "outputs": [...]} (call -> return value)'
)


@dataclass(frozen=True)
class CodeLimits:
    """Limits of one response's test run."""

    timeout_s: float = 5.0
    """Wall-clock seconds per test case, interpreter start-up included (~0.1 s); the CPU-time
    limit is set to the same, rounded up."""
    total_timeout_s: float = 60.0
    """Wall-clock seconds for all the cases of one response; cases not started by then fail
    as `not_run` (a case is also cut short so as to end within the budget)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS); all the case's processes together get twice it."""
    max_output_bytes: int = 4 << 20
    """stdout + stderr read per case before the run is killed (and the case fails)."""
    max_tests: int | None = None
    """Run only the first `max_tests` cases (verl's continuous prime score uses 10); None: all."""
    allow_network: bool = False
    """Passed to the sandbox: True runs the program without a network namespace of its own."""
    accept_missing: tuple[str, ...] = ()
    """Passed to the sandbox: protections this host may lack that you accept running without
    ('namespaces', 'seccomp'; see the python tool's security notes); by default such a host
    raises instead."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or not self.total_timeout_s > 0:
            raise RewardError(
                f"CodeLimits: timeout_s={self.timeout_s} and total_timeout_s="
                f"{self.total_timeout_s} must be > 0"
            )
        if self.max_tests is not None and self.max_tests < 1:
            raise RewardError(f"CodeLimits: max_tests={self.max_tests} must be >= 1 or None")


@dataclass
class CodeCase:
    """One test: stdin text and expected stdout, or call arguments and expected value."""

    stdin: str = ""
    args: list[Any] | None = None
    expected: Any = None


@dataclass
class CodeTests:
    """Parsed ground truth."""

    cases: list[CodeCase]
    fn_name: str | None = None


@dataclass
class CaseResult:
    status: str
    """One of `STATUSES`."""
    reason: str | None = None
    """Why it failed (None when it passed)."""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class CodeReport:
    """The outcome of one response."""

    cases: list[CaseResult] = field(default_factory=list)
    total: int = 0
    """Test cases of the problem (counted even when no program was found)."""
    no_code: bool = False

    @property
    def passed(self) -> int:
        return sum(case.passed for case in self.cases)

    @property
    def failed(self) -> int:
        return self.total - self.passed

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def first_failure(self) -> str | None:
        """Reason of the first failing case (or of the missing program), None if all passed."""
        if self.no_code:
            return NO_CODE_REASON
        return next(
            (f"test {i}: {c.reason}" for i, c in enumerate(self.cases) if not c.passed), None
        )

    def as_score_dict(self) -> dict[str, float]:
        counts = {status: 0.0 for status in STATUSES[1:]}
        for case in self.cases:
            if not case.passed:
                counts[case.status] += 1
        return {
            "score": self.score,
            "passed": float(self.passed),
            "failed": float(self.failed),
            "total": float(self.total),
            **counts,
            "no_code": float(self.no_code),
        }


NO_CODE_REASON = "no ```python (or bare ```) code block in the response"

# A fenced block: opening fence with an optional language tag, body up to the next fence.
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_program(response: str) -> str | None:
    """The last ```python block of `response`, else its last bare ``` block, else None.

    Blocks tagged with another language (```text with sample output, say) are skipped; an
    unclosed final fence (a response cut off by the token limit) is not a block.
    """
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(response)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        bodies = [body for tag, body in blocks if wanted(tag)]
        if bodies:
            return textwrap.dedent(bodies[-1])  # a fence indented in a list indents its code
    return None


def _as_list(value: Any) -> Any:
    # pandas/pyarrow give a parquet list column as a numpy array
    return (
        value.tolist()
        if hasattr(value, "tolist") and not isinstance(value, (str, bytes))
        else value
    )


def _lines(value: Any, where: str) -> str:
    """A stdin input or expected stdout: text, a list of lines, a number, or None (empty)."""
    value = _as_list(value)
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RewardError(
        f"code ground truth: {where} is a {type(value).__name__} ({_short(value)}); "
        "in the stdin format it must be text or a list of lines"
    )


def _call_args(value: Any, where: str) -> list[Any]:
    value = _as_list(value)
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        args = []
        for number, line in enumerate(value.split("\n"), 1):
            if line.strip():
                try:
                    args.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise RewardError(
                        f"code ground truth: {where}, line {number} ({_short(line)}) is not JSON "
                        f"({exc.msg}); with fn_name each input holds one JSON value per line "
                        "(one per argument) or is a list of the arguments"
                    ) from None
        return args
    raise RewardError(
        f"code ground truth: {where} is a {type(value).__name__}; with fn_name it "
        "must be a string of JSON lines (one per argument) or a list of arguments"
    )


def _expected_value(value: Any) -> Any:
    value = _as_list(value)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value  # a plain string answer stored without JSON quotes
    return value


def parse_code_tests(ground_truth: Any) -> CodeTests:
    """The tests of a verl code ground truth (dict or JSON string); RewardError naming the
    field when it cannot be read."""
    data = ground_truth
    if isinstance(data, (bytes, str)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise RewardError(
                f"code ground truth is not valid JSON ({exc}: {_short(ground_truth)}); "
                f"expected {GROUND_TRUTH_SHAPE}"
            ) from None
    if not isinstance(data, dict):
        raise RewardError(
            f"code ground truth is a {type(data).__name__}, not a dict; expected "
            f"{GROUND_TRUTH_SHAPE}"
        )
    lists = {}
    for key in ("inputs", "outputs"):
        value = _as_list(data.get(key))
        if not isinstance(value, list):
            found = "missing" if key not in data else f"a {type(value).__name__}"
            raise RewardError(
                f"code ground truth: {key!r} is {found}, not a list (keys: "
                f"{sorted(data)}); expected {GROUND_TRUTH_SHAPE}"
            )
        lists[key] = value
    inputs, outputs = lists["inputs"], lists["outputs"]
    if len(inputs) != len(outputs):
        raise RewardError(
            f"code ground truth: 'inputs' has {len(inputs)} entries but 'outputs' "
            f"{len(outputs)}; each input needs its expected output"
        )
    if not inputs:
        raise RewardError(
            "code ground truth: 'inputs' and 'outputs' are empty; a problem needs "
            "at least one test case"
        )
    fn_name = data.get("fn_name") or None  # rows of mixed sources hold null or ""
    if fn_name is not None and not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise RewardError(f"code ground truth: 'fn_name' = {fn_name!r} is not a function name")
    if fn_name is None:
        cases = [
            CodeCase(stdin=_lines(i, f"inputs[{n}]"), expected=_lines(o, f"outputs[{n}]"))
            for n, (i, o) in enumerate(zip(inputs, outputs, strict=True))
        ]
    else:
        cases = [
            CodeCase(args=_call_args(i, f"inputs[{n}]"), expected=_expected_value(o))
            for n, (i, o) in enumerate(zip(inputs, outputs, strict=True))
        ]
    return CodeTests(cases=cases, fn_name=fn_name)


def normalise_stdout(text: str) -> str:
    """Trailing whitespace of each line and trailing blank lines removed."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The harness runs as the sandbox's program: the test's stdin goes into a memory file on fd 0
# (the sandbox reads the program itself from stdin, then points fd 0 at /dev/null).
_STDIN_HARNESS = """\
import os as _os
_fd = _os.open("/tmp", _os.O_TMPFILE | _os.O_RDWR, 0o600)  # unnamed; the sandbox refuses memfd
_view = memoryview({stdin!r}.encode())
while _view:
    _view = _view[_os.write(_fd, _view):]
_os.lseek(_fd, 0, 0)
_os.dup2(_fd, 0)
_os.close(_fd)
del _os, _fd, _view
exec(compile({program!r}, "solution.py", "exec"), {{"__name__": "__main__", "__file__": "solution.py"}})
"""

# What LeetCode's Python environment has imported before the solution; `from builtins import *`
# last undoes the shadowing of builtins such as pow by math's.
_CALL_PRELUDE = """\
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
from builtins import *
import bisect, collections, copy, functools, heapq, itertools, json, math, operator, random, re, string, sys
"""

_CALL_HARNESS = """\
import json as _json, os as _os, sys as _sys
_ns = {{"__name__": "solution", "__file__": "solution.py"}}
exec(compile({prelude!r}, "prelude.py", "exec"), _ns)
_sys.stdout = open(_os.devnull, "w")  # the solution's prints are not its answer
exec(compile({program!r}, "solution.py", "exec"), _ns)
_solution = _ns.get("Solution")
if isinstance(_solution, type) and hasattr(_solution, {fn_name!r}):
    _fn = getattr(_solution(), {fn_name!r})
elif callable(_ns.get({fn_name!r})):
    _fn = _ns[{fn_name!r}]
else:
    raise NameError("the program defines neither a function " + {fn_name!r} + " nor a method Solution." + {fn_name!r})
_result = _fn(*_json.loads({args!r}))

def _plain(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "tolist"):  # numpy values
        return value.tolist()
    raise TypeError("the return value holds a " + type(value).__name__ + ", which is not JSON-like")

_os.write(1, ("\\n" + {marker!r} + _json.dumps(_result, default=_plain) + "\\n").encode())
"""


def _harness(program: str, case: CodeCase, fn_name: str | None, marker: str) -> str:
    if fn_name is None:
        return _STDIN_HARNESS.format(stdin=case.stdin, program=program)
    return _CALL_HARNESS.format(
        prelude=_CALL_PRELUDE,
        program=program,
        fn_name=fn_name,
        args=json.dumps(case.args),
        marker=marker,
    )


def _returned(stdout: str, marker: str) -> tuple[bool, Any]:
    """(found, value) of the harness's result line."""
    at = stdout.rfind(marker)
    if at < 0:
        return False, None
    line = stdout[at + len(marker) :].split("\n", 1)[0]
    try:
        return True, json.loads(line)
    except json.JSONDecodeError:
        return False, None


def _values_equal(actual: Any, expected: Any) -> bool:
    if actual == expected:
        return True
    # APPS / TACO store a call's expected value wrapped in a list
    return isinstance(expected, list) and len(expected) == 1 and actual == expected[0]


def _judge(run: SandboxRun, case: CodeCase, fn_name: str | None, marker: str) -> CaseResult:
    if run.error is not None:
        timed_out = run.error.startswith("wall-time limit") or run.exit_code == 128 + signal.SIGXCPU
        return CaseResult("timeout" if timed_out else "runtime_error", run.error, run.wall_s)
    if fn_name is None:
        got = normalise_stdout(run.stdout)
        if got == normalise_stdout(case.expected):
            return CaseResult("passed", None, run.wall_s)
        return CaseResult(
            "wrong_answer",
            f"wrong answer: expected stdout {_short(case.expected)}, got {_short(run.stdout)}",
            run.wall_s,
        )
    found, value = _returned(run.stdout, marker)
    if not found:
        return CaseResult(
            "runtime_error",
            f"{fn_name} returned no readable value (stdout: {_short(run.stdout)})",
            run.wall_s,
        )
    if _values_equal(value, case.expected):
        return CaseResult("passed", None, run.wall_s)
    return CaseResult(
        "wrong_answer",
        f"wrong answer: {fn_name}(*{_short(case.args)}) returned "
        f"{_short(value)}, expected {_short(case.expected)}",
        run.wall_s,
    )


def _sandbox(config: SandboxConfig) -> PythonSandbox:
    try:
        return PythonSandbox(config)
    except ToolError as exc:
        # the tool's message names the tool's config; the scorer's switch is CodeLimits
        raise RewardError(
            f"code scorer: {exc}. For the code scorer that setting is "
            "CodeLimits(accept_missing=...): register CodeScorer(CodeLimits(accept_missing="
            "('namespaces',))) "
            "under a name of your own and route the data sources to it with "
            "reward.scorer_overrides"
        ) from exc


async def run_code_tests_async(
    program: str, tests: CodeTests, limits: CodeLimits | None = None
) -> CodeReport:
    """Run `program` on every case of `tests`, one sandbox per case, in order."""
    limits = limits or CodeLimits()
    cases = tests.cases[: limits.max_tests]  # [:None] is all
    report = CodeReport(total=len(cases))
    start = time.monotonic()
    for case in cases:
        remaining = limits.total_timeout_s - (time.monotonic() - start)
        if remaining <= 0:
            report.cases.append(
                CaseResult(
                    "not_run", f"not run: the total budget of {limits.total_timeout_s} s was spent"
                )
            )
            continue
        timeout = min(limits.timeout_s, remaining)
        # a fresh sandbox (uid, folder) per case: one case cannot leave files for the next
        sandbox = _sandbox(
            SandboxConfig(
                timeout_s=timeout,
                cpu_time_s=max(1, math.ceil(timeout)),
                memory_mb=limits.memory_mb,
                total_memory_mb=2 * limits.memory_mb,
                max_output_bytes=limits.max_output_bytes,
                # the stdin file (unnamed, in the case's folder) counts against the file-size
                # limit and the folder's quota
                max_file_size_mb=max(16, len(case.stdin.encode()) // 2**20 + 2),
                disk_quota_mb=max(64, len(case.stdin.encode()) // 2**20 + 34),
                allow_network=limits.allow_network,
                accept_missing=list(limits.accept_missing),
            )
        )
        marker = f"tephra-result-{secrets.token_hex(8)}:"
        uid = sandbox.new_uid()
        workdir, mounted = await asyncio.to_thread(sandbox.make_workdir, uid)
        try:
            run = await sandbox.run(_harness(program, case, tests.fn_name, marker), workdir, uid)
        finally:
            await asyncio.to_thread(sandbox.remove_workdir, workdir, mounted)
        report.cases.append(_judge(run, case, tests.fn_name, marker))
    return report


def run_code_tests(program: str, tests: CodeTests, limits: CodeLimits | None = None) -> CodeReport:
    """`run_code_tests_async` from synchronous code (also from a thread whose event loop is
    running, as scorers may be called there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_code_tests_async(program, tests, limits))
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_code_tests_async(program, tests, limits)).result()


def score_code(
    solution_str: str, ground_truth: Any, limits: CodeLimits | None = None
) -> CodeReport:
    """Extract the program from the response and run it on the ground truth's tests.

    The ground truth is parsed first, so a malformed one raises even for a response without
    code."""
    limits = limits or CodeLimits()
    tests = parse_code_tests(ground_truth)
    program = extract_program(solution_str)
    if program is None:
        return CodeReport(total=len(tests.cases[: limits.max_tests]), no_code=True)
    return run_code_tests(program, tests, limits)


class CodeScorer:
    """The registered scorer (verl's signature) with its `CodeLimits`; picklable, so it also
    runs in the reward manager's process pool. For other limits register another one::

        REWARD_SCORERS.register("code_strict", CodeScorer(CodeLimits(timeout_s=2.0)))
        RewardConfig(scorer_overrides={"codeforces": "code_strict"})
    """

    def __init__(self, limits: CodeLimits | None = None) -> None:
        self.limits = limits or CodeLimits()

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> dict[str, float]:
        report = score_code(solution_str, ground_truth, self.limits)
        if report.first_failure is not None:
            logger.debug(
                "%s: %d/%d tests passed; first failure: %s",
                data_source,
                report.passed,
                report.total,
                report.first_failure,
            )
        return report.as_score_dict()

    def __repr__(self) -> str:
        return f"CodeScorer({self.limits!r})"


code_score = CodeScorer()
"""The scorer registered for `CODE_DATA_SOURCES` and `code`, with the default `CodeLimits`."""
