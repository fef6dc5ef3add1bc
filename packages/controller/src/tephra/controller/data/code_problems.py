"""A small set of programming problems with unit tests, written for tephra: the shipped data
of the code-RL preset (`data.source=code_problems`), scored by the sandboxed code scorer.

Each problem reads standard input and prints its answer; its tests are verl's stdin format
(`{"inputs": [...], "outputs": [...]}`). The first 16 problems train, the last 8 are held out.
"""

from __future__ import annotations

from typing import Any

from tephra.episodes.prompt import Prompt

# The example program shows the form the tests need (read with input(), print the bare
# answer): without it SmolLM2-135M's programs print sentences and prompts and pass no test
# case of any problem (greedy: 0 of 24 problems with a passing case; with it: 3 of 24).
INSTRUCTION = (
    "Write a complete Python program that reads the input with input() and prints only the "
    "answer, nothing else. Put the program in one ```python code block, for example:\n"
    "```python\nn = int(input())\nprint(n * 2)\n```"
)

# (statement, [(stdin, expected stdout), ...]); tests cover an edge case each
PROBLEMS: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "Read two integers a and b on one line and print a + b.",
        [("2 3\n", "5"), ("-4 4\n", "0"), ("100 250\n", "350")],
    ),
    (
        "Read a line of text and print it reversed.",
        [("abc\n", "cba"), ("racecar\n", "racecar"), ("a b\n", "b a")],
    ),
    (
        "Read an integer n (0 <= n <= 12) and print n! (n factorial).",
        [("0\n", "1"), ("5\n", "120"), ("10\n", "3628800")],
    ),
    (
        "Read an integer n and print 'even' if it is even, else 'odd'.",
        [("4\n", "even"), ("7\n", "odd"), ("0\n", "even")],
    ),
    (
        "Read a line of integers separated by spaces and print the largest.",
        [("3 9 2\n", "9"), ("-5 -2 -9\n", "-2"), ("7\n", "7")],
    ),
    (
        "Read a line of text and print how many vowels (a, e, i, o, u, either case) it has.",
        [("hello\n", "2"), ("AEIOU xyz\n", "5"), ("rhythm\n", "0")],
    ),
    (
        "Read an integer n and print the sum of its decimal digits (ignore a minus sign).",
        [("123\n", "6"), ("-45\n", "9"), ("0\n", "0")],
    ),
    (
        "Read two positive integers a and b on one line and print their greatest common divisor.",
        [("12 18\n", "6"), ("7 13\n", "1"), ("100 10\n", "10")],
    ),
    (
        "Read an integer n >= 0 and print the n-th Fibonacci number (F(0) = 0, F(1) = 1).",
        [("0\n", "0"), ("1\n", "1"), ("10\n", "55")],
    ),
    (
        "Read a line of integers separated by spaces and print them sorted ascending, separated by spaces.",
        [("3 1 2\n", "1 2 3"), ("5\n", "5"), ("-1 -3 2\n", "-3 -1 2")],
    ),
    (
        "Read a line of text and print the number of words (separated by whitespace).",
        [("hello world\n", "2"), ("one\n", "1"), ("  a  b  c \n", "3")],
    ),
    (
        "Read an integer n and print the squares 1, 4, ..., n*n on one line separated by spaces.",
        [("3\n", "1 4 9"), ("1\n", "1"), ("5\n", "1 4 9 16 25")],
    ),
    (
        "Read an integer n >= 2 and print 'yes' if it is prime, else 'no'.",
        [("2\n", "yes"), ("9\n", "no"), ("97\n", "yes")],
    ),
    (
        "Read a word and print 'yes' if it reads the same backwards, else 'no'.",
        [("level\n", "yes"), ("tephra\n", "no"), ("a\n", "yes")],
    ),
    (
        "Read two integers a and b on one line and print |a - b|.",
        [("3 8\n", "5"), ("8 3\n", "5"), ("-2 2\n", "4")],
    ),
    (
        "Read a line of integers separated by spaces and print how many distinct values it has.",
        [("1 2 2 3\n", "3"), ("5 5 5\n", "1"), ("1 -1\n", "2")],
    ),
    (
        "Read a line of integers separated by spaces and print their sum.",
        [("1 2 3\n", "6"), ("-5 5\n", "0"), ("42\n", "42")],
    ),
    (
        "Read a line of text and print it in upper case.",
        [("abc\n", "ABC"), ("Hello World\n", "HELLO WORLD"), ("123\n", "123")],
    ),
    (
        "Read an integer n >= 1 and print the numbers 1..n on one line, separated by spaces.",
        [("1\n", "1"), ("4\n", "1 2 3 4"), ("6\n", "1 2 3 4 5 6")],
    ),
    (
        "Read a line of integers separated by spaces and print the smallest.",
        [("4 2 8\n", "2"), ("-1 -7\n", "-7"), ("0\n", "0")],
    ),
    (
        "Read two integers a and b >= 0 on one line and print a to the power b.",
        [("2 10\n", "1024"), ("5 0\n", "1"), ("-3 3\n", "-27")],
    ),
    (
        "Read a line of text and print how many times the letter 'a' occurs in it.",
        [("banana\n", "3"), ("xyz\n", "0"), ("Aa\n", "1")],
    ),
    (
        "Read a line of integers separated by spaces and print how many of them are even.",
        [("1 2 3 4\n", "2"), ("1 3\n", "0"), ("0 -2\n", "2")],
    ),
    (
        "Read an integer n >= 0 and print it in binary, without a prefix.",
        [("5\n", "101"), ("0\n", "0"), ("8\n", "1000")],
    ),
]
TRAIN = 16
"""Problems [0, TRAIN) train; the rest are held out."""


def code_problem_records(split: str, size: int | None = None) -> list[Prompt]:
    """The `train` or `val` problems (at most `size`) as verl-format records: data_source
    `code`, ground truth `{"inputs": [...], "outputs": [...]}`."""
    chosen = PROBLEMS[:TRAIN] if split == "train" else PROBLEMS[TRAIN:]
    out = []
    for i, (statement, tests) in enumerate(chosen[:size]):
        truth: dict[str, Any] = {
            "inputs": [stdin for stdin, _ in tests],
            "outputs": [stdout for _, stdout in tests],
        }
        index = i if split == "train" else TRAIN + i
        out.append(
            Prompt(
                [{"role": "user", "content": f"{statement}\n\n{INSTRUCTION}"}],
                "code",
                truth,
                {"index": index, "split": split},
            )
        )
    return out
