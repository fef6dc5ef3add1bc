"""The README's "Images (vision-language models)" example runs as written and prints what it says."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_images_example_runs(capsys):
    text = README.read_text()
    start = text.index("## Images (vision-language models)")
    section = text[start : text.find("\n## ", start + 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    exec(compile(block, str(README), "exec"), {"__name__": "images_md"})  # noqa: S102 (our docs)
    printed = capsys.readouterr().out.strip().splitlines()
    claimed = re.findall(r"`([^`]+)`", section[section.index("```\nprints") + 4 :])
    assert printed == claimed[: len(printed)] and printed
