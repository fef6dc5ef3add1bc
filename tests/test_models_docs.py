"""docs/models.md is the current output of scripts/models_docs.py (the family support table
that packages/engine-fsdp/tests/test_engine_fsdp_families.py keeps true)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "models_docs.py"


def test_model_support_table_is_current() -> None:
    spec = importlib.util.spec_from_file_location("models_docs_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    current = script.OUT.read_text() if script.OUT.exists() else ""
    assert current == script.render(), (
        f"{script.OUT} is stale (a family's status changed, or transformers did); "
        f"regenerate it with `{script.COMMAND}` and commit it"
    )
