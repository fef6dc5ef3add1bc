"""Pulling the final answer out of a model's response.

Each function returns None when the response holds no answer of the expected form, so a
scorer can tell a malformed response (no answer: score 0) from a wrong one.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number as people write it: optional sign, digits with optional thousands commas, optional
# decimals. The sign counts only when the minus does not follow a word or a ')', so "3-2"
# yields 2, not -2; "1,234.50" yields "1234.50"; a sentence's final period is not a decimal.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def extract_last_number(text: str) -> str | None:
    """The last number in `text`, commas removed ("The sum is 1,234." -> "1234"), or None.

    This is the extraction for tasks whose prompt asks for "just the number" (the demo's
    reasoning-gym basic_arithmetic): the model often wraps the number in a sentence.
    """
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_last_integer(text: str) -> int | None:
    """The last number in `text` as an int when it is integral ("12.0" -> 12), else None."""
    number = extract_last_number(text)
    if number is None:
        return None
    value = Decimal(number)
    return int(value) if value == value.to_integral_value() else None


def extract_answer_tag(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last `<tag>...</tag>` in `text`, or None.

    The last one wins because models often restate the question's format before answering.
    """
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def extract_last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched, or None.

    Braces are counted rather than matched by a regex because answers nest them
    (`\\boxed{\\frac{1}{2}}`). An unclosed box counts as no answer.
    """
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    open_brace = text.index("{", start)
    depth = 0
    for position in range(open_brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : position].strip()
    return None


def numbers_equal(a: str, b: str) -> bool:
    """Whether two numeric strings denote the same number ("1,000" == "1000.0"); strings that
    are not numbers compare as stripped text."""
    try:
        return Decimal(a.replace(",", "").strip()) == Decimal(b.replace(",", "").strip())
    except InvalidOperation:
        return a.strip() == b.strip()
