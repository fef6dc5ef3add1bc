"""Writes docs/models.md, the table of model families on engine=fsdp, from the tables the
family matrix test keeps true (`tephra.engine_fsdp.families`, `.family_matrix`).

uv run python scripts/models_docs.py           # rewrite docs/models.md
uv run python scripts/models_docs.py --check   # exit 1 when it is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from tephra.engine_fsdp.family_matrix import render_markdown

OUT = Path(__file__).resolve().parent.parent / "docs" / "models.md"
COMMAND = "uv run python scripts/models_docs.py"


def render() -> str:
    """The whole of docs/models.md."""
    return render_markdown(COMMAND)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is stale; run `{COMMAND}`")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
