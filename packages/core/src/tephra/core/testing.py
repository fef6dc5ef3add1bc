"""Helpers for the packages' own tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any


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


def run_in_throwaway_project(
    folder: Path, uv: str, packages: Path, members: list[str], script: str, timeout_s: int = 300
) -> Any:
    """Run `script` in a fresh interpreter of a throw-away uv project in `folder` whose only
    dependency is the first of `members` (folders under the workspace's `packages`, installed
    as `tephra-<folder>`; the others are its tephra dependencies, as path sources), synced from
    the shared uv cache (offline when no registry answers); returns the JSON value the script
    printed last. The way a test shows that a package installs and works alone, without the
    rest of the workspace."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = "\n".join(f'tephra-{m} = {{ path = "{packages / m}" }}' for m in members)
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [project]
        name = "{folder.name}"
        version = "0.0.0"
        requires-python = ">=3.11"
        dependencies = ["tephra-{members[0]}"]

        [tool.uv]
        # the workspace's torch, so the shared uv cache already holds it
        constraint-dependencies = ["torch>=2.13,<2.14"]
        environments = ["sys_platform == 'linux'"]

        [tool.uv.sources]
        """)
        + sources
        + "\n"
    )
    (folder / "script.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

    def run(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
        )

    sync = run(uv, "sync", "--python", "3.11", timeout=600)
    if sync.returncode != 0:  # no registry reachable: the shared uv cache has everything
        sync = run(uv, "sync", "--offline", "--python", "3.11", timeout=600)
    if sync.returncode != 0:
        raise RuntimeError(f"uv sync of the throw-away project failed:\n{sync.stderr}")
    out = run(str(folder / ".venv" / "bin" / "python"), "script.py", timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"the script failed in the throw-away project:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])
