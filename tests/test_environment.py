"""The environment `uv sync` builds carries bytecode for its installed modules, so no process of
a run compiles torch or transformers from source where Python writes no .pyc files."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest


@pytest.mark.parametrize("name", ["torch", "transformers.modeling_utils", "ray", "tensordict"])
def test_installed_modules_have_bytecode(name: str) -> None:
    module = importlib.import_module(name)
    cached = Path(importlib.util.cache_from_source(module.__file__))
    assert cached.exists(), (
        f"{name} has no bytecode at {cached}: build the environment with `uv sync` "
        "(the root pyproject.toml sets [tool.uv] compile-bytecode = true)"
    )
