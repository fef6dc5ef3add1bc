"""`uv run apps/sft [overrides]` runs tephra.apps.sft.cli (`--help` first, then the app)."""

from tephra.apps.sft.cli import main

main()
