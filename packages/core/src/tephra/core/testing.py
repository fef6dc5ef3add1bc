"""Helpers for the packages' own tests."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


def run_readme_section(readme: Path, heading: str) -> tuple[list[str], list[str]]:
    """Run the one ```python block of the README section that starts with `heading` (in a
    fresh namespace, as a reader would paste it) and return (the lines it printed, the
    `code spans` that follow the word "prints" after the block): a docs test asserts that the
    README says what the example prints."""
    text = readme.read_text()
    start = text.index(heading)
    section = text[start : text.find("\n## ", start + 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(readme), "exec"), {"__name__": "readme"})  # noqa: S102 (our docs)
    claimed = re.findall(r"`([^`]+)`", section[section.index("```\nprints") + 4 :])
    return out.getvalue().strip().splitlines(), claimed
