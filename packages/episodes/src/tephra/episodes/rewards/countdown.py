"""Countdown: combine the given numbers with + - * / (each at most once) to reach a target.

The ground truth is `{"target": 24, "numbers": [3, 4, 6, 2]}`, as a dict or its JSON string.
The answer is the expression inside the response's last `<answer>...</answer>`; a trailing
`= value` is ignored ("(6-2)*6 = 24" is read as "(6-2)*6").

score = 1.0           if the expression uses each given number at most once and equals target
        format_score  (0.1, as in TinyZero) if it is a well-formed arithmetic expression
                      that breaks a rule or misses the target (also: division by zero)
        0.0           if there is no <answer> tag or the content is not arithmetic on integers
extras: {"acc": 1.0 if correct else 0.0}

The expression is evaluated exactly with fractions over the parsed syntax tree (never eval):
only integer literals, + - * /, unary minus and parentheses are accepted.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from fractions import Fraction
from typing import Any

from tephra.episodes.rewards.extraction import extract_answer_tag
from tephra.episodes.rewards.results import RewardError

FORMAT_SCORE = 0.1
"""Score of a well-formed expression that is wrong (rewards learning the output format)."""

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class _NotArithmetic(Exception):
    """The answer is not an arithmetic expression on integer literals."""


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of the expression; integer literals are appended to `used`."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, used)
        return -value if isinstance(node.op, ast.USub) else value
    raise _NotArithmetic(type(node).__name__)


def parse_countdown_ground_truth(ground_truth: Any) -> tuple[int, list[int]]:
    """(target, numbers) from a dict or JSON string `{"target": int, "numbers": [int, ...]}`."""
    value = ground_truth
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict) or "target" not in value or "numbers" not in value:
        raise RewardError(
            f"countdown: ground_truth={ground_truth!r} is not understood; expected "
            f'{{"target": 24, "numbers": [3, 4, 6, 2]}} as a dict or a JSON string'
        )
    return int(value["target"]), [int(n) for n in value["numbers"]]


def countdown_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict[str, float]:
    """Score one countdown response (see the module docstring for the rule)."""
    target, numbers = parse_countdown_ground_truth(ground_truth)
    wrong = {"score": 0.0, "acc": 0.0}
    expression = extract_answer_tag(solution_str)
    if not expression:
        return wrong
    expression = expression.split("=", 1)[0].strip()
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(expression, mode="eval"), used)
    except ZeroDivisionError:
        return {"score": FORMAT_SCORE, "acc": 0.0}
    except (SyntaxError, ValueError, RecursionError, _NotArithmetic):
        return wrong
    # Counter subtraction keeps only what was used more often than it was given.
    over_used = Counter(used) - Counter(numbers)
    if over_used or value != target:
        return {"score": FORMAT_SCORE, "acc": 0.0}
    return {"score": 1.0, "acc": 1.0}
