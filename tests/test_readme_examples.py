"""Every package README's Python examples run as written: a README's blocks run in order in one
fresh interpreter, as a reader would paste them into one session."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(ROOT.glob("packages/*/README.md")) + sorted(ROOT.glob("apps/*/README.md"))
# A block whose first line is `# not run in tests` needs something CI does not have (a GPU).
SKIP_MARK = "# not run in tests"


def python_blocks(readme: Path) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    return [b for b in blocks if not b.startswith(SKIP_MARK)]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_readme_example_runs(readme, tmp_path):
    blocks = python_blocks(readme)
    if not blocks:
        pytest.fail(f"{readme.relative_to(ROOT)} has no runnable ```python example")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = tmp_path / "readme_examples.py"
    # The guard lets examples that start processes (spawn) import this file safely.
    body = "\n".join(blocks).replace("\n", "\n    ")
    script.write_text(f"if __name__ == '__main__':\n    {body}\n")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (
        f"{readme.relative_to(ROOT)} examples failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
