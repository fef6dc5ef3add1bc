"""The agent section of the README runs as written (the examples of writing a tool and an agent loop)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def agent_section() -> str:
    text = README.read_text()
    start = text.index("## Agent loop and tools")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_readme_agent_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", agent_section(), re.DOTALL)
    assert len(blocks) == 4
    namespace: dict = {"__name__": "agent_md"}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 (our own docs)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ToolResult(text='recorded', error=None, metrics={}) 1.0"
    turns, trained, total = map(int, lines[1].split())
    assert turns == 2 and 0 < trained < total  # the user turn between the answers is not trained
    assert lines[2].startswith("torch.Size([4, ")
