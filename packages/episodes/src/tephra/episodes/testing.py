"""Test helpers of the episodes package: a small MCP server script, and a test file run again
as an unprivileged user."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tephra.episodes.tools.folder_tree import remove_tree

CALC_MCP_SERVER = '''
from mcp.server.mcpserver import MCPServer
server = MCPServer("calc")

@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@server.tool()
def neg(a: int) -> int:
    """Negate an integer."""
    return -a

if __name__ == "__main__":
    server.run("stdio")
'''
"""An MCP stdio server script with two tools (`add`, `neg`): write it to a file and start it
with `sys.executable` (tests of MCP tools and of their shutdown)."""


NOBODY = 65534
"""The uid and gid an unprivileged rerun takes."""


def rerun_unprivileged(
    test_file: str,
    tmp_path: Path,
    home: Path,
    env: dict[str, str],
    timeout_s: float,
    pytest_args: str = "",
) -> subprocess.CompletedProcess[str]:
    """The pytest file `test_file` run again as uid 65534 (`setpriv`), for a root test run
    to show that what it checks holds for an ordinary user too: its stdout and stderr.

    The interpreter may live under a 0700 home (pyenv in /root): a private mount namespace
    shows its prefix alone, at its own path, under an empty 0755 folder, for that run only,
    changing nothing on the host. `home` is the caller's home there (owned by 65534), `env`
    the run's whole environment (its HOME is set to `home`); the run gets a fresh base for
    its tmp_path (pytest's numbered folders of earlier runs would be removed recursively at
    its exit). `home` and that base are removed afterwards with the sandbox's safe walk."""
    python = os.path.realpath(sys.executable)
    hidden = next(
        (
            str(p)
            for p in reversed(Path(python).parents)
            if p != Path("/") and not os.stat(p).st_mode & 0o001
        ),
        None,
    )
    reveal = ""
    if hidden is not None:
        prefix = os.path.realpath(sys.base_prefix)
        reveal = (
            f"mkdir -p {tmp_path}/view && mount --bind {prefix} {tmp_path}/view && "
            f"mount -t tmpfs -o mode=755 tmpfs {hidden} && mkdir -p {prefix} && "
            f"mount --bind {tmp_path}/view {prefix} && "
        )
    basetemp = Path(tempfile.mkdtemp(prefix="tephra-nested-"))
    os.chown(basetemp, NOBODY, NOBODY)
    inner = (
        f"{reveal}exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups -- "
        f"{sys.executable} -m pytest {test_file} -p no:xdist -p no:cacheprovider -q -rs "
        f"-o addopts='' --import-mode=importlib --rootdir=/tmp --basetemp={basetemp}/t "
        f"-p no:randomly -W ignore::DeprecationWarning {pytest_args}"
    )
    try:
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**env, "HOME": str(home)},
            cwd="/",
        )
    finally:
        remove_tree(str(home))
        remove_tree(str(basetemp))


def model_turns(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The model turns of a trajectory's response: its runs of tokens with mask 1 (the
    environment's and tools' tokens between them have mask 0)."""
    turns: list[list[int]] = []
    for k, (t, m) in enumerate(zip(ids, mask)):
        if m:
            if k == 0 or not mask[k - 1]:
                turns.append([])
            turns[-1].append(t)
    return turns
