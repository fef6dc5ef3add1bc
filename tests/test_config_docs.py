"""docs/config.md and the apps' config indexes (read by `--help`) are the current output of
scripts/config_docs.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tephra.core.config import all_dotted_keys

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "config_docs.py"


def _script():
    spec = importlib.util.spec_from_file_location("config_docs_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current() -> None:
    script = _script()
    for path, expected in script.outputs().items():
        current = path.read_text() if path.exists() else ""
        assert current == expected, (
            f"{path} is stale (a config field, default or docstring changed); "
            f"regenerate it with `{script.COMMAND}` and commit it"
        )


def test_reference_covers_every_key_of_each_app() -> None:
    script = _script()
    text = script.OUT.read_text()
    for _, cls, _ in script.APPS:
        for key in all_dotted_keys(cls):
            assert f"| `{key}` |" in text, f"{key} of {cls.__name__} missing from docs/config.md"
