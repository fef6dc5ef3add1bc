"""The shipped software-engineering tasks: 32 tiny Python repositories, each with a real bug
that makes some of its tests fail, and the reference fix (for the tests only: it is never
shown to the model).

A task's tests are the module-level `test_*` functions of its `test_*.py` files, named
`file::function`; `failing` lists those that fail before the fix (the rest pass, and must
keep passing). The first `TRAIN` tasks train, the rest are held out.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from tephra.core.errors import ConfigError


@dataclass(frozen=True)
class SweTask:
    """One repository: its files, the issue the model is given, the reference fix."""

    name: str
    issue: str
    """What a user reported (the prompt's problem statement)."""
    files: dict[str, str]
    """Relative path -> text of every file of the repository."""
    fix: list[tuple[str, str, str]]
    """The reference fix: (path, old text, new text) edits, each old text found once."""
    failing: tuple[str, ...]
    """Test ids (`file::function`) that fail before the fix."""
    test_ids: tuple[str, ...] = field(init=False)
    """Every test of the task, in file and source order."""

    def __post_init__(self) -> None:
        ids = []
        for path in self.test_files:
            tree = ast.parse(self.files[path], path)
            ids += [
                f"{path}::{node.name}"
                for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            ]
        object.__setattr__(self, "test_ids", tuple(ids))

    @property
    def test_files(self) -> list[str]:
        """The repository's test files (read-only for the model; restored before each run)."""
        return sorted(p for p in self.files if p.rsplit("/", 1)[-1].startswith("test_"))

    @property
    def noop_score(self) -> float:
        """The reward of leaving the repository as it is: the share of tests passing."""
        return (len(self.test_ids) - len(self.failing)) / len(self.test_ids)


def _task(name: str, issue: str, files: dict[str, str], fix: list, failing: list[str]) -> SweTask:
    return SweTask(name, issue, files, [tuple(f) for f in fix], tuple(failing))


TASKS: list[SweTask] = [
    _task(
        "clamp",
        "clamp(x, lo, hi) returns hi when x is below lo; it should return lo.",
        {
            "numeric.py": "def clamp(x, lo, hi):\n"
            '    """x limited to [lo, hi]."""\n'
            "    if x < lo:\n        return hi\n    if x > hi:\n        return hi\n    return x\n",
            "test_numeric.py": "from numeric import clamp\n\n\n"
            "def test_inside():\n    assert clamp(5, 0, 10) == 5\n\n\n"
            "def test_above():\n    assert clamp(12, 0, 10) == 10\n\n\n"
            "def test_below():\n    assert clamp(-3, 0, 10) == 0\n",
        },
        [("numeric.py", "    if x < lo:\n        return hi", "    if x < lo:\n        return lo")],
        ["test_numeric.py::test_below"],
    ),
    _task(
        "mean_empty",
        "mean([]) raises ZeroDivisionError; it should raise ValueError('mean of no values').",
        {
            "stats.py": "def mean(values):\n    values = list(values)\n"
            "    return sum(values) / len(values)\n",
            "test_stats.py": "from stats import mean\n\n\n"
            "def test_mean():\n    assert mean([1, 2, 3]) == 2\n\n\n"
            "def test_generator():\n    assert mean(x for x in (4, 6)) == 5\n\n\n"
            "def test_empty():\n    try:\n        mean([])\n    except ValueError:\n        return\n"
            "    raise AssertionError('no ValueError')\n",
        },
        [
            (
                "stats.py",
                "    values = list(values)\n",
                "    values = list(values)\n    if not values:\n"
                "        raise ValueError('mean of no values')\n",
            )
        ],
        ["test_stats.py::test_empty"],
    ),
    _task(
        "chunks",
        "chunks(seq, n) drops the last chunk when len(seq) is not a multiple of n.",
        {
            "batching.py": "def chunks(seq, n):\n"
            '    """seq cut into lists of n items (the last may be shorter)."""\n'
            "    return [seq[i : i + n] for i in range(0, len(seq) - n + 1, n)]\n",
            "test_batching.py": "from batching import chunks\n\n\n"
            "def test_even():\n    assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]\n\n\n"
            "def test_rest():\n    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]\n\n\n"
            "def test_short():\n    assert chunks([1], 3) == [[1]]\n\n\n"
            "def test_empty():\n    assert chunks([], 3) == []\n",
        },
        [("batching.py", "range(0, len(seq) - n + 1, n)", "range(0, len(seq), n)")],
        ["test_batching.py::test_rest", "test_batching.py::test_short"],
    ),
    _task(
        "leap_year",
        "is_leap(2000) is False, but 2000 was a leap year (divisible by 400).",
        {
            "calendar_rules.py": "def is_leap(year):\n"
            "    return year % 4 == 0 and year % 100 != 0\n",
            "test_calendar_rules.py": "from calendar_rules import is_leap\n\n\n"
            "def test_common():\n    assert not is_leap(2023)\n\n\n"
            "def test_every_fourth():\n    assert is_leap(2024)\n\n\n"
            "def test_century():\n    assert not is_leap(1900)\n\n\n"
            "def test_fourth_century():\n    assert is_leap(2000)\n",
        },
        [
            (
                "calendar_rules.py",
                "year % 4 == 0 and year % 100 != 0",
                "(year % 4 == 0 and year % 100 != 0) or year % 400 == 0",
            )
        ],
        ["test_calendar_rules.py::test_fourth_century"],
    ),
    _task(
        "binary_search",
        "index_of(items, x) returns -1 for the last element of the sorted list.",
        {
            "search.py": "def index_of(items, x):\n"
            '    """Index of x in the sorted list items, or -1."""\n'
            "    lo, hi = 0, len(items) - 1\n    while lo < hi:\n"
            "        mid = (lo + hi) // 2\n        if items[mid] == x:\n            return mid\n"
            "        if items[mid] < x:\n            lo = mid + 1\n        else:\n"
            "            hi = mid - 1\n    return -1\n",
            "test_search.py": "from search import index_of\n\n\n"
            "def test_middle():\n    assert index_of([1, 3, 5, 7], 3) == 1\n\n\n"
            "def test_missing():\n    assert index_of([1, 3, 5, 7], 4) == -1\n\n\n"
            "def test_last():\n    assert index_of([1, 3, 5, 7], 7) == 3\n\n\n"
            "def test_single():\n    assert index_of([2], 2) == 0\n",
        },
        [("search.py", "    while lo < hi:", "    while lo <= hi:")],
        ["test_search.py::test_last", "test_search.py::test_single"],
    ),
    _task(
        "word_count",
        "word_counts('The cat the dog') counts 'The' and 'the' as different words; counting "
        "should ignore case.",
        {
            "text.py": "def word_counts(text):\n    counts = {}\n    for word in text.split():\n"
            "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
            "test_text.py": "from text import word_counts\n\n\n"
            "def test_simple():\n    assert word_counts('a b a') == {'a': 2, 'b': 1}\n\n\n"
            "def test_case():\n    assert word_counts('The cat the dog') == "
            "{'the': 2, 'cat': 1, 'dog': 1}\n\n\n"
            "def test_empty():\n    assert word_counts('') == {}\n",
        },
        [("text.py", "    for word in text.split():", "    for word in text.lower().split():")],
        ["test_text.py::test_case"],
    ),
    _task(
        "fizzbuzz",
        "fizzbuzz(15) returns 'Fizz' instead of 'FizzBuzz'.",
        {
            "game.py": "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n"
            "    if n % 5 == 0:\n        return 'Buzz'\n    if n % 15 == 0:\n"
            "        return 'FizzBuzz'\n    return str(n)\n",
            "test_game.py": "from game import fizzbuzz\n\n\n"
            "def test_number():\n    assert fizzbuzz(7) == '7'\n\n\n"
            "def test_fizz():\n    assert fizzbuzz(9) == 'Fizz'\n\n\n"
            "def test_buzz():\n    assert fizzbuzz(10) == 'Buzz'\n\n\n"
            "def test_fizzbuzz():\n    assert fizzbuzz(30) == 'FizzBuzz'\n",
        },
        [
            (
                "game.py",
                "def fizzbuzz(n):\n    if n % 3 == 0:",
                "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:",
            )
        ],
        ["test_game.py::test_fizzbuzz"],
    ),
    _task(
        "fahrenheit",
        "to_fahrenheit(100) gives 203.0; water boils at 212 F.",
        {
            "units.py": "def to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 23\n\n\n"
            "def to_celsius(fahrenheit):\n    return (fahrenheit - 32) * 5 / 9\n",
            "test_units.py": "from units import to_celsius, to_fahrenheit\n\n\n"
            "def test_boiling():\n    assert to_fahrenheit(100) == 212\n\n\n"
            "def test_freezing():\n    assert to_fahrenheit(0) == 32\n\n\n"
            "def test_back():\n    assert to_celsius(212) == 100\n",
        },
        [("units.py", "celsius * 9 / 5 + 23", "celsius * 9 / 5 + 32")],
        ["test_units.py::test_boiling", "test_units.py::test_freezing"],
    ),
    _task(
        "median",
        "median([1, 2, 3, 4]) returns 3; for an even count it should average the middle two.",
        {
            "stats.py": "def median(values):\n    ordered = sorted(values)\n"
            "    return ordered[len(ordered) // 2]\n",
            "test_stats.py": "from stats import median\n\n\n"
            "def test_odd():\n    assert median([3, 1, 2]) == 2\n\n\n"
            "def test_even():\n    assert median([4, 1, 3, 2]) == 2.5\n\n\n"
            "def test_one():\n    assert median([7]) == 7\n",
        },
        [
            (
                "stats.py",
                "    return ordered[len(ordered) // 2]\n",
                "    mid = len(ordered) // 2\n    if len(ordered) % 2:\n        return ordered[mid]\n"
                "    return (ordered[mid - 1] + ordered[mid]) / 2\n",
            )
        ],
        ["test_stats.py::test_even"],
    ),
    _task(
        "flatten",
        "flatten([1, [2, [3]]]) returns [1, 2, [3]]; it should flatten every level.",
        {
            "nesting.py": "def flatten(items):\n    out = []\n    for item in items:\n"
            "        if isinstance(item, list):\n            out.extend(item)\n"
            "        else:\n            out.append(item)\n    return out\n",
            "test_nesting.py": "from nesting import flatten\n\n\n"
            "def test_flat():\n    assert flatten([1, 2]) == [1, 2]\n\n\n"
            "def test_one_level():\n    assert flatten([1, [2, 3]]) == [1, 2, 3]\n\n\n"
            "def test_deep():\n    assert flatten([1, [2, [3, [4]]]]) == [1, 2, 3, 4]\n",
        },
        [("nesting.py", "            out.extend(item)", "            out.extend(flatten(item))")],
        ["test_nesting.py::test_deep"],
    ),
    _task(
        "dedupe_order",
        "dedupe([3, 1, 3, 2]) returns [1, 2, 3]; it should keep the "
        "first occurrence of each, in order.",
        {
            "lists.py": "def dedupe(items):\n    return list(set(items))\n",
            "test_lists.py": "from lists import dedupe\n\n\n"
            "def test_no_repeats():\n    assert sorted(dedupe([3, 1, 3])) == [1, 3]\n\n\n"
            "def test_order():\n    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]\n\n\n"
            "def test_empty():\n    assert dedupe([]) == []\n",
        },
        [("lists.py", "    return list(set(items))\n", "    return list(dict.fromkeys(items))\n")],
        ["test_lists.py::test_order"],
    ),
    _task(
        "parse_bool",
        "parse_bool('false') returns True; only 'true', 'yes' and '1' (any case) are true.",
        {
            "config_values.py": "def parse_bool(text):\n    return bool(text.strip())\n",
            "test_config_values.py": "from config_values import parse_bool\n\n\n"
            "def test_true():\n    assert parse_bool('True') is True\n\n\n"
            "def test_false():\n    assert parse_bool('false') is False\n\n\n"
            "def test_zero():\n    assert parse_bool(' 0 ') is False\n\n\n"
            "def test_yes():\n    assert parse_bool('YES') is True\n",
        },
        [
            (
                "config_values.py",
                "    return bool(text.strip())",
                "    return text.strip().lower() in ('true', 'yes', '1')",
            )
        ],
        ["test_config_values.py::test_false", "test_config_values.py::test_zero"],
    ),
    _task(
        "mutable_default",
        "add_tag('x') called twice without a list returns ['x', 'x']: calls share one list.",
        {
            "tags.py": "def add_tag(tag, tags=[]):\n    tags.append(tag)\n    return tags\n",
            "test_tags.py": "from tags import add_tag\n\n\n"
            "def test_given_list():\n    assert add_tag('a', ['b']) == ['b', 'a']\n\n\n"
            "def test_fresh_each_call():\n    add_tag('x')\n    assert add_tag('y') == ['y']\n",
        },
        [
            (
                "tags.py",
                "def add_tag(tag, tags=[]):\n",
                "def add_tag(tag, tags=None):\n    tags = [] if tags is None else tags\n",
            )
        ],
        ["test_tags.py::test_fresh_each_call"],
    ),
    _task(
        "stack_peek",
        "Stack.peek() returns the oldest item; it should return the top (last pushed) one.",
        {
            "stack.py": "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, item):\n        self.items.append(item)\n\n"
            "    def pop(self):\n        return self.items.pop()\n\n"
            "    def peek(self):\n        return self.items[0]\n",
            "test_stack.py": "from stack import Stack\n\n\n"
            "def test_pop():\n    s = Stack()\n    s.push(1)\n    s.push(2)\n    assert s.pop() == 2\n\n\n"
            "def test_peek():\n    s = Stack()\n    s.push(1)\n    s.push(2)\n    assert s.peek() == 2\n\n\n"
            "def test_peek_keeps():\n    s = Stack()\n    s.push(5)\n    s.peek()\n"
            "    assert s.pop() == 5\n",
        },
        [("stack.py", "        return self.items[0]", "        return self.items[-1]")],
        ["test_stack.py::test_peek"],
    ),
    _task(
        "rotate",
        "rotate([1, 2, 3], 4) raises no error but returns the list unrotated; k should wrap "
        "around the length, and rotate([], 1) should return [].",
        {
            "sequences.py": "def rotate(items, k):\n"
            '    """items rotated left by k places."""\n'
            "    return items[k:] + items[:k]\n",
            "test_sequences.py": "from sequences import rotate\n\n\n"
            "def test_small():\n    assert rotate([1, 2, 3], 1) == [2, 3, 1]\n\n\n"
            "def test_wrap():\n    assert rotate([1, 2, 3], 4) == [2, 3, 1]\n\n\n"
            "def test_empty():\n    assert rotate([], 1) == []\n\n\n"
            "def test_negative():\n    assert rotate([1, 2, 3], -1) == [3, 1, 2]\n",
        },
        [
            (
                "sequences.py",
                "    return items[k:] + items[:k]\n",
                "    if not items:\n        return []\n    k %= len(items)\n"
                "    return items[k:] + items[:k]\n",
            )
        ],
        ["test_sequences.py::test_wrap"],
    ),
    _task(
        "title_case",
        'title_words("don\'t stop") returns "Don\'T Stop"; only the first letter of each word '
        "should change.",
        {
            "strings.py": "def title_words(text):\n    return text.title()\n",
            "test_strings.py": "from strings import title_words\n\n\n"
            "def test_simple():\n    assert title_words('hello world') == 'Hello World'\n\n\n"
            'def test_apostrophe():\n    assert title_words("don\'t stop") == "Don\'t Stop"\n\n\n'
            "def test_keeps_rest():\n    assert title_words('iPhone') == 'IPhone'\n",
        },
        [
            (
                "strings.py",
                "    return text.title()",
                "    return ' '.join(w[:1].upper() + w[1:] for w in text.split(' '))",
            )
        ],
        ["test_strings.py::test_apostrophe", "test_strings.py::test_keeps_rest"],
    ),
    _task(
        "range_sum",
        "total(1, 3) returns 3; the range is inclusive, so it should be 1 + 2 + 3 = 6.",
        {
            "ranges.py": "def total(first, last):\n"
            '    """Sum of the integers first..last, both included."""\n'
            "    return sum(range(first, last))\n",
            "test_ranges.py": "from ranges import total\n\n\n"
            "def test_three():\n    assert total(1, 3) == 6\n\n\n"
            "def test_one():\n    assert total(5, 5) == 5\n\n\n"
            "def test_empty():\n    assert total(3, 1) == 0\n",
        },
        [("ranges.py", "range(first, last))", "range(first, last + 1))")],
        ["test_ranges.py::test_three", "test_ranges.py::test_one"],
    ),
    _task(
        "vowels",
        "count_vowels('AEIOU') returns 0; upper-case vowels should count too.",
        {
            "letters.py": "def count_vowels(text):\n"
            "    return sum(1 for c in text if c in 'aeiou')\n",
            "test_letters.py": "from letters import count_vowels\n\n\n"
            "def test_lower():\n    assert count_vowels('banana') == 3\n\n\n"
            "def test_upper():\n    assert count_vowels('AEIOU') == 5\n\n\n"
            "def test_none():\n    assert count_vowels('rhythm') == 0\n",
        },
        [("letters.py", "if c in 'aeiou'", "if c.lower() in 'aeiou'")],
        ["test_letters.py::test_upper"],
    ),
    _task(
        "merge_dicts",
        "merged(a, b) changes a; it should return a new dict and leave both inputs alone.",
        {
            "mappings.py": "def merged(a, b):\n"
            '    """A new dict with the keys of a and b (b wins)."""\n'
            "    a.update(b)\n    return a\n",
            "test_mappings.py": "from mappings import merged\n\n\n"
            "def test_values():\n    assert merged({'x': 1}, {'x': 2, 'y': 3}) == {'x': 2, 'y': 3}\n\n\n"
            "def test_inputs_kept():\n    a = {'x': 1}\n    merged(a, {'y': 2})\n"
            "    assert a == {'x': 1}\n",
        },
        [("mappings.py", "    a.update(b)\n    return a\n", "    return {**a, **b}\n")],
        ["test_mappings.py::test_inputs_kept"],
    ),
    _task(
        "shared_class_state",
        "Two Tally objects share their counts: counting in one shows up in the other.",
        {
            "tally.py": "class Tally:\n    counts = {}\n\n"
            "    def add(self, key):\n        self.counts[key] = self.counts.get(key, 0) + 1\n\n"
            "    def get(self, key):\n        return self.counts.get(key, 0)\n",
            "test_tally.py": "from tally import Tally\n\n\n"
            "def test_counts():\n    t = Tally()\n    t.add('a')\n    t.add('a')\n"
            "    assert t.get('a') >= 2\n\n\n"
            "def test_independent():\n    one, two = Tally(), Tally()\n    one.add('k')\n"
            "    assert two.get('k') == 0\n",
        },
        [
            (
                "tally.py",
                "class Tally:\n    counts = {}\n",
                "class Tally:\n    def __init__(self):\n        self.counts = {}\n",
            )
        ],
        ["test_tally.py::test_independent"],
    ),
    _task(
        "roman",
        "from_roman('IV') returns 6; a smaller numeral before a larger one is subtracted.",
        {
            "roman.py": "VALUES = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n\n\n"
            "def from_roman(text):\n    total = 0\n    for i, c in enumerate(text):\n"
            "        value = VALUES[c]\n"
            "        if i + 1 < len(text) and value > VALUES[text[i + 1]]:\n"
            "            total -= value\n        else:\n            total += value\n"
            "    return total\n",
            "test_roman.py": "from roman import from_roman\n\n\n"
            "def test_add():\n    assert from_roman('III') == 3\n\n\n"
            "def test_subtract():\n    assert from_roman('IV') == 4\n\n\n"
            "def test_year():\n    assert from_roman('MCMXCIV') == 1994\n",
        },
        [("roman.py", "value > VALUES[text[i + 1]]", "value < VALUES[text[i + 1]]")],
        ["test_roman.py::test_subtract", "test_roman.py::test_year"],
    ),
    _task(
        "truncate",
        "shorten('hello world', 8) returns 11 characters; the result, '...' included, must fit "
        "in the limit, and text that fits is returned as it is.",
        {
            "display.py": "def shorten(text, limit):\n    if len(text) >= limit:\n"
            "        return text[:limit] + '...'\n    return text\n",
            "test_display.py": "from display import shorten\n\n\n"
            "def test_long():\n    assert shorten('hello world', 8) == 'hello...'\n\n\n"
            "def test_fits():\n    assert shorten('hello', 5) == 'hello'\n\n\n"
            "def test_short():\n    assert shorten('hi', 5) == 'hi'\n",
        },
        [
            (
                "display.py",
                "    if len(text) >= limit:\n        return text[:limit] + '...'",
                "    if len(text) > limit:\n        return text[: limit - 3] + '...'",
            )
        ],
        ["test_display.py::test_long", "test_display.py::test_fits"],
    ),
    _task(
        "lcm",
        "lcm(4, 6) returns 12.0, a float; it should return the int 12.",
        {
            "divisors.py": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n\n\n"
            "def lcm(a, b):\n    return abs(a * b) / gcd(a, b)\n",
            "test_divisors.py": "from divisors import gcd, lcm\n\n\n"
            "def test_gcd():\n    assert gcd(12, 18) == 6\n\n\n"
            "def test_lcm_type():\n    assert isinstance(lcm(4, 6), int)\n\n\n"
            "def test_lcm_big():\n    assert lcm(10**17 + 1, 10**17) == (10**17 + 1) * 10**17\n",
        },
        [("divisors.py", "abs(a * b) / gcd(a, b)", "abs(a * b) // gcd(a, b)")],
        ["test_divisors.py::test_lcm_type", "test_divisors.py::test_lcm_big"],
    ),
    _task(
        "palindrome",
        "is_palindrome('Never odd or even') is False; case, spaces and punctuation should "
        "not count.",
        {
            "words.py": "def is_palindrome(text):\n    return text == text[::-1]\n",
            "test_words.py": "from words import is_palindrome\n\n\n"
            "def test_word():\n    assert is_palindrome('level')\n\n\n"
            "def test_not():\n    assert not is_palindrome('python')\n\n\n"
            "def test_sentence():\n    assert is_palindrome('Never odd or even')\n\n\n"
            "def test_punctuation():\n    assert is_palindrome('A man, a plan, a canal: Panama!')\n",
        },
        [
            (
                "words.py",
                "    return text == text[::-1]",
                "    text = [c.lower() for c in text if c.isalnum()]\n    return text == text[::-1]",
            )
        ],
        ["test_words.py::test_sentence", "test_words.py::test_punctuation"],
    ),
    _task(
        "moving_average",
        "moving_average([1, 2, 3], 3) returns []; the full window ending at the last item is "
        "missing.",
        {
            "smoothing.py": "def moving_average(values, k):\n"
            "    return [sum(values[i : i + k]) / k for i in range(len(values) - k)]\n",
            "test_smoothing.py": "from smoothing import moving_average\n\n\n"
            "def test_windows():\n    assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]\n\n\n"
            "def test_one_window():\n    assert moving_average([1, 2, 3], 3) == [2.0]\n\n\n"
            "def test_too_short():\n    assert moving_average([1], 2) == []\n",
        },
        [("smoothing.py", "range(len(values) - k)]", "range(len(values) - k + 1)]")],
        ["test_smoothing.py::test_windows", "test_smoothing.py::test_one_window"],
    ),
    _task(
        "overdraft",
        "Withdrawing the whole balance raises 'insufficient funds'; only more than the "
        "balance should.",
        {
            "bank.py": "class Account:\n    def __init__(self, balance=0):\n"
            "        self.balance = balance\n\n    def withdraw(self, amount):\n"
            "        if amount >= self.balance:\n"
            "            raise ValueError('insufficient funds')\n"
            "        self.balance -= amount\n        return self.balance\n",
            "test_bank.py": "from bank import Account\n\n\n"
            "def test_some():\n    assert Account(10).withdraw(3) == 7\n\n\n"
            "def test_all():\n    assert Account(10).withdraw(10) == 0\n\n\n"
            "def test_too_much():\n    try:\n        Account(10).withdraw(11)\n"
            "    except ValueError:\n        return\n    raise AssertionError('allowed')\n",
        },
        [("bank.py", "        if amount >= self.balance:", "        if amount > self.balance:")],
        ["test_bank.py::test_all"],
    ),
    _task(
        "duration",
        "seconds('1h30m') returns 7200 + ...: minutes are counted as hours.",
        {
            "durations.py": "import re\n\nUNITS = {'h': 3600, 'm': 3600, 's': 1}\n\n\n"
            "def seconds(text):\n"
            "    return sum(int(n) * UNITS[u] for n, u in re.findall(r'(\\d+)([hms])', text))\n",
            "test_durations.py": "from durations import seconds\n\n\n"
            "def test_hours():\n    assert seconds('2h') == 7200\n\n\n"
            "def test_mixed():\n    assert seconds('1h30m') == 5400\n\n\n"
            "def test_seconds():\n    assert seconds('45s') == 45\n",
        },
        [("durations.py", "'m': 3600", "'m': 60")],
        ["test_durations.py::test_mixed"],
    ),
    _task(
        "slugify",
        "slugify('Hello, World!') returns 'hello--world-'; runs of other characters should "
        "become one '-', with none at the ends.",
        {
            "urls.py": "import re\n\n\ndef slugify(title):\n"
            "    return re.sub(r'[^a-z0-9]', '-', title.lower())\n",
            "test_urls.py": "from urls import slugify\n\n\n"
            "def test_plain():\n    assert slugify('hello') == 'hello'\n\n\n"
            "def test_punctuation():\n    assert slugify('Hello, World!') == 'hello-world'\n\n\n"
            "def test_digits():\n    assert slugify('Top 10') == 'top-10'\n",
        },
        [
            (
                "urls.py",
                "re.sub(r'[^a-z0-9]', '-', title.lower())",
                "re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')",
            )
        ],
        ["test_urls.py::test_punctuation"],
    ),
    _task(
        "discount",
        "A 25% discount on a 100.0 item gives a price of 25.0 instead of 75.0.",
        {
            "pricing.py": "def discounted(price, rate):\n"
            '    """price after a discount of `rate` (0.25 = 25 %)."""\n'
            "    return round(price * rate, 2)\n",
            "cart.py": "from pricing import discounted\n\n\n"
            "def total(items, rate=0.0):\n"
            "    return round(sum(discounted(p, rate) for p in items), 2)\n",
            "test_cart.py": "from cart import total\n\n\n"
            "def test_no_items():\n    assert total([], 0.5) == 0\n\n\n"
            "def test_discount():\n    assert total([100.0], 0.25) == 75.0\n\n\n"
            "def test_no_discount():\n    assert total([10.0, 5.5]) == 15.5\n",
        },
        [("pricing.py", "round(price * rate, 2)", "round(price * (1 - rate), 2)")],
        ["test_cart.py::test_discount", "test_cart.py::test_no_discount"],
    ),
    _task(
        "version_compare",
        "newer('1.10', '1.9') is False; versions should compare part by part as numbers.",
        {
            "versions.py": "def newer(a, b):\n    return a > b\n",
            "test_versions.py": "from versions import newer\n\n\n"
            "def test_simple():\n    assert newer('2.0', '1.5')\n\n\n"
            "def test_numeric():\n    assert newer('1.10', '1.9')\n\n\n"
            "def test_equal():\n    assert not newer('1.2', '1.2')\n",
        },
        [
            (
                "versions.py",
                "    return a > b\n",
                "    def parts(v):\n        return tuple(int(x) for x in v.split('.'))\n\n"
                "    return parts(a) > parts(b)\n",
            )
        ],
        ["test_versions.py::test_numeric"],
    ),
    _task(
        "top_k",
        "top(values, 2) returns the two smallest values; it should return the k largest, "
        "largest first.",
        {
            "ranking.py": "def top(values, k):\n    return sorted(values)[:k]\n",
            "test_ranking.py": "from ranking import top\n\n\n"
            "def test_top_two():\n    assert top([5, 1, 9, 3], 2) == [9, 5]\n\n\n"
            "def test_all_same():\n    assert top([4, 4, 4], 2) == [4, 4]\n\n\n"
            "def test_zero():\n    assert top([1, 2], 0) == []\n",
        },
        [("ranking.py", "sorted(values)[:k]", "sorted(values, reverse=True)[:k]")],
        ["test_ranking.py::test_top_two"],
    ),
    _task(
        "transpose",
        "transpose([[1, 2, 3]]) raises IndexError; non-square matrices should work.",
        {
            "matrix.py": "def transpose(m):\n"
            "    return [[m[i][j] for j in range(len(m))] for i in range(len(m[0]))]\n",
            "test_matrix.py": "from matrix import transpose\n\n\n"
            "def test_square():\n    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]\n\n\n"
            "def test_row():\n    assert transpose([[1, 2, 3]]) == [[1], [2], [3]]\n\n\n"
            "def test_column():\n    assert transpose([[1], [2]]) == [[1, 2]]\n\n\n"
            "def test_one():\n    assert transpose([[5]]) == [[5]]\n",
        },
        [("matrix.py", "[[m[i][j] for j", "[[m[j][i] for j")],
        ["test_matrix.py::test_square", "test_matrix.py::test_row", "test_matrix.py::test_column"],
    ),
    _task(
        "lru_cache",
        "LRU.get does not mark a key as recently used, so a key just read can be evicted.",
        {
            "cache.py": "from collections import OrderedDict\n\n\nclass LRU:\n"
            "    def __init__(self, size):\n        self.size = size\n"
            "        self.data = OrderedDict()\n\n    def get(self, key):\n"
            "        return self.data.get(key)\n\n    def put(self, key, value):\n"
            "        self.data[key] = value\n        self.data.move_to_end(key)\n"
            "        if len(self.data) > self.size:\n            self.data.popitem(last=False)\n",
            "test_cache.py": "from cache import LRU\n\n\n"
            "def test_put_get():\n    c = LRU(2)\n    c.put('a', 1)\n    assert c.get('a') == 1\n\n\n"
            "def test_evicts_oldest():\n    c = LRU(1)\n    c.put('a', 1)\n    c.put('b', 2)\n"
            "    assert c.get('a') is None\n\n\n"
            "def test_get_refreshes():\n    c = LRU(2)\n    c.put('a', 1)\n    c.put('b', 2)\n"
            "    c.get('a')\n    c.put('c', 3)\n    assert c.get('a') == 1 and c.get('b') is None\n",
        },
        [
            (
                "cache.py",
                "        return self.data.get(key)\n",
                "        if key not in self.data:\n            return None\n"
                "        self.data.move_to_end(key)\n        return self.data[key]\n",
            )
        ],
        ["test_cache.py::test_get_refreshes"],
    ),
    _task(
        "overlap",
        "overlaps((1, 3), (3, 5)) is False, but closed intervals that touch share a point.",
        {
            "intervals.py": "def overlaps(a, b):\n"
            '    """Whether the closed intervals a = (start, end) and b meet."""\n'
            "    return a[0] < b[1] and b[0] < a[1]\n",
            "test_intervals.py": "from intervals import overlaps\n\n\n"
            "def test_inside():\n    assert overlaps((1, 5), (2, 3))\n\n\n"
            "def test_apart():\n    assert not overlaps((1, 2), (4, 5))\n\n\n"
            "def test_touching():\n    assert overlaps((1, 3), (3, 5))\n",
        },
        [("intervals.py", "a[0] < b[1] and b[0] < a[1]", "a[0] <= b[1] and b[0] <= a[1]")],
        ["test_intervals.py::test_touching"],
    ),
    _task(
        "running_max",
        "running_max([3, 1, 4]) returns [3, 3, 3]: the running maximum never updates.",
        {
            "series.py": "def running_max(values):\n    out, best = [], None\n"
            "    for v in values:\n        if best is None or v < best:\n"
            "            best = v if best is None else best\n        out.append(best)\n"
            "    return out\n",
            "test_series.py": "from series import running_max\n\n\n"
            "def test_grows():\n    assert running_max([3, 1, 4]) == [3, 3, 4]\n\n\n"
            "def test_flat():\n    assert running_max([2, 2]) == [2, 2]\n\n\n"
            "def test_empty():\n    assert running_max([]) == []\n",
        },
        [
            (
                "series.py",
                "        if best is None or v < best:\n            best = v if best is None else best\n",
                "        if best is None or v > best:\n            best = v\n",
            )
        ],
        ["test_series.py::test_grows"],
    ),
    _task(
        "csv_line",
        "split_fields('a,\"b,c\",d') returns 4 fields; a comma inside double quotes is part of "
        "the field, and the quotes are removed.",
        {
            "records.py": "def split_fields(line):\n    return line.split(',')\n",
            "test_records.py": "from records import split_fields\n\n\n"
            "def test_plain():\n    assert split_fields('a,b') == ['a', 'b']\n\n\n"
            "def test_quoted():\n    assert split_fields('a,\"b,c\",d') == ['a', 'b,c', 'd']\n\n\n"
            "def test_empty_field():\n    assert split_fields('a,,b') == ['a', '', 'b']\n",
        },
        [
            (
                "records.py",
                "    return line.split(',')\n",
                "    fields, cur, quoted = [], '', False\n    for c in line:\n"
                "        if c == '\"':\n            quoted = not quoted\n"
                "        elif c == ',' and not quoted:\n            fields.append(cur)\n"
                "            cur = ''\n        else:\n            cur += c\n"
                "    return fields + [cur]\n",
            )
        ],
        ["test_records.py::test_quoted"],
    ),
]
TRAIN = 26
"""Tasks [0, TRAIN) train; the rest are held out."""


def task_names(split: str | None = None) -> list[str]:
    """The names of the `train` or `val` tasks (None: all)."""
    chosen = TASKS if split is None else TASKS[:TRAIN] if split == "train" else TASKS[TRAIN:]
    return [t.name for t in chosen]


def get_task(name: str, field_name: str = "interaction_kwargs.task") -> SweTask:
    """The shipped task `name`; an unknown one raises `ConfigError` naming `field_name` and
    listing the tasks."""
    for task in TASKS:
        if task.name == name:
            return task
    raise ConfigError(
        f"{field_name}={name!r} is not a shipped SWE task; choose from {task_names()}"
    )
