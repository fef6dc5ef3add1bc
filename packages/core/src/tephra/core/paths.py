"""Where tephra keeps what it builds or measures once per machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$TEPHRA_CACHE` or `~/.cache/tephra`: converted models, tiny test models, timed kernel
    choices. Ray workers inherit the variable, so every process of a run shares the folder."""
    return Path(os.environ.get("TEPHRA_CACHE", Path.home() / ".cache" / "tephra"))
