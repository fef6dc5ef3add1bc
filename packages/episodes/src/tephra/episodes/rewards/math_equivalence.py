"""MATH-style answers: the last `\\boxed{...}` of the response is parsed and compared with the
ground truth by math-verify (symbolic and numeric equivalence: `\\frac{1}{2}` == `0.5`).

score = 1.0 if math_verify.verify(parse(ground_truth), parse(last boxed)) else 0.0;
a response without a closed `\\boxed{}` scores 0.0.

Timeouts: math-verify bounds each parse/verify with `signal.alarm`, which Python allows only
in the main thread; called from another thread with a timeout, parse/verify raise
ValueError("... doesn't support threaded environment ..."). So the timeout
(`MATH_VERIFY_TIMEOUT_S`) is used in a main thread (serial scoring, or process-pool workers,
whose tasks run in the worker's main thread) and switched off (None) in thread-pool workers,
where a pathological expression can then run unbounded. Use `RewardConfig.executor="process"`
when the data may hold such expressions. When math-verify's own timeout runs out, the sample
is not scored 0.0 in silence (math-verify's default): it raises `RewardTimeout`, so the
sample counts in `reward/timeouts` like one that ran past `reward.timeout_s`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tephra.episodes.rewards.extraction import extract_last_boxed
from tephra.episodes.rewards.results import RewardError, RewardTimeout

MATH_VERIFY_TIMEOUT_S = 5
"""Seconds math-verify may spend on one parse or comparison (main thread only, see above)."""

MATH_DATA_SOURCES = (
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
)
"""Data-source names (verl's and Hugging Face's spellings) scored by `math_score`."""


class _KnownTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: tephra disables the timeout on
    purpose in worker threads (see the module docstring), so the warning only alarms people."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _logger_name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger_name).addFilter(_KnownTimeoutNotice())


def _timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _timed_out(what: str, timeout: int | None) -> RewardTimeout:
    return RewardTimeout(
        f"math: math-verify's {timeout} s limit ran out while {what} (a busy machine or a "
        f"pathological expression); the sample scores 0.0 and counts in reward/timeouts"
    )


def math_equal(answer_latex: str, ground_truth: str) -> bool:
    """Whether the LaTeX `answer_latex` equals `ground_truth` according to math-verify.
    Raises `RewardTimeout` when math-verify's time limit runs out (it would return "not
    equal" otherwise, indistinguishable from a wrong answer)."""
    # math-verify pulls sympy (seconds to import): only a math scorer needs it
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    timeout = _timeout()
    targets = [LatexExtractionConfig(), ExprExtractionConfig()]

    def parsed(text: str, what: str) -> list[Any]:
        # raise_on_error=True only to tell a timeout from an unparsable text, which
        # math-verify's default turns into the same empty list
        try:
            return list(
                parse(text, extraction_config=targets, parsing_timeout=timeout, raise_on_error=True)
            )
        except TimeoutException:
            raise _timed_out(what, timeout) from None
        except Exception:
            return []

    gold_text = ground_truth if "\\boxed" in ground_truth else f"${ground_truth}$"
    gold = parsed(gold_text, "parsing the ground truth")
    if not gold:
        raise RewardError(
            f"math: ground_truth {ground_truth!r} could not be parsed by math-verify; "
            f"expected a LaTeX or plain answer such as '\\frac{{1}}{{2}}' or '0.5'"
        )
    predicted = parsed(f"${answer_latex}$", "parsing the answer")
    if not predicted:
        return False
    try:
        return bool(verify(gold, predicted, timeout_seconds=timeout, raise_on_error=True))
    except TimeoutException:
        raise _timed_out("comparing the answer with the ground truth", timeout) from None
    except Exception:
        # an error in one pairing of the parsed forms: math-verify's own rule (that pair
        # is "not equal", the others still count) applies
        return bool(verify(gold, predicted, timeout_seconds=timeout))


def math_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """1.0 if the last boxed answer of `solution_str` equals `ground_truth`, else 0.0."""
    if ground_truth is None or str(ground_truth).strip() == "":
        raise RewardError(
            "math: ground_truth is empty; expected the reference answer, e.g. '\\frac{1}{2}'"
        )
    boxed = extract_last_boxed(solution_str)
    if boxed is None or boxed == "":
        return 0.0
    return 1.0 if math_equal(boxed, str(ground_truth)) else 0.0
